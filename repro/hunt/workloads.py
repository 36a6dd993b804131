"""Workload nemeses in a hunt (``repro.nemeses``): the workload file of a hunt, a workload's variant tables, a
trial's workload, and the admin calls' answers in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from repro.catalogue import Catalogue, HuntError
from repro.hunt.options import HuntOptions
from repro.hunt.plan import Trial

_NEMESES_CACHE: dict[str, Any] = {}


def nemeses_for(opts: HuntOptions, cat: Catalogue) -> Any:
    """The workload file (``repro.nemeses.NemesisCatalogue``) of a hunt: ``opts.workload_file`` or the catalogue's."""
    from repro import nemeses

    path = Path(opts.workload_file) if opts.workload_file else nemeses.default_workload_file(cat.path)
    key = str(path.resolve())
    if key not in _NEMESES_CACHE:
        try:
            _NEMESES_CACHE[key] = nemeses.load_nemeses(path)
        except nemeses.NemesisError as e:
            raise HuntError(str(e)) from None
    return _NEMESES_CACHE[key]


def workload_extra(spec: Any) -> dict:
    """A workload's variant tables (``abort``, ``workload``) for a scenario file (``repro.nemeses.NemesisSpec``)."""
    out: dict = {}
    if spec is None:
        return out
    if spec.abort is not None:
        out["abort"] = dict(spec.abort)
    if spec.workload is not None:
        out["workload"] = spec.workload.model_dump(exclude_none=True, exclude_defaults=True)
    return out


def trial_extra(opts: HuntOptions, cat: Catalogue, t: Trial) -> dict:
    """The variant tables of trial ``t``'s workload ({} for the base scenario's own burst)."""
    if not t.workload:
        return {}
    return workload_extra(nemeses_for(opts, cat).workload(t.workload))


def admin_summary(admin: Sequence[dict]) -> str:
    """``DELETE /hicache/storage-backend → 400; POST /flush_cache → 400, 400, 200`` (per call: each answer)."""
    by: dict[tuple, list[str]] = {}
    for a in sorted(admin, key=lambda a: (a.get("call", 0), a.get("n", 0))):
        ans = str(a.get("http_status")) if a.get("http_status") is not None else ("timeout" if a.get("timeout") else "not called" if not a.get("done", True) else "error")
        by.setdefault((a.get("call", 0), a.get("method"), a.get("path")), []).append(ans)
    return "; ".join(f"{m} {p} → {', '.join(v)}" for (_, m, p), v in by.items())
