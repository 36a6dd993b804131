"""Preflight (``repro sites``): resolve a scenario's sites inside the target interpreter, without launching a server.

The harness never imports sglang: it runs the injector's own resolution code (``repro_injector.resolve.preflight``)
in a subprocess of the target interpreter, which imports each site's module (falling back to reading its source
when the import itself fails, e.g. a CUDA-only dependency) and lists the nearest existing names (``difflib``) when
something is missing. An injection is *satisfied* when one of its site alternatives resolves. Gate patterns that name
functions absent in this version are warnings (e.g. a fix's bulk method in an unpatched release), not errors.

One resolver, three users: ``repro sites`` (:func:`check_sites`, ``mode="import"``); every launch, before any folder
or server (:func:`check_before_launch`, ``mode="source"``: the same resolver reading sources only, ~0.2 s, with the
server's PYTHONPATH; refuses only what the source shows cannot exist); and the healthy server's check before the
first burst (:func:`check_launched_sites`: the live injector's records, the resolver only for what is not patched).
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from repro import resources
from repro.releases import never_built
from repro.scenario import Scenario

PREFLIGHT_TIMEOUT_S = 600.0
_MARK = "REPRO-PREFLIGHT "


class SitesPreflightError(RuntimeError):
    """The preflight subprocess could not run or gave no answer (message has the interpreter and its output tail).

    Attributes:
        bad_interpreter: True when ``--python`` itself is the problem (not found, or not a Python: it exited 0 or
            printed nothing without answering): bad input, exit 2; False when a Python crashed (exit 1).
    """

    def __init__(self, message: str, bad_interpreter: bool = False) -> None:
        super().__init__(message)
        self.bad_interpreter = bad_interpreter


@dataclass(frozen=True)
class AlternativeCheck:
    """One site alternative: ``status`` is resolved | absent | unverified | error; ``static`` = read from source."""

    site: str
    status: str
    detail: str
    suggestions: tuple[str, ...]
    static: bool


@dataclass(frozen=True)
class InjectionSites:
    """Resolution of one injection of one variant."""

    variant: str
    injection_id: str
    alternatives: tuple[AlternativeCheck, ...]
    warnings: tuple[str, ...]

    @property
    def resolved(self) -> Optional[AlternativeCheck]:
        """The first alternative that resolved (the one the injector would patch), else None."""
        return next((a for a in self.alternatives if a.status == "resolved"), None)

    @property
    def satisfied(self) -> bool:
        return self.resolved is not None


@dataclass(frozen=True)
class SitesReport:
    """Everything ``repro sites`` found; ``ok`` iff every injection is satisfied."""

    scenario: str
    python: str
    python_version: str
    versions: dict[str, Optional[str]]
    injections: tuple[InjectionSites, ...]
    engine: str = ""  # the run's adapter's name
    package: str = ""  # its importable package (``ref_location.package``)
    engine_version: Optional[str] = None  # that package's version in ``python``

    @property
    def ok(self) -> bool:
        return all(i.satisfied for i in self.injections)

    def as_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "python": self.python,
            "python_version": self.python_version,
            "engine": self.engine,
            "engine_version": self.engine_version,
            "versions": self.versions,
            "ok": self.ok,
            "injections": [
                {
                    "variant": i.variant,
                    "id": i.injection_id,
                    "satisfied": i.satisfied,
                    "resolved": i.resolved.site if i.resolved else None,
                    "alternatives": [a.__dict__ for a in i.alternatives],
                    "warnings": list(i.warnings),
                }
                for i in self.injections
            ],
        }


def _run_preflight(python: str, request: dict, timeout_s: float, env: Optional[dict] = None) -> dict:
    code = ("import sys; sys.path.insert(0, %r); from repro_injector.resolve import preflight_main; preflight_main()"
            % str(resources.injectors_dir()))
    run_env = dict(os.environ if env is None else env)
    run_env.pop("REPRO_PLAN", None)
    try:
        proc = subprocess.run([python, "-c", code], input=json.dumps(request), capture_output=True, text=True,
                              timeout=timeout_s, env=run_env)
    except FileNotFoundError:
        raise SitesPreflightError(f"interpreter {python} not found (pass --python PATH to a Python that has "
                                  f"{request.get('package') or 'the engine'})", bad_interpreter=True) from None
    except subprocess.TimeoutExpired:
        raise SitesPreflightError(f"preflight in {python} took more than {timeout_s:.0f} s (importing the sites' modules)") from None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])
    tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-15:])
    if proc.returncode == 0 or not tail.strip():  # a Python running the resolver answers or says why it could not
        pkg = request.get("package") or "the engine"
        said = "printed nothing" if not tail.strip() else f"printed no answer ({tail.strip().splitlines()[-1][:120]!r})"
        raise SitesPreflightError(f"{python} {said} and exited {proc.returncode} when asked to resolve the sites: it is "
                                  f"not a Python interpreter with {pkg} installed; pass --python PATH of one where "
                                  f"`import {pkg}` works", bad_interpreter=True)
    raise SitesPreflightError(f"preflight in {python} failed (exit {proc.returncode}):\n{tail}")


def check_sites(scenario: Scenario, python: Union[str, Path], variant: Optional[str] = None,
                timeout_s: float = PREFLIGHT_TIMEOUT_S, env: Optional[dict] = None, *,
                variants: Optional[Sequence[str]] = None, mode: str = "import", adapter: Any = None) -> SitesReport:
    """Resolve every site of ``variant`` (all variants when None) inside ``python``.

    Args:
        scenario: a validated scenario.
        python: the target interpreter (the one that runs the server).
        variant: a variant name, or None for all variants.
        timeout_s: bound on the subprocess in seconds (importing sglang's scheduler takes ~12 s on 2 cores).
        env: environment of the subprocess (default: this process's, without ``REPRO_PLAN``); give the server's
            (``Adapter.launch_env``) so overlays and stand-ins on its PYTHONPATH count.
        variants: these variants (names) instead of ``variant``.
        mode: ``import`` (``repro sites``: each module imported, exact) or ``source`` (the check before a launch:
            nothing imported, ~0.1 s plus the interpreter's start; sites the source cannot decide are
            ``unverified``, gate patterns and action methods ``unchecked``).
        adapter: the run's adapter (default: the scenario's ``server.adapter``): which package's version is asked
            for, and which release's tree-cache factory a resolving site is checked against.
    Returns:
        A SitesReport, one InjectionSites per injection in file order.
    Raises:
        ScenarioError: ``variant`` is not in the scenario (lists the known names).
        SitesPreflightError: the interpreter is missing, timed out, or crashed before answering.
    """
    if variants is not None:
        chosen = [scenario.variant(v) for v in dict.fromkeys(variants)]
    else:
        chosen = scenario.variants if variant is None else [scenario.variant(variant)]
    variants = chosen
    if adapter is None:
        from repro.targets.registry import get_adapter

        adapter = get_adapter(scenario.server.adapter)
    loc = adapter.ref_location
    key = loc.version_key or loc.package
    request: dict[str, Any] = {"mode": mode, "versions": ["torch", *dict.fromkeys(k for k in (key, loc.package) if k)],
                               "package": loc.package, "injections": []}
    keys = []
    for v in variants:
        for inj in v.injections:
            method = getattr(inj.action, "method", None)
            request["injections"].append({
                "id": inj.id,
                "alternatives": list(inj.site),
                "patterns": list(inj.gate.called_from) + list(inj.gate.not_called_from),
                "method": method,
            })
            keys.append((v.name, inj))
    answer = _run_preflight(str(python), request, timeout_s, env)
    release = answer.get("versions", {}).get(key)
    results = []
    for (vname, inj), got in zip(keys, answer["injections"]):
        alts = tuple(AlternativeCheck(a["site"], a["status"], a.get("detail", ""), tuple(a.get("suggestions") or ()),
                                      bool(a.get("static"))) for a in got["alternatives"])
        warnings = []
        for p in got["patterns"]:
            if p["status"] in ("absent", "error"):
                near = f"; nearest: {', '.join(p['suggestions'])}" if p.get("suggestions") else ""
                warnings.append(f"gate pattern {p['pattern']} names nothing in this version ({p['detail']}){near}")
            elif p["status"] == "unverified":
                warnings.append(f"gate pattern {p['pattern']}: {p['detail']}")
        m = got.get("method")
        if m and m.get("status") != "resolved":
            warnings.append(f"action method {m['method']} not found on the site's class ({m.get('detail', '')})")
        for a in alts:
            if a.status == "unverified":
                warnings.append(f"{a.site}: {a.detail}")
            elif a.status == "resolved" and release is not None:
                dead = never_built(a.site, release, adapter)
                if dead:
                    warnings.append(dead)
        results.append(InjectionSites(vname, inj.id, alts, tuple(warnings)))
    return SitesReport(scenario.name, str(python), answer.get("python", ""), answer.get("versions", {}), tuple(results),
                       adapter.name, loc.package, release)


class SitesUnresolved(ValueError):
    """Some injection of a launched plan has no site alternative that resolves in the target interpreter.

    ``str()`` is one line naming each such injection, its alternatives, why each is absent and the nearest
    existing names (as ``repro sites`` lists them); ``reason`` is the same for a verdict.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.reason = message


def unresolved_message(report: "SitesReport", variants: Optional[set] = None) -> Optional[str]:
    """One line naming every unsatisfied injection of ``report`` (only ``variants`` when given), or None."""
    parts = []
    for inj in report.injections:
        if inj.satisfied or (variants is not None and inj.variant not in variants):
            continue
        alts = []
        for a in inj.alternatives:
            near = f" (nearest: {', '.join(a.suggestions)})" if a.suggestions else ""
            alts.append(f"{a.site} is {a.status}: {a.detail}{near}")
        parts.append(f"variant {inj.variant}, injection {inj.injection_id}: " + "; ".join(alts))
    if not parts:
        return None
    return (f"site(s) absent in {report.python}'s {report.package} ({report.engine_version or 'version unknown'}): "
            + " | ".join(parts) + "; fix the scenario's site (`repro sites SCENARIO` lists the nearest names)")


def check_launched_sites(scenario: Scenario, variant_names: Sequence[str], injector_dir: Path, python: str,
                         env: Optional[dict] = None, timeout_s: float = PREFLIGHT_TIMEOUT_S, adapter: Any = None) -> None:
    """After the server became healthy, make sure every injection of the plan can be patched; else stop the run.

    Fast path, no subprocess: every injection is already patched in some process of the server (its loaded
    markers in ``injector_dir`` say so — sglang imports the scheduler's modules before ``/health`` answers). Only
    when one is not, the injector's resolver runs in the target interpreter (:func:`check_sites`, ~15 s on 2
    cores) with the server's environment, so a site in a module imported later is not refused.

    Args:
        scenario: the launched scenario.
        variant_names: the variants whose injections are in the plan.
        injector_dir: the run's injector folder (loaded markers).
        python: the server's interpreter.
        env: the server's environment (PYTHONPATH with overlays and the testbed's stand-ins).
        adapter: the run's adapter (default: the scenario's).
    Raises:
        SitesUnresolved: an injection has no alternative that resolves (message with the nearest names).
    """
    from repro import injection_records

    names = [n for n in variant_names if n]
    injections = [inj for n in names for inj in scenario.variant(n).injections]
    try:
        rep = injection_records.read_injector_dir(injector_dir)
    except Exception:  # no injector folder: the injector was not loaded, which the verdict names
        return
    if not rep.markers:
        return  # not loaded anywhere: the verdict says "injector not loaded on rank k"
    missing = [inj for inj in injections if rep.resolved_site(inj.id) is None]
    if not missing:
        return
    try:
        report = check_sites(scenario, python, None, timeout_s=timeout_s, env=env, adapter=adapter)
    except SitesPreflightError:
        return  # the resolver could not run: the run goes on and the verdict names what was not entered
    msg = unresolved_message(report, set(names))
    if msg:
        raise SitesUnresolved(msg)


PRELAUNCH_TIMEOUT_S = 60.0  # the check before a launch reads sources only (~0.1 s plus the interpreter's start)


def check_before_launch(scenario: Scenario, scenario_path: Union[str, Path], variant_names: Sequence[str],
                        python: str, env: Optional[dict] = None, timeout_s: float = PRELAUNCH_TIMEOUT_S,
                        adapter: Any = None) -> None:
    """Before any server or evidence folder exists: refuse a plan with an injection none of whose sites can exist.

    The same resolver as ``repro sites`` (:func:`check_sites`, the injector's ``repro_injector.resolve`` run in
    the target interpreter), in its ``source`` mode: one subprocess that imports nothing of the engine and reads
    the sites' modules from the source on the server's PYTHONPATH (``env``: overlays, worktrees and the testbed's
    stand-ins count). An injection is refused only when **every** alternative is ``absent`` by its source; what the
    source cannot decide (``unverified``) goes on to the check once the server is healthy
    (:func:`check_launched_sites`, the live injector's own resolution), so a site that only resolves in the
    running server is never refused here. When the resolver cannot run at all, nothing is refused either.

    Args:
        scenario: the validated scenario; scenario_path: its file (named in the message).
        variant_names: the variants whose injections the plan loads.
        python: the server's interpreter; env: the server's environment (``Adapter.launch_env``).
        timeout_s: bound on the subprocess, seconds.
        adapter: the run's adapter (default: the scenario's).
    Raises:
        SitesUnresolved: one line naming the scenario file, each refused injection's field
            (``variants.<name>.injections.<id>.site``), every absent site with why and its nearest names.
    """
    try:
        report = check_sites(scenario, python, timeout_s=timeout_s, env=env, variants=variant_names, mode="source",
                             adapter=adapter)
    except SitesPreflightError:
        return  # the launch-time check still decides, with the server's own imports
    parts = []
    for inj in report.injections:
        if not inj.alternatives or not all(a.status == "absent" for a in inj.alternatives):
            continue
        alts = []
        for a in inj.alternatives:
            near = f"; nearest: {', '.join(a.suggestions)}" if a.suggestions else ""
            alts.append(f"{a.site} is absent ({a.detail}{near})")
        parts.append(f"variants.{inj.variant}.injections.{inj.injection_id}.site: " + "; ".join(alts))
    if not parts:
        return
    pkg, version = report.package or "engine", report.engine_version
    raise SitesUnresolved(f"{scenario_path}: " + " | ".join(parts)
                          + f" — in {python}'s {pkg} {version or '(version unknown)'}; nothing was launched "
                          f"(`repro sites {scenario_path}` lists every alternative; fix the site or pass --python "
                          "of the release that has it)")
