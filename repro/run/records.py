"""What the injector recorded, read for a run: the versions it saw (env.json) and the per-injection counts by rank."""

from __future__ import annotations

import platform
import sys
from typing import Any

from repro.capture import py_spy_described
from repro.scenario import Variant
from repro.verdict import InjectionCheck


def _nature(inj: Any) -> str:
    """natural / forced / observe of an injection's action (``repro.scenario.nature_of``)."""
    from repro.scenario import nature_of

    return nature_of(inj.action) if getattr(inj, "action", None) is not None else ""


def collect_versions(injector_dir: Any, python: str, adapter: Any) -> dict:
    """Versions for env.json: harness Python, platform, target interpreter, the run's engine (``engine``: the adapter's
    name) and the python/torch/engine versions the injector's loaded markers recorded inside the server (the harness
    never imports the engine), plus py-spy's version and path (``py-spy 0.4.3 (/usr/bin/py-spy)``). The engine's version is ``engine_version`` and, for readers of
    older folders, also under the adapter's ``ref_location.version_key`` (SGLang: ``sglang``).

    Args:
        injector_dir: the injector folder, or the ``InjectorReport`` already read from it (not read again).
        python: the server's interpreter.
        adapter: the run's adapter.
    """
    from repro import injection_records

    info: dict[str, Any] = {
        "harness_python": sys.version.split()[0],
        "platform": platform.platform(),
        "target_python": python,
        "engine": adapter.name,
    }
    key = adapter.ref_location.version_key or adapter.ref_location.package
    try:
        rep = injector_dir if isinstance(injector_dir, injection_records.InjectorReport) else \
            injection_records.read_injector_dir(injector_dir)
        for m in rep.markers:
            for k, val in (("python", m.python), ("torch", m.torch), ("engine_version", m.version_of(key))):
                if val and k not in info:
                    info[k] = val
    except Exception:
        pass
    if info.get("engine_version") and key:
        info[key] = info["engine_version"]
    info["py_spy"] = py_spy_described()  # "py-spy 0.4.3 (/path/to/py-spy)": the version first, the path after
    from repro.releases import describe_python

    how = describe_python(python) if python else None
    if how:  # a recipe-made release testbed: which release, and whether its own venv or an overlay ran
        info["testbed"] = how
    return info


def injection_checks(injector_dir: Any, variant: Variant, rank_pids: dict[int, int]) -> tuple[list[int], list[int], list[InjectionCheck], Any]:
    """Read the injector records: ranks loaded, ranks armed, per-injection counts by rank (after the last arming).

    ``injector_dir``: the injector folder, or the ``InjectorReport`` already read from it (not read again).
    Returns ``(loaded, armed, checks, report)``."""
    from repro import injection_records

    rep = injector_dir if isinstance(injector_dir, injection_records.InjectorReport) else \
        injection_records.read_injector_dir(injector_dir)
    ranks = sorted(rank_pids)
    loaded = rep.ranks_loaded(ranks)
    armed = rep.ranks_armed(ranks)
    checks = []
    for inj in variant.injections:
        c = rep.counts_by_rank(inj.id)
        site = rep.resolved_site(inj.id) or inj.site[0]
        checks.append(InjectionCheck(inj.id, site, c["entered"], c["matched"], c["fired"], rep.absent_detail(inj.id),
                                     getattr(inj, "required", True), _nature(inj), _outcomes(rep, inj.id)))
    return loaded, armed, checks, rep


def _outcomes(rep: Any, injection_id: str) -> dict[int, tuple[str, ...]]:
    """rank -> what the injection's natural action did there after firing (a fault: whether its thread died;
    ``repro.injection_records.fault_outcomes``), from the fires of the latest arming; ranks with nothing left out."""
    from repro.injection_records import fault_outcomes

    by_rank: dict[int, list] = {}
    for f in rep.fires(injection_id):
        rank = f.rank if f.rank is not None else rep.rank_of(f.pid)
        if rank is not None:
            by_rank.setdefault(rank, []).append(f)
    return {k: tuple(o) for k, fs in sorted(by_rank.items()) if (o := fault_outcomes(fs))}
