"""``repro hunt``: search a live server for collective-desync hazards nobody has reported yet (docs/pipeline.md, the hunt in README.md).

Every desync bug of this family has one shape: a value local to one rank (free slots, a transfer's completion, a
clock, the emptiness of a local list) steers control flow around a collective. The engine adapter contributes a
*catalogue* of such rank-local decision points (data: ``scenarios/sglang/hunt_catalogue.toml``), each with the
perturbations that make sense for it. The hunt then:

1. **baseline** — launches the base scenario's server with an observe-only probe on every decision point (action
   ``none`` + ``record_callers``: the injector writes one ``seen`` event per distinct call place, with the caller
   chain and the ``for`` loops enclosing the call), sends one clean burst, and splits each point into **rows**, one per
   (caller, enclosing loop) seen — so "inside the admission loop" and "before it" are different rows;
2. **trials** — relaunches with one injection per row × perturbation × rank in a single plan (all unarmed) and, on
   that one healthy server, arms each trial in turn (re-arming, no restart), runs the burst, records verdict and
   evidence, disarms; the server is restarted only after a hang or a crash (its tree SIGKILLed after
   ``STOP_GRACE_S``), or with ``--spare`` replaced by a spare server launched in the background while the trials
   ran (:class:`SparedSession`; on the 2-core CPU testbed it did not pay: benchmarks/RESULTS.md);
3. **results** stream to ``hunt.jsonl`` and ``HUNT.md`` as they come (an interrupted hunt keeps what it found): per
   trial the verdict, time to verdict, the collective that diverged, whether it is in the model's forward or in a
   scheduling/cache collective (the family we hunt, ranked first), a one-line hazard statement and, for each
   deadlock, a ready-to-run scenario file (a finding becomes a regression scenario in one step).

The module renders nothing: progress goes to an optional observer ``(event, data)``. No sglang import here.
"""

from __future__ import annotations

import fnmatch
import json
import re
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from repro import evidence as ev
from repro import resources
from repro.diagnosis import DATA_COLLECTIVES, CollectiveDiagnosis, CollectiveFamily, CrashKind, md_cell, where_of
from repro.verdict import DEADLOCKED, DESYNCED, INCONCLUSIVE, SUCCEEDED, Verdict

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

def catalogue_for(adapter_name: Optional[str] = None) -> Path:
    """The hunt catalogue of an engine adapter (``repro.targets.registry``; default: the default adapter's)."""
    from repro.targets.registry import get_adapter

    path = getattr(get_adapter(adapter_name), "hunt_catalogue", None)
    if path is None:
        raise HuntError(f"adapter {adapter_name!r} has no hunt catalogue; pass --catalogue FILE")
    return Path(path)


DEFAULT_CATALOGUE = catalogue_for()  # the default adapter's: a clone's scenarios/ or the installed wheel's copy
FAMILY_SCHED = CollectiveFamily.SCHEDULING  # the enums of repro.diagnosis; names kept for callers
FAMILY_FORWARD = CollectiveFamily.FORWARD
FAMILY_UNCLEAR = CollectiveFamily.UNCLEAR
NOT_RUN = "NOT RUN"
MAX_RESTART_FAILURES = 2  # consecutive failed (re)starts before the hunt gives up
SETTLE_S = 2.0  # seconds after a clean burst before the server is checked for a delayed crash
# Seconds a hunt's server tree gets after SIGTERM before SIGKILL (runner.Session.stop_grace_s; the launcher's
# default is 10). Once a scheduler died of the SIGTERM, sglang 0.5.23's parent logs "Sleeping 5 seconds before crash
# diagnostics" (managers/tokenizer_manager.py, its SIGQUIT handler) and only then exits: 6 s of every teardown
# (measured) — after each hang, and for the baseline and the last trial server — that a hunt's server, hung or
# done, has no use for.
STOP_GRACE_S = 1.0

Observer = Callable[[str, dict], None]


def _noop(event: str, data: dict) -> None:
    pass


class HuntError(Exception):
    """The hunt could not be prepared or its baseline failed; the message names the file/flag and the fix."""


# ----------------------------------------------------------------------------------------------------- catalogue
@dataclass(frozen=True)
class Perturbation:
    """A way to perturb a decision point once: ``action`` is a scenario injection action (``repro.scenario``).

    ``by_construction``: the perturbation itself removes or adds a collective on one rank (skipping a function that
    issues one, an extra collective): a deadlock then shows the engine does not tolerate it, not that the engine can
    get there by itself; such deadlocks are never listed as findings or candidates.
    """

    name: str
    action: dict
    says: str
    by_construction: bool = False


@dataclass(frozen=True)
class DecisionPoint:
    """A rank-local decision point: ``sites`` (``module:Class.method`` alternatives), what its value means, the
    perturbations that apply, and (for functions read everywhere, like clocks) caller globs that keep a row.

    ``loops``: keep only rows whose direct caller runs the call inside a ``for`` loop over one of these targets
    (``""`` = in no loop of the caller); empty keeps every row (discovered points name the loop their guard is in).
    """

    name: str
    sites: tuple[str, ...]
    what: str
    perturbations: tuple[str, ...]
    callers: tuple[str, ...] = ()
    loops: tuple[str, ...] = ()


@dataclass(frozen=True)
class NamedCollective:
    """A collective we can name: a blocked rank whose caller chain matches any of ``frames`` is in it."""

    frames: tuple[str, ...]
    name: str


@dataclass(frozen=True)
class KnownIssue:
    """An upstream issue: a deadlock whose divergent chain matches all ``frames`` is that issue, not a finding."""

    issue: str
    frames: tuple[str, ...]


@dataclass(frozen=True)
class SiteApi:
    """How to perturb collectives the ledger names ``<prefix>.<method>`` (``--sites``).

    ``owner``: where the API lives (``module:Class`` or a module); ``skip``: the skip action (e.g. hand back the
    in-place input); ``extra_group``: attribute of ``self`` holding the group for an extra collective (None: no
    extra, e.g. module functions have no ``self``).
    """

    prefix: str
    owner: str
    skip: dict
    extra_group: Optional[str] = None

    def site_of(self, api: str) -> Optional[str]:
        """``GroupCoordinator.all_reduce`` → ``sglang…parallel_state:GroupCoordinator.all_reduce``; None if not ours."""
        if not api.startswith(self.prefix + "."):
            return None
        method = api[len(self.prefix) + 1:]
        return f"{self.owner}.{method}" if ":" in self.owner else f"{self.owner}:{method}"


@dataclass(frozen=True)
class Catalogue:
    """The adapter's hunt catalogue (see ``scenarios/sglang/hunt_catalogue.toml``)."""

    path: Path
    points: tuple[DecisionPoint, ...]
    perturbations: dict
    forward_frames: tuple[str, ...] = ()
    idle_frames: tuple[str, ...] = ()
    named: tuple[NamedCollective, ...] = ()
    known: tuple[KnownIssue, ...] = ()
    crash_forward_functions: tuple[str, ...] = ()
    site_apis: tuple[SiteApi, ...] = ()

    def point(self, name: str) -> DecisionPoint:
        for p in self.points:
            if p.name == name:
                return p
        raise HuntError(f"{self.path}: no decision point {name!r}; known: {', '.join(p.name for p in self.points)}")


def _tuple(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    return (v,) if isinstance(v, str) else tuple(str(x) for x in v)


def load_catalogue(path: Path = DEFAULT_CATALOGUE) -> Catalogue:
    """Read and check a hunt catalogue TOML file.

    Each perturbation's action is validated as a scenario action (``repro.scenario.Injection``), so a typo fails here,
    before any launch.

    Raises:
        HuntError: missing file, bad TOML, or a bad field (named as ``points[i].field`` with what was expected).
    """
    from pydantic import ValidationError

    from repro.scenario import Injection

    p = Path(path)
    if not p.is_file():
        raise HuntError(f"{p}: hunt catalogue not found (expected a TOML file like scenarios/sglang/hunt_catalogue.toml)")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise HuntError(f"{p}: not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise HuntError(f"{p}: not a UTF-8 text file (binary?); pass a TOML file like scenarios/sglang/hunt_catalogue.toml") from None
    perts: dict[str, Perturbation] = {}
    for name, spec in (data.get("perturbations") or {}).items():
        if not isinstance(spec, dict) or not isinstance(spec.get("action"), dict):
            raise HuntError(f"{p}: perturbations.{name}: expected a table with an 'action' table, e.g. action = {{ kind = \"return_value\", value = 0 }}")
        try:
            Injection.model_validate({"id": "check", "site": "m:f", "action": spec["action"]})
        except ValidationError as e:
            raise HuntError(f"{p}: perturbations.{name}.action is not a valid injection action: {e.errors()[0]['msg']}") from None
        perts[name] = Perturbation(name, dict(spec["action"]), str(spec.get("says", name)), bool(spec.get("by_construction", False)))
    points = []
    for i, spec in enumerate(data.get("points") or []):
        where = f"{p}: points[{i}]"
        if not isinstance(spec, dict) or not spec.get("name") or not spec.get("site"):
            raise HuntError(f"{where}: expected 'name' and 'site' ('module:Class.method' or a list of alternatives)")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", spec["name"]):
            raise HuntError(f"{where}.name: {spec['name']!r} must use letters, digits, '_', '.', '-' only")
        unknown = [x for x in _tuple(spec.get("perturbations")) if x not in perts]
        if unknown:
            raise HuntError(f"{where}.perturbations: unknown {unknown}; defined: {sorted(perts)}")
        try:
            Injection.model_validate({"id": "check", "site": list(_tuple(spec["site"])), "action": {"kind": "none"}})
        except ValidationError as e:
            raise HuntError(f"{where}.site: {e.errors()[0]['msg']}") from None
        points.append(DecisionPoint(spec["name"], _tuple(spec["site"]), str(spec.get("what", "")),
                                    _tuple(spec.get("perturbations")), _tuple(spec.get("callers")), _tuple(spec.get("loops"))))
    if not points:
        raise HuntError(f"{p}: no [[points]]: the catalogue must list at least one decision point")
    names = [x.name for x in points]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise HuntError(f"{p}: decision point names must be unique, repeated: {dup}")
    cl = data.get("classify") or {}
    named = tuple(NamedCollective(_tuple(n.get("frames")), str(n.get("name", ""))) for n in cl.get("named") or [])
    known = tuple(KnownIssue(str(k.get("issue", "")), _tuple(k.get("frames"))) for k in data.get("known") or [])
    apis = []
    for prefix, spec in ((data.get("sites") or {}).get("apis") or {}).items():
        if not isinstance(spec, dict) or not spec.get("owner") or not isinstance(spec.get("skip"), dict):
            raise HuntError(f"{p}: sites.apis.{prefix}: expected owner = 'module:Class' and skip = {{ kind = \"skip\", … }}")
        try:
            Injection.model_validate({"id": "check", "site": "m:f", "action": spec["skip"]})
        except ValidationError as e:
            raise HuntError(f"{p}: sites.apis.{prefix}.skip is not a valid injection action: {e.errors()[0]['msg']}") from None
        apis.append(SiteApi(prefix, str(spec["owner"]), dict(spec["skip"]), spec.get("extra_group")))
    return Catalogue(p, tuple(points), perts, _tuple(cl.get("forward_frames")), _tuple(cl.get("idle_frames")), named, known,
                     _tuple(cl.get("crash_forward_functions")), tuple(apis))


# ---------------------------------------------------------------------------------------------------------- rows
@dataclass(frozen=True)
class Row:
    """One decision point at one call place seen in the baseline burst.

    Attributes:
        point: decision point name.
        caller: ``module:qualname`` of the site's direct (non-decorator) caller.
        loop_frame: the nearest frame (caller or up to 2 above it) executing inside a ``for`` loop, or None.
        loop_var: that loop's target name (innermost loop of that frame), or None (the call is in no loop).
        stack: caller chain seen (up to 8 frame names, innermost first).
        ranks: ranks on which the baseline saw this call place.
    """

    point: str
    caller: str
    loop_frame: Optional[str]
    loop_var: Optional[str]
    stack: tuple[str, ...] = ()
    ranks: tuple[int, ...] = ()
    gate_frames: tuple[str, ...] = ()  # --sites rows: the call site's frames (all must match within max_depth)
    max_depth: int = 1

    @property
    def key(self) -> tuple:
        return (self.point, self.caller, self.loop_frame, self.loop_var)

    @property
    def where(self) -> str:
        """``Scheduler._get_new_batch_prefill_raw, in `for req`'' (short, for tables)."""
        caller = _short(self.caller)
        if self.gate_frames:
            return " ← ".join(_short(f) for f in self.gate_frames)  # all of them: the first two are often shared
        if not self.loop_var:
            return f"{caller}, outside loops"
        if self.loop_frame == self.caller:
            return f"{caller}, in `for {self.loop_var}`"
        return f"{caller} ← {_short(self.loop_frame or '')} in `for {self.loop_var}`"

    def gate(self, rank: int) -> dict:
        """Scenario gate for this row on one rank: direct caller (and loop frame) named, first matching call only."""
        if self.gate_frames:
            return {"called_from": list(self.gate_frames), "max_depth": self.max_depth, "ranks": [rank],
                    "occurrence": {"mode": "first"}}
        if self.loop_var and self.loop_frame:
            frames = [self.loop_frame] if self.loop_frame == self.caller else [self.loop_frame, self.caller]
            depth = 1 if self.loop_frame == self.caller else 3
            return {"called_from": frames, "inside_loop": self.loop_var, "max_depth": depth, "ranks": [rank],
                    "occurrence": {"mode": "first"}}
        return {"called_from": [self.caller], "max_depth": 1, "ranks": [rank], "occurrence": {"mode": "first"}}


def _short(frame: str) -> str:
    return frame.split(":", 1)[-1]


def _glob_any(names: Sequence[str], patterns: Sequence[str]) -> bool:
    """Does any name match any glob? A pattern with ':' matches ``module:qual``; without, the part after ':'."""
    for pat in patterns:
        for n in names:
            target = n if ":" in pat else _short(n)
            if fnmatch.fnmatchcase(target, pat):
                return True
    return False


def rows_from_seen(catalogue: Catalogue, seen: Sequence[dict], probe_points: dict[str, str]) -> list[Row]:
    """Turn the baseline's ``seen`` events into rows, one per (point, caller, loop frame, loop variable).

    Args:
        seen: fire-log ``seen`` events (``id``, ``rank``, ``caller``, ``stack``, ``loops``) of scheduler ranks.
        probe_points: probe injection id -> decision point name.
    Returns:
        Rows in catalogue order, then by first sighting. Points with ``callers`` keep only rows whose first three
        stack frames match one of those globs.
    """
    rows: dict[tuple, dict] = {}
    for e in seen:
        point = probe_points.get(e.get("id", ""))
        if point is None or e.get("rank") is None:
            continue
        p = catalogue.point(point)
        stack = tuple(e.get("stack") or (e.get("caller", "?"),))
        if p.callers and not _glob_any(stack[:3], p.callers):
            continue
        loops = e.get("loops") or []
        loop_frame = loop_var = None
        for i, names in enumerate(loops[:3]):
            if names and i < len(stack):
                loop_frame, loop_var = stack[i], names[-1]
                break
        caller = e.get("caller") or stack[0]
        if p.loops and ((loop_var or "") if loop_frame == caller else "") not in p.loops:
            continue
        key = (point, caller, loop_frame, loop_var)
        r = rows.setdefault(key, {"stack": stack, "ranks": set()})
        r["ranks"].add(int(e["rank"]))
    order = {p.name: i for i, p in enumerate(catalogue.points)}
    out = [Row(k[0], k[1], k[2], k[3], v["stack"], tuple(sorted(v["ranks"]))) for k, v in rows.items()]
    return sorted(out, key=lambda r: order[r.point])  # stable: first sighting order within a point


_EXTRA_OP = {"all_reduce": "all_reduce", "all_gather": "all_gather", "all_gather_into_tensor": "all_gather",
             "broadcast": "broadcast", "broadcast_object": "broadcast", "barrier": "barrier"}


def site_rows(catalogue: Catalogue, records: Sequence[Any], since: float, matching: Sequence[str] = ()) -> tuple[Catalogue, list[Row]]:
    """``--sites``: one row per collective call site the ledger saw since ``since`` (epoch seconds).

    Args:
        records: ``repro.ledger.Record`` objects of every rank (``api``, ``op``, ``site``, ``t_enter``, ``inj``, ``rank``).
        matching: keep only call sites one of whose recorded frames (the ledger keeps up to 4, innermost first)
            matches one of these globs (default all); the row itself is still keyed by its first 3 frames.
    Returns:
        The catalogue extended with one decision point per API (``coll-<api>``, perturbations ``skip_collective``
        and, where the API has a group on ``self``, ``extra_<op>``) and the rows (gate: the call site's first 3 frames).
    """
    import dataclasses

    perts = dict(catalogue.perturbations)
    points: dict[str, DecisionPoint] = {}
    rows: dict[tuple, dict] = {}
    for r in records:
        if r.inj or r.t_enter < since or not r.site:
            continue
        api = next((a for a in catalogue.site_apis if a.site_of(r.api)), None)
        if api is None:
            continue
        frames = tuple(r.site[:3])
        if matching and not _glob_any(tuple(r.site), matching):
            continue
        name = f"coll-{r.api}"
        if name not in points:
            skip_name = f"skip_{api.prefix.replace('.', '_')}"
            perts.setdefault(skip_name, Perturbation(skip_name, dict(api.skip), f"skips its {r.api} once", True))
            names = [skip_name]
            op = _EXTRA_OP.get(r.api.rsplit(".", 1)[-1])
            if api.extra_group and op:
                extra = f"extra_{op}"
                perts.setdefault(extra, Perturbation(extra, {"kind": "extra_collective", "op": op, "group": api.extra_group},
                                                     f"issues one extra {op} before it once", True))
                names.append(extra)
            points[name] = DecisionPoint(name, (api.site_of(r.api),), f"collective call site ({r.api})", tuple(names))
        row = rows.setdefault((name, frames), {"ranks": set()})
        row["ranks"].add(int(r.rank))
    out = [Row(k[0], k[1][0], None, None, k[1], tuple(sorted(v["ranks"])), gate_frames=k[1], max_depth=12)
           for k, v in rows.items()]
    cat = dataclasses.replace(catalogue, points=catalogue.points + tuple(points.values()), perturbations=perts)
    return cat, out


# -------------------------------------------------------------------------------------------------------- trials
@dataclass(frozen=True)
class Trial:
    """One perturbation of one row on one rank (``n``: 1-based index in the hunt), under one workload
    (``workload``: a name of the workload file, ``repro.nemeses``; "" = the base scenario's burst)."""

    n: int
    row: Row
    perturbation: Perturbation
    rank: int
    workload: str = ""

    @property
    def name(self) -> str:
        """Variant / injection id: ``t007-get_num_allocatable_reqs-zero_once-r0`` (``…-r0-wmass_abort`` under a workload)."""
        return f"t{self.n:03d}-{self.row.point}-{self.perturbation.name}-r{self.rank}" + (f"-w{self.workload}" if self.workload else "")

    def injection(self, sites: Sequence[str]) -> dict:
        """The scenario injection (TOML-able dict) of this trial."""
        return {"id": self.name, "site": list(sites), "action": dict(self.perturbation.action), "gate": self.row.gate(self.rank)}


def plan_trials(catalogue: Catalogue, rows: Sequence[Row], ranks: Sequence[int], perturbations: Sequence[str] = (),
                workload: str = "", first_n: int = 1) -> list[Trial]:
    """Every row × its point's perturbations (or only those named) × each rank, in that order, under ``workload``
    (numbered from ``first_n``).

    Raises:
        HuntError: a name in ``perturbations`` is not in the catalogue.
    """
    unknown = [x for x in perturbations if x not in catalogue.perturbations]
    if unknown:
        raise HuntError(f"--perturbation {', '.join(unknown)}: not in {catalogue.path} (nor made by --sites for the call sites this baseline saw); defined: {', '.join(sorted(catalogue.perturbations))}")
    out: list[Trial] = []
    for row in rows:
        point = catalogue.point(row.point)
        for pname in point.perturbations:
            if perturbations and pname not in perturbations:
                continue
            for rank in ranks:
                out.append(Trial(first_n + len(out), row, catalogue.perturbations[pname], rank, workload))
    return out


# ----------------------------------------------------------------------------------------------------- diagnosis
Diagnosis = CollectiveDiagnosis  # the type lives in repro.diagnosis (reports import only types)


def diagnose(analysis: Optional[dict], catalogue: Catalogue) -> Diagnosis:
    """Name the divergent collective of a deadlock from its analysis (``Analysis.to_dict()``).

    The divergent collective is the one of a rank blocked in a collective that is neither the idle request
    broadcast (``idle_frames``) nor under the model forward (``forward_frames``); failing that, a forward one.
    """
    if not analysis or not analysis.get("ranks"):
        return Diagnosis(FAMILY_UNCLEAR, "no stacks")
    where = {int(r["rank"]): where_of(r) for r in analysis["ranks"]}
    sched, fwd = [], []
    for r in analysis["ranks"]:
        if r.get("state") != "collective":
            continue
        chain = [c for c in r.get("caller_chain") or [] if not c.startswith("[injected]")]
        if _glob_any(chain, catalogue.idle_frames):
            continue
        (fwd if _glob_any(chain, catalogue.forward_frames) else sched).append((r, tuple(chain)))
    pick, family = (sched, FAMILY_SCHED) if sched else ((fwd, FAMILY_FORWARD) if fwd else ([], FAMILY_UNCLEAR))
    if not pick:
        return Diagnosis(FAMILY_UNCLEAR, "no rank blocked in a non-idle collective", (), where)
    r, chain = pick[0]
    name = next((n.name for n in catalogue.named if _glob_any(chain, n.frames)), "")
    if not name:
        name = f"{r.get('op')} ← " + " ← ".join(chain[:3])
    in_ranks = tuple(sorted(int(x["rank"]) for x, c in pick if c == chain))
    return Diagnosis(family, name, in_ranks, where, chain, known_issue(catalogue, chain))


def known_issue(catalogue: Catalogue, chain: Sequence[str], short: bool = False) -> Optional[str]:
    """The catalogue's ``[[known]]`` issue whose frames all match the divergent collective's caller chain, or None.

    Args:
        catalogue: the hunt catalogue (``scenarios/<engine>/hunt_catalogue.toml``).
        chain: caller frames, innermost first (``Class.method`` names, or bare function names when ``short``).
        short: the chain holds bare function names (a faulthandler dump in a server log): each pattern is matched
            by its last dotted part, as ``[[classify.named]]`` is for crashes.
    """
    for k in catalogue.known:
        pats = tuple(f.rsplit(".", 1)[-1] for f in k.frames) if short else k.frames
        if pats and all(_glob_any(chain, (f,)) for f in pats):
            return k.issue
    return None


_MISMATCH_RE = re.compile(r"collective mismatch|Received data size doesn't match|doesn't match expected size")


def crash_diagnosis(log_text: str, catalogue: Catalogue) -> Optional[Diagnosis]:
    """A desync the backend caught: gloo aborts a rank whose peer sent a collective of another size.

    Reads the server log written during one trial: faulthandler's ``Fatal Python error`` thread dumps (parsed by
    ``repro.stacks.parse_faulthandler``, innermost frame first) and names the collective the aborted rank was in.
    Returns None when the log shows no mismatch; else a diagnosis with ``crash`` = ``CrashKind.GLOO_SIZE_MISMATCH``.
    ``family`` is ``model forward`` when a frame is one of the catalogue's ``crash_forward_functions``.
    """
    from repro.stacks import parse_faulthandler

    if not _MISMATCH_RE.search(log_text):
        return None
    crash = CrashKind.GLOO_SIZE_MISMATCH
    start = log_text.find("Fatal Python error")
    dump = parse_faulthandler(log_text[start:] if start >= 0 else log_text)[0]
    for thread in dump.threads:
        frames = [f for f in thread.frames if not f.native]
        names = [f.short_function for f in frames]
        op = next((n for n in names if n in DATA_COLLECTIVES), None)
        if op is None:
            continue
        chain = tuple(f.short_function for f in frames
                      if not (f.module_or_file.startswith("torch/") or "/torch/" in f.module_or_file)
                      and "repro_injector" not in f.module_or_file and f.short_function not in DATA_COLLECTIVES
                      and f.short_function != "wrapper")
        fwd = bool(set(chain) & set(catalogue.crash_forward_functions))
        name = next((n.name for n in catalogue.named if _glob_any(chain, tuple(f.rsplit(".", 1)[-1] for f in n.frames))), "")
        coll = f"{crash} in {name or op + ' ← ' + ' ← '.join(chain[:3])}"
        return Diagnosis(FAMILY_FORWARD if fwd else FAMILY_SCHED, coll, (), {}, chain,
                         known_issue(catalogue, chain, short=True), crash=crash)
    return Diagnosis(FAMILY_UNCLEAR, f"{crash} (no stack of the aborted rank in the log)", crash=crash)


def hazard_statement(trial: Trial, verdict: str, diag: Optional[Diagnosis], matched: int, fired: int, world: int) -> str:
    """One line a reviewer can act on (what was perturbed, where, and what followed)."""
    t = trial
    head = f"rank-local `{t.row.point}` {t.perturbation.says} on rank {t.rank} ({t.row.where})"
    if matched == 0:
        return f"{head}: the gated call was not reached during the burst (not exercised)"
    if verdict == DEADLOCKED and diag is not None:
        others = [k for k in range(world) if k not in diag.in_ranks]
        who = f"rank(s) {', '.join(map(str, diag.in_ranks))} wait in it, rank(s) {', '.join(map(str, others))} never issue it"
        kind = "a scheduling/cache collective" if diag.family == FAMILY_SCHED else (
            "the model's own forward collective" if diag.family == FAMILY_FORWARD else "a collective")
        known = f" (known: {diag.known})" if diag.known else ""
        bc = " (by construction: the perturbation itself removes/adds a collective)" if t.perturbation.by_construction else ""
        return f"{head} → {diag.collective}: {who} → deadlock in {kind}{known}{bc}"
    if verdict == SUCCEEDED:
        return f"{head} → tolerated: every request answered, ranks stayed in step"
    if verdict == DESYNCED:
        where = f" in {diag.collective}" if diag is not None else ""
        return f"{head} → the ranks entered different collectives{where} (DESYNCED: the ledgers disagree)"
    if diag is not None and diag.crash is not None:
        kind = "the model's own forward collective" if diag.family == FAMILY_FORWARD else "a scheduling/cache collective"
        return (f"{head} → ranks issued mismatched collectives; gloo aborted a rank ({diag.collective}, {kind}): "
                f"a desync crash here, a hang or silent corruption where the backend does not check sizes")
    return f"{head} → {verdict.lower()}"


# -------------------------------------------------------------------------------------------------------- results
@dataclass
class TrialResult:
    """The outcome of one trial (one row of HUNT.md, one line of hunt.jsonl).

    ``to_verdict_s``: seconds from arming to the verdict; ``evidence``/``scenario_file``: paths (scenario only for
    DEADLOCKED); ``entered/matched/fired``: rank -> count after arming; ``confirmed``: the scenario file was re-run
    on a fresh server and deadlocked again (None: not re-run).
    """

    trial: Trial
    verdict: str
    reason: str
    to_verdict_s: float = 0.0
    diagnosis: Optional[Diagnosis] = None
    hazard: str = ""
    evidence: Optional[Path] = None
    scenario_file: Optional[Path] = None
    entered: dict = field(default_factory=dict)
    matched: dict = field(default_factory=dict)
    fired: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    confirmed: Optional[bool] = None
    ledger: str = ""  # the collective ledger's first-divergence sentence (ledger.json), when the run recorded one

    @property
    def desync_crash(self) -> bool:
        """The backend caught the desync and aborted a rank (INCONCLUSIVE verdict, mismatch in the server log)."""
        return self.verdict != DEADLOCKED and self.diagnosis is not None and self.diagnosis.crash is not None

    def to_json(self) -> dict:
        t = self.trial
        return {
            "n": t.n, "trial": t.name, "workload": t.workload, "point": t.row.point, "caller": t.row.caller, "loop_frame": t.row.loop_frame,
            "loop_var": t.row.loop_var, "row": t.row.where, "perturbation": t.perturbation.name, "rank": t.rank,
            "action": t.perturbation.action, "by_construction": t.perturbation.by_construction, "verdict": self.verdict, "reason": self.reason,
            "to_verdict_s": round(self.to_verdict_s, 2),
            "diagnosis": asdict(self.diagnosis) if self.diagnosis else None, "hazard": self.hazard,
            "evidence": str(self.evidence) if self.evidence else None,
            "scenario_file": str(self.scenario_file) if self.scenario_file else None,
            "entered": {str(k): v for k, v in self.entered.items()}, "matched": {str(k): v for k, v in self.matched.items()},
            "fired": {str(k): v for k, v in self.fired.items()}, "notes": list(self.notes), "confirmed": self.confirmed,
            "desync_crash": self.desync_crash, "ledger": self.ledger,
            "time": time.time(),
        }


def rank_key(r: TrialResult) -> tuple:
    """Sort order of HUNT.md: scheduling/cache deadlocks first, then forward ones, other deadlocks, the rest."""
    d = r.diagnosis
    if r.verdict == DEADLOCKED:
        fam = 0 if d and d.family == FAMILY_SCHED else (1 if d and d.family == FAMILY_FORWARD else 2)
        return (0, fam, (2 if r.trial.perturbation.by_construction else (1 if d and d.known else 0)), r.trial.n)
    if r.desync_crash:
        return (1, 0 if d and d.family == FAMILY_SCHED else 1, 0, r.trial.n)
    if r.verdict == DESYNCED:  # the ledgers proved the ranks' collectives differ: next to the desync crashes
        return (1, 0 if d and d.family == FAMILY_SCHED else 1, 0, r.trial.n)
    order = {INCONCLUSIVE: 2, SUCCEEDED: 3, NOT_RUN: 4}
    return (order.get(r.verdict, 5), 0, 0, r.trial.n)


_md = md_cell  # the one markdown escape (repro.diagnosis)


def _rel(path: Optional[Path], base: Path) -> str:
    if path is None:
        return ""
    try:
        return str(Path(path).resolve().relative_to(base.resolve(), walk_up=True))  # type: ignore[call-arg]
    except TypeError:  # python < 3.12
        import os

        return os.path.relpath(Path(path).resolve(), base.resolve())
    except ValueError:
        return str(path)


class HuntLog:
    """Streams results to ``hunt.jsonl`` (appended per trial) and ``HUNT.md`` (rewritten atomically per trial).

    Args:
        folder: the hunt folder. header: facts for the top of HUNT.md (scenario, versions, ref, budget…).
    """

    def __init__(self, folder: Path, header: dict) -> None:
        self.folder = Path(folder)
        self.header = dict(header)
        self.rows: list[Row] = []
        self.results: list[TrialResult] = []
        self.status = "running"
        self.jsonl = self.folder / ev.Layout.HUNT_JSONL.name
        self.md = self.folder / ev.Layout.HUNT_MD.name
        self._write_md()

    def event(self, kind: str, **data: Any) -> None:
        """Append a non-trial line (``baseline``, ``rows``, ``end``) to hunt.jsonl."""
        with open(self.jsonl, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"event": kind, "time": time.time(), **data}, default=str) + "\n")

    def set_rows(self, rows: Sequence[Row]) -> None:
        self.rows = list(rows)
        self.event("rows", rows=[{**asdict(r), "where": r.where} for r in rows])
        self._write_md()

    def add(self, r: TrialResult) -> None:
        self.results.append(r)
        with open(self.jsonl, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"event": "trial", **r.to_json()}, default=str) + "\n")
        self._write_md()

    def finish(self, status: str, **data: Any) -> None:
        self.status = status
        self.header.update(data)
        self.event("end", status=status, **data)
        self._write_md()

    def markdown(self) -> str:
        """HUNT.md: header, findings (scheduling/cache deadlocks first), the full trial table, the rows."""
        h = self.header
        out = ["# repro hunt", ""]
        for k in ("scenario", "catalogue", "discovery", "ref", "sglang", "torch", "python", "ranks", "shard", "budget_min", "command",
                  "restarts", "interrupted_during", "error"):
            if h.get(k) not in (None, ""):
                out.append(f"- **{k}**: {_md(h[k])}")
        done = [r for r in self.results if r.verdict != NOT_RUN]
        out.append(f"- **status**: {self.status}; {len(done)} trial(s) run"
                   + (f" of {h['trials_total']}" if h.get("trials_total") else "")
                   + (f"; wall time {h['wall_s']:.0f} s" if h.get("wall_s") else ""))
        out.append("")
        if h.get("workload_baselines"):
            out += ["## Workloads: each run clean first (no perturbation)", "",
                    "A deadlock or desync here needs no perturbation at all: the engine is unsafe under this load (FINDING-<workload>.md).", "",
                    "| workload | what the clients do | verdict | requests ok / aborted / failed | admin calls (status) | server log | evidence |",
                    "|---|---|---|---|---|---|---|"]
            for b in h["workload_baselines"]:
                evl = f"[{Path(b['evidence']).name}]({_rel(Path(b['evidence']), self.folder)}/REPORT.md)" if b.get("evidence") else ""
                out.append(f"| `{b['workload']}` | {_md(b.get('says', ''))} | {b['verdict']} | {b.get('ok', 0)} / {b.get('aborted', 0)} / "
                           f"{b.get('failed', 0)} | {_md(b.get('admin', '') or '—')} | {_md(b.get('log', '') or '—')} | {evl} |")
            out.append("")
        res = sorted(self.results, key=rank_key)
        dl = [r for r in res if r.verdict == DEADLOCKED]
        found = [r for r in dl if r.confirmed]
        out += ["## Findings", "",
                "New deadlocks in a scheduling/cache collective that deadlocked again when their scenario file was run "
                "on a fresh server (`--confirm`); a finding is only a finding if its scenario file reproduces it.", ""]
        if not found:
            out.append("None." if self.status != "running" else "None so far.")
        for r in found:
            out.append(f"- {_md(r.hazard)}. Scenario: [`{_rel(r.scenario_file, self.folder)}`]({_rel(r.scenario_file, self.folder)}); "
                       f"evidence: [{_rel(r.evidence, self.folder)}]({_rel(r.evidence, self.folder)}/REPORT.md)")
        out += ["", "## Deadlocks", ""]
        if not dl:
            out.append("None so far." if self.status == "running" else "None.")
        for r in dl:
            d = r.diagnosis
            tag = d.family if d else FAMILY_UNCLEAR
            known = f" — known issue {d.known}" if d and d.known else (" — not a known issue" if tag == FAMILY_SCHED else "")
            conf = {True: " — reproduced again from its scenario file (finding)",
                    False: " — NOT reproduced by its scenario file (not a finding)",
                    None: " — by construction (not a candidate)" if r.trial.perturbation.by_construction else (
                        " — candidate: not re-run from its scenario file (use --confirm)" if tag == FAMILY_SCHED and not (d and d.known) else "")}[r.confirmed]
            out.append(f"- **[{tag}]** {_md(r.hazard)}{known}{conf}. Evidence: [{_rel(r.evidence, self.folder)}]"
                       f"({_rel(r.evidence, self.folder)}/REPORT.md); scenario: [`{_rel(r.scenario_file, self.folder)}`]"
                       f"({_rel(r.scenario_file, self.folder)})")
            if r.ledger:
                out.append(f"  - collective ledger: {_md(r.ledger)}")
        desynced = [r for r in res if r.verdict == DESYNCED]
        if desynced:
            out += ["", "## Desyncs (the collective ledgers show the ranks entered different collectives)", ""]
            for r in desynced:
                fam = r.diagnosis.family if r.diagnosis else FAMILY_UNCLEAR
                out.append(f"- **[{fam}]** {_md(r.hazard)}: {_md(r.ledger or r.reason)}. Evidence: "
                           f"[{_rel(r.evidence, self.folder)}]({_rel(r.evidence, self.folder)}/REPORT.md)")
        crashes = [r for r in res if r.desync_crash and r.verdict != DESYNCED]
        if crashes:
            out += ["", "## Desync crashes (gloo caught the mismatch and aborted a rank)", ""]
            for r in crashes:
                fam = r.diagnosis.family if r.diagnosis else FAMILY_UNCLEAR
                out.append(f"- **[{fam}]** {_md(r.hazard)}. Evidence: [{_rel(r.evidence, self.folder)}]"
                           f"({_rel(r.evidence, self.folder)}/server.log)")
        out += ["", "## Trials", "",
                "| # | decision point | row (caller, loop) | perturbation | rank | verdict | s to verdict | diverged in | family | hazard | evidence |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in res:
            t, d = r.trial, r.diagnosis
            div = d.collective if (d and (r.verdict == DEADLOCKED or r.desync_crash)) else ""
            fam = d.family if (d and (r.verdict == DEADLOCKED or r.desync_crash)) else ""
            evl = f"[{r.evidence.name}]({_rel(r.evidence, self.folder)}/REPORT.md)" if r.evidence else ""
            if r.scenario_file:
                evl += f" · [scenario]({_rel(r.scenario_file, self.folder)})"
            secs = f"{r.to_verdict_s:.1f}" if r.verdict != NOT_RUN else ""
            out.append(f"| {t.n} | `{t.row.point}` | {_md(t.row.where)} | {t.perturbation.name}{' under ' + t.workload if t.workload else ''} | {t.rank} | {r.verdict} | "
                       f"{secs} | {_md(div)} | {fam} | {_md(r.hazard or r.reason)} | {evl} |")
        if self.rows:
            out += ["", "## Rows seen in the baseline burst", "", "| decision point | caller | loop | ranks | stack |", "|---|---|---|---|---|"]
            for row in self.rows:
                loop = f"{_short(row.loop_frame or '')} `for {row.loop_var}`" if row.loop_var else "—"
                out.append(f"| `{row.point}` | `{_short(row.caller)}` | {loop} | {', '.join(map(str, row.ranks))} | "
                           f"{_md(' ← '.join(_short(s) for s in row.stack[:4]))} |")
        unseen = h.get("points_not_seen") or []
        if unseen:
            out += ["", f"Decision points not reached by the baseline burst (no rows, nothing tried): {', '.join(f'`{u}`' for u in unseen)}."]
        return "\n".join(out) + "\n"

    def _write_md(self) -> None:
        ev.write_text_atomic(self.md, self.markdown())


# ------------------------------------------------------------------------------------------------ scenario files
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items() if x is not None) + " }"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _toml_key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)


def scenario_toml(base: Any, name: str, description: str, variants: Sequence[tuple[str, str, str, Sequence[dict]]],
                  mirrors: str = "", comment: str = "") -> str:
    """A scenario file with ``base``'s server, burst and times and the given variants.

    Args:
        base: the base ``repro.scenario.Scenario``.
        variants: (name, expect, description, injections as dicts with id/site/action/gate[, extra]); ``extra``: the
            variant's own ``abort`` / ``workload`` tables (``repro.nemeses``), written when given.
    Returns:
        TOML text that ``repro.scenario.load_scenario`` accepts.
    """
    s = base
    lines = [f"# {line}" for line in comment.splitlines()] if comment else []
    lines += [f"name = {_toml_value(name)}", f"description = {_toml_value(description)}"]
    if mirrors:
        lines.append(f"mirrors = {_toml_value(mirrors)}")
    lines += [f"stall_s = {s.stall_s!r}", f"budget_s = {s.budget_s!r}", f"ledger = {_toml_value(s.ledger)}", "", "[server]"]
    srv = s.server.model_dump()
    for k in ("adapter", "model", "tp_size", "args", "startup_timeout_s"):
        lines.append(f"{k} = {_toml_value(srv[k])}")
    if srv.get("env"):
        lines.append(f"env = {_toml_value(srv['env'])}")
    lines += ["", "[burst]"]
    for k, v in s.burst.model_dump().items():
        if v is not None:  # an unset optional field (e.g. burst.abort) is left out, as in the scenario file
            lines.append(f"{k} = {_toml_value(v)}")
    for vname, expect, desc, injections, *rest in variants:
        lines += ["", "[[variants]]", f"name = {_toml_value(vname)}", f"expect = {_toml_value(expect)}",
                  f"description = {_toml_value(desc)}"]
        for k, v in ((rest[0] if rest else None) or {}).items():
            if v is not None:
                lines.append(f"{k} = {_toml_value(v)}")
        for inj in injections:
            lines += ["", "[[variants.injections]]", f"id = {_toml_value(inj['id'])}", f"site = {_toml_value(inj['site'])}",
                      f"action = {_toml_value(inj['action'])}"]
            if inj.get("gate"):
                lines += ["", "[variants.injections.gate]"]
                for k, v in inj["gate"].items():
                    if v is not None:
                        lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def finding_scenario(base: Any, base_path: Path, catalogue: Catalogue, trial: Trial, diag: Optional[Diagnosis],
                     verdict: str = DEADLOCKED, extra: Optional[dict] = None) -> str:
    """The ready-to-run regression scenario of one DEADLOCKED (or DESYNCED) trial (variant ``finding``, expect
    deadlock / desync); ``extra``: the trial's workload (``abort`` / ``workload`` tables), so it runs under the same load."""
    point = catalogue.point(trial.row.point)
    inj = trial.injection(point.sites)
    inj["id"] = f"{trial.row.point}-{trial.perturbation.name}"
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"hunt_{trial.row.point}_{trial.perturbation.name}_r{trial.rank}")
    hazard = hazard_statement(trial, verdict, diag, 1, 1, base.server.tp_size)
    comment = (f"Written by `repro hunt` from {base_path} (trial {trial.name}).\n{hazard}\n"
               f"Run: repro run <this file>   (expects {verdict}; a fix makes it ALL REQUESTS SUCCEEDED)")
    base = base.model_copy(update={"burst": base.burst.model_copy(update={"seed": trial_seed(base, trial)})})
    return scenario_toml(base, name, f"repro hunt finding: {hazard}",
                         [("finding", "desync" if verdict == DESYNCED else "deadlock", f"rank {trial.rank}: {point.name} {trial.perturbation.says} at {trial.row.where}"
                           + (f" under workload {trial.workload}" if trial.workload else ""), [inj], extra or {})],
                         mirrors=(diag.known if diag and diag.known else ""), comment=comment)


# --------------------------------------------------------------------------------------------------------- hunt
@dataclass
class HuntOptions:
    """What ``repro hunt`` was asked.

    Attributes:
        scenario_path: base scenario (server + burst; its variants are ignored).
        catalogue_path: hunt catalogue (default: the base scenario's adapter's, ``Adapter.hunt_catalogue``).
        only: decision point names to hunt (default all). perturbations: perturbation names (default all that apply).
        ranks: ranks to perturb one at a time (default every rank of the TP group).
        budget_min: wall-clock budget in minutes for the whole hunt; trials not started in time are NOT RUN.
        ref: code to hunt in, a ``repro compare`` REF (``installed``, ``patch:FILE``, ``git:PATH@REV``, ``python:PATH``).
        sites: also perturb every collective call site the ledger saw in the baseline burst (skip once, extra once);
            ``sites_matching``: only call sites whose frames match these globs.
        confirm: re-run each new scheduling/cache finding from its scenario file on a fresh server.
        discover: add the decision points ``repro discover`` proposes from the engine's source (hand points win);
            ``hand_points`` False drops the hand catalogue's points (discovery alone; its perturbations, collective
            names and known issues stay); ``discover_rules``: the rules file (default: the adapter's).
        spare: a second trial server (same plan, its own folder ``…-hunt-spare``) is launched as soon as the trial
            server is healthy; after a hang or a crash the hunt swaps to it instead of restarting (False, the
            default: restart). Pays where start-up leaves the CPU idle (weights read from disk); on the 2-core CPU
            testbed start-up is CPU-bound and it did not (benchmarks/RESULTS.md, benchmarks/hunt_restarts.py).
    """

    scenario_path: Path
    catalogue_path: Optional[Path] = None  # None: the base scenario's adapter's catalogue
    only: Sequence[str] = ()
    perturbations: Sequence[str] = ()
    ranks: Sequence[int] = ()
    budget_min: float = 30.0
    evidence_root: Path = ev.DEFAULT_EVIDENCE_DIR
    python: Optional[str] = None
    ref: str = "installed"
    sites: bool = False
    sites_matching: Sequence[str] = ()
    confirm: bool = False
    requests: Optional[int] = None
    command_line: str = ""
    discover: bool = False
    hand_points: bool = True
    discover_rules: Optional[Path] = None
    workloads: Sequence[str] = ()  # workload nemeses (repro.nemeses; "all": every one of the file); quiet always first
    configs: Sequence[str] = ()  # server configurations (axes) beside the base scenario's own
    workload_file: Optional[Path] = None  # default: hunt_workloads.toml beside the catalogue
    group_workloads: Sequence[str] = ()  # set by hunt_matrix: the workloads of one server group (one hunt)
    clean_only: bool = False  # with workloads: only each workload's clean run (no trials): "is the engine safe under it?"
    spare: bool = False  # keep a spare trial server starting in the background; a hang swaps to it (SparedSession)
    shard: Optional[tuple[int, int]] = None  # (K, N): only the trials of shard K of N (repro.shard); None: all


@dataclass
class HuntResult:
    """What a hunt produced: its folder (HUNT.md, hunt.jsonl, scenarios/), rows, results, timings (seconds)."""

    folder: Path
    rows: list
    results: list
    interrupted: bool = False
    budget_exhausted: bool = False
    wall_s: float = 0.0
    baseline: Optional[Path] = None
    discovery: Optional[dict] = None  # --discover: rows reached/fired by origin and discovery's precision
    findings: list = field(default_factory=list)  # FINDING-<workload>.md of clean workloads that deadlocked/desynced

    @property
    def deadlocks(self) -> list:
        return [r for r in self.results if r.verdict == DEADLOCKED]


def read_seen(injector_dir: Path) -> list[dict]:
    """All ``seen`` events of an injector folder, each with the rank of its process (None if not a rank)."""
    from repro import injection_records

    return injection_records.read_injector_dir(injector_dir).seen()


def _check_sites_option(sites: bool, cat: Catalogue, base: Any) -> None:
    if not sites:
        return
    try:
        import repro.ledger  # noqa: F401
    except ImportError:
        raise HuntError("--sites needs the collective ledger (repro/ledger.py, per-rank ledger-<pid>.jsonl), which this "
                        "checkout does not have; run without --sites (decision points only)") from None
    if not cat.site_apis:
        raise HuntError(f"--sites: {cat.path} has no [sites.apis] table saying where the ledger's collective APIs live")
    if not base.ledger:
        raise HuntError("--sites: the base scenario sets ledger = false; the ledger must record the baseline burst")


class _Clock:
    def __init__(self, budget_s: float) -> None:
        self.t0 = time.time()
        self.budget_s = budget_s

    @property
    def elapsed(self) -> float:
        return time.time() - self.t0

    @property
    def remaining(self) -> float:
        return max(0.0, self.budget_s - self.elapsed)


def hunt(opts: HuntOptions, observe: Observer = _noop, *, runner: Any = None) -> HuntResult:
    """Run a hunt: baseline burst → rows → one trial per row × perturbation × rank on a shared server.

    Args:
        opts: see :class:`HuntOptions`.
        observe: progress callback ``(event, data)``: ``hunt_folder``, ``baseline``, ``rows``, ``trial_start``,
            ``trial``, ``progress`` (``done``, ``total``, ``remaining_s``), plus the runner's own events.
        runner: the module providing ``prepare``, ``Session``, ``RunOptions`` and evidence helpers (default
            ``repro.runner``; tests pass a stand-in).
    Returns:
        The :class:`HuntResult`; results also stream to ``HUNT.md`` / ``hunt.jsonl`` in ``result.folder``.
    Raises:
        HuntError: bad scenario/catalogue/option, or the baseline burst failed (message says why and where).
        KeyboardInterrupt: after the server tree was torn down, the overlay removed and HUNT.md marked interrupted.
    """
    from repro.scenario import ScenarioError, load_scenario

    if runner is None:
        from repro import runner as runner_mod

        runner = runner_mod
    if opts.budget_min <= 0:
        raise HuntError(f"--budget-min must be > 0 (got {opts.budget_min})")
    if opts.shard and (opts.workloads or opts.configs):
        raise HuntError("--shard with --workload/--config is not supported yet; shard a hunt without workloads, or "
                        "run the workloads on one box")
    if (opts.workloads or opts.configs) and not opts.group_workloads:
        return hunt_matrix(opts, observe, runner=runner)
    try:
        base = load_scenario(opts.scenario_path)
    except ScenarioError as e:
        raise HuntError(str(e)) from None
    cat = load_catalogue(opts.catalogue_path or catalogue_for(base.server.adapter))
    disc = None  # discovery's state (repro/discover/hunting.py) when --discover
    if opts.discover:
        from repro.discover import hunting

        cat, disc = hunting.prepare(cat, _discovery_python(opts), rules_path=opts.discover_rules,
                                    keep_hand_points=opts.hand_points, adapter=base.server.adapter)
    elif not opts.hand_points:
        raise HuntError("--no-hand-catalogue needs --discover (without either, there is nothing to hunt)")
    _check_sites_option(opts.sites, cat, base)
    ncat = _nemeses_for(opts, cat) if opts.group_workloads else None
    if ncat is not None and opts.sites:
        raise HuntError("--sites with --workload/--config is not supported (the call sites are read from one quiet "
                        "baseline); run --sites without workloads")
    points = [cat.point(n) for n in opts.only] if opts.only else list(cat.points)
    tp = base.server.tp_size
    ranks = list(opts.ranks) if opts.ranks else list(range(tp))
    bad = [r for r in ranks if not 0 <= r < tp]
    if bad:
        raise HuntError(f"--rank {bad}: the base scenario's TP size is {tp}; ranks are 0..{tp - 1}")
    if opts.sites_matching and not opts.sites:
        raise HuntError(f"--sites-matching {' '.join(opts.sites_matching)} needs --sites (it narrows the collective "
                        "call sites --sites adds); add --sites or drop --sites-matching")
    if opts.requests is not None and opts.requests < 1:
        raise HuntError(f"--requests must be ≥ 1 (got {opts.requests})")
    if opts.perturbations and not opts.sites:
        plan_trials(cat, [], ranks, opts.perturbations)  # validates the names (--sites adds its own after the baseline)
        offered = {n for pt in points for n in pt.perturbations}
        missing = [x for x in opts.perturbations if x not in offered]
        if missing:
            raise HuntError(f"--perturbation {', '.join(missing)}: no chosen decision point offers it; "
                            + "; ".join(f"{pt.name}: {', '.join(pt.perturbations)}" for pt in points))
    shard_keys = _shard_keys(opts, points, ranks)  # the split, before any folder, baseline or server
    clock = _Clock(opts.budget_min * 60.0)
    mat = _materialize(opts.ref, opts.python, base.server.adapter)
    if mat is None and opts.python:  # an explicit --python is checked before any folder exists
        from repro.interpreter import InterpreterError, choose_python

        try:
            choose_python(opts.python)
        except InterpreterError as e:
            raise HuntError(str(e)) from None
    try:
        folder = ev.EvidenceDir(opts.evidence_root, base.name, "hunt")
    except ev.EvidenceError as e:
        if mat is not None:
            mat.close()
        raise HuntError(str(e)) from None
    hf = folder.path
    (hf / "scenarios").mkdir(exist_ok=True)
    header = {"scenario": str(opts.scenario_path), "catalogue": str(cat.path), "ref": f"{opts.ref} ({mat.description})" if mat else opts.ref,
              "ranks": ", ".join(map(str, ranks)), "budget_min": opts.budget_min, "command": opts.command_line}
    if disc is not None:
        hunting.write_inputs(disc, hf)
        header["discovery"] = (f"{len(disc.discovery.candidates)} candidates, {len(disc.added)} points added "
                               f"({'with' if opts.hand_points else 'without'} the hand points): discovery/DISCOVERY.md")
    if opts.shard:
        header["shard"] = (f"{opts.shard[0]}/{opts.shard[1]}: {len(shard_keys)} (point, perturbation, rank) key(s) of this "
                           "shard, split before the baseline; `repro hunt-merge` joins the shard folders")
    log = HuntLog(hf, header)
    observe("hunt_folder", {"folder": str(hf)})
    result = HuntResult(hf, [], log.results)
    if opts.shard:
        log.event("shard", k=opts.shard[0], n=opts.shard[1], keys=[list(k) for k in shard_keys],
                  header={k: header[k] for k in ("scenario", "catalogue", "ref", "ranks") if k in header})
    python = mat.python if mat else opts.python
    prepend = tuple(mat.pythonpath_prepend) if mat else ()
    interrupted = False
    try:
        if ncat is not None:  # one clean run per workload on one server, then the trials under each
            result.rows = _hunt_workloads(runner, base, cat, ncat, points, ranks, hf, log, result, clock, observe, opts,
                                          python, prepend)
            raise _Done()
        if opts.shard and not shard_keys and not opts.sites:  # nothing of the plan is this shard's: no server at all
            log.header["trials_total"] = 0
            log.finish("complete", wall_s=clock.elapsed, note=f"shard {opts.shard[0]}/{opts.shard[1]} holds no trial")
            return result
        # ---- 1. baseline: observe-only probes record every call place of every decision point (every point, also
        # in a shard: the trial numbers, and so the burst seeds, are the unsharded plan's)
        probes = {f"probe-{p.name}": p.name for p in points}
        probe_file = hf / "scenarios" / "baseline.toml"
        probe_file.write_text(scenario_toml(
            base, base.name, "repro hunt baseline: observe-only probes on every decision point",
            [("baseline", "success", "record callers of every decision point",
              [{"id": pid, "site": list(cat.point(pn).sites), "action": {"kind": "none", "record_callers": True},
                "gate": {"occurrence": {"mode": "every"}}} for pid, pn in probes.items()])]), encoding="utf-8")
        ro = runner.RunOptions(scenario_path=probe_file, variant="baseline", python=python, evidence_root=opts.evidence_root,
                               label="hunt-baseline", requests=opts.requests, pythonpath_prepend=prepend,
                               command_line=opts.command_line)
        try:
            p0 = runner.prepare(ro)
        except runner.RunError as e:
            raise HuntError(str(e)) from None
        result.baseline = p0.evidence.path
        observe("baseline", {"evidence": str(p0.evidence.path)})
        s0 = _session(runner, p0, observe)
        armed: list[float] = []  # when the server was healthy and the burst began (run_one's on_healthy)
        # the one-variant loop every run uses: verdict.json, REPORT.md, ... in the baseline's folder; the server is
        # stopped after the burst, the folder marked complete (interrupted: marked so, KeyboardInterrupt re-raised)
        from repro.runner import run_one  # runner may be a stand-in: its session and evidence writer are used

        oc = run_one(p0, ro, observe, s0, finish=runner.finish_evidence, on_healthy=lambda: armed.append(time.time()))
        if not armed:
            raise HuntError(f"baseline server: {oc.verdict.reason} (evidence: {p0.evidence.path})")
        t_arm = armed[0]
        st = oc.state
        versions = runner.collect_versions(p0.evidence.injector_dir, p0.python)
        from repro.targets.registry import get_adapter

        engine_key = (getattr(p0, "adapter", None) or get_adapter(base.server.adapter)).ref_location.version_key
        log.header.update({k: versions.get(k) for k in (engine_key, "torch", "python")})
        if oc.verdict.verdict == DEADLOCKED or st is None or st.ok != st.total:
            raise HuntError(f"the clean baseline burst did not succeed ({oc.verdict.verdict}: {oc.verdict.reason}); "
                            f"a hunt needs a healthy base scenario. Evidence: {p0.evidence.path}")
        seen = read_seen(p0.evidence.injector_dir)
        rows = rows_from_seen(cat, seen, probes)
        if opts.sites:
            from repro.ledger import load_ledgers

            leds = load_ledgers(p0.evidence.injector_dir, list(s0.rank_pids.values()) or None)
            records = [r for led in leds.values() for r in led.records]
            cat, srows = site_rows(cat, records, t_arm, opts.sites_matching)
            if not srows:
                seen_sites = sorted({" ← ".join(_short(f) for f in r.site[:4]) for r in records
                                     if not r.inj and r.t_enter >= t_arm and r.site})
                what = (f"no collective call site of the baseline burst matched --sites-matching "
                        f"{' '.join(opts.sites_matching)}" if opts.sites_matching
                        else "the ledger saw no collective call site during the baseline burst")
                log.event("sites", note=what, seen=seen_sites)
                if opts.sites_matching:
                    shown = "; ".join(seen_sites[:8]) or "none"
                    count = f"first 8 of {len(seen_sites)}" if len(seen_sites) > 8 else str(len(seen_sites))
                    raise HuntError(f"{what}. Call sites seen ({count}; all in hunt.jsonl): {shown}. Globs match any of a "
                                    f"site's frames (Class.method, or module:Class.method with a ':'). Baseline "
                                    f"evidence: {p0.evidence.path}")
            rows = rows + srows
        result.rows = rows
        seen_points = {r.point for r in rows}
        log.header["points_not_seen"] = [p.name for p in points if p.name not in seen_points]
        if disc is not None:
            log.event("discovery_not_reached", points=hunting.after_baseline(disc, rows))
        log.set_rows(rows)
        log.event("baseline", evidence=str(p0.evidence.path), seen=len(seen), rows=len(rows), healthy_s=s0.healthy_s,
                  burst_s=oc.timings.get("burst_s"))
        observe("rows", {"rows": rows, "not_seen": log.header["points_not_seen"]})
        trials = plan_trials(cat, rows, ranks, opts.perturbations)
        if opts.shard:
            from repro import shard as shard_mod

            log.event("plan", trials=[[t.n, t.name] for t in trials])  # the unsharded plan: hunt-merge checks it
            log.header["plan_total"] = len(trials)
            mine, named = set(shard_keys), {p.name for p in points}

            def in_shard(t: Trial) -> bool:  # a decision point's trial: its key was split before the baseline;
                key = shard_mod.trial_key(t)  # a --sites point exists only after it: the same hash splits it
                return key in mine if t.row.point in named else shard_mod.shard_of(key, opts.shard[1]) == opts.shard[0]

            trials = [t for t in trials if in_shard(t)]
        log.header["trials_total"] = len(trials)
        if not trials:
            log.finish("complete", wall_s=clock.elapsed)
            return result
        # ---- 2. trials: one plan with every trial's injection, armed one at a time
        _trial_phase(runner, base, cat, trials, hf, log, clock, observe, opts, python, prepend)
        result.budget_exhausted = any(r.verdict == NOT_RUN for r in log.results)
        if opts.confirm:
            _confirm(runner, log, python, prepend, opts, clock, observe)
            from repro.discover.finding import write_findings

            write_findings(log, cat, base, opts.scenario_path, disc)
    except _Done:
        result.budget_exhausted = any(r.verdict == NOT_RUN for r in log.results)
    except KeyboardInterrupt:
        interrupted = True
    except HuntError as e:
        log.finish("failed", error=str(e), wall_s=clock.elapsed)
        raise
    finally:
        if mat is not None:
            mat.close()
        result.wall_s = clock.elapsed
        result.interrupted = interrupted
        if disc is not None:
            result.discovery = hunting.finish(disc, hf, result.rows, log.results)
            log.event("discovery", **result.discovery)
            log.header["discovery"] = hunting.header_line(disc, result.discovery)
        status = "interrupted" if interrupted else "complete"
        if log.status == "running":
            log.finish(status, wall_s=result.wall_s)
        folder.set_status(status, wall_s=result.wall_s)
    if interrupted:
        raise KeyboardInterrupt
    return result


def _shard_keys(opts: HuntOptions, points: Sequence[DecisionPoint], ranks: Sequence[int]) -> list:
    """This shard's (point, perturbation, rank, workload) keys (``repro.shard``); [] without ``--shard``.

    Raises:
        HuntError: a K/N that is not 1 <= K <= N (the CLI parses ``--shard`` first: ``repro.shard.parse_shard``).
    """
    if not opts.shard:
        return []
    from repro import shard as shard_mod

    k, n = opts.shard
    if not (n >= 1 and 1 <= k <= n):
        raise HuntError(f"--shard {k}/{n}: expected K/N with integers 1 <= K <= N, e.g. --shard 1/4")
    return shard_mod.shard_plan_keys(points, ranks, opts.perturbations, k, n)


def _trial_phase(runner: Any, base: Any, cat: Catalogue, trials: Sequence[Trial], hf: Path, log: HuntLog, clock: _Clock,
                 observe: Observer, opts: HuntOptions, python: Optional[str], prepend: tuple) -> None:
    """Write one plan with every trial's injection (and workload), start its server, arm each trial in turn."""
    trial_file = hf / "scenarios" / "trials.toml"
    trial_file.write_text(scenario_toml(
        base, base.name, "repro hunt trials (generated)",
        [(t.name, "success", t.perturbation.says, [t.injection(cat.point(t.row.point).sites)], _trial_extra(opts, cat, t))
         for t in trials]), encoding="utf-8")
    ro = runner.RunOptions(scenario_path=trial_file, python=python, evidence_root=opts.evidence_root, label="hunt-session",
                           requests=opts.requests, pythonpath_prepend=prepend, command_line=opts.command_line)
    try:
        p = runner.prepare(ro, label_default="hunt-session", variants=[t.name for t in trials])
    except runner.RunError as e:
        raise HuntError(str(e)) from None
    log.event("session", evidence=str(p.evidence.path))  # the trial server's run folder (`repro cleanup` finds it)
    spare_p = None
    if opts.spare and len(trials) > 1:  # one trial never needs a second server
        ro_spare = replace(ro, label="hunt-spare")
        try:
            spare_p = runner.prepare(ro_spare, label_default="hunt-spare", variants=[t.name for t in trials])
        except runner.RunError as e:
            raise HuntError(str(e)) from None
        log.event("spare_session", evidence=str(spare_p.evidence.path))
    _run_trials(runner, p, ro, base, cat, trials, log, clock, observe, opts, spare_p)


def _discovery_python(opts: HuntOptions) -> str:
    """The interpreter whose engine source discovery scans: ``--ref python:PATH``'s, else as the server's."""
    from repro.interpreter import InterpreterError, choose_python

    explicit = opts.ref[len("python:"):] if opts.ref.startswith("python:") else opts.python
    try:
        return choose_python(explicit)
    except InterpreterError as e:
        raise HuntError(str(e)) from None


def _materialize(ref: str, python: Optional[str], adapter_name: Optional[str] = None) -> Any:
    """``installed`` → None (the interpreter as given); other REFs → a ``repro.compare.Materialized`` (close it),
    made where the base scenario's adapter (``adapter_name``; default: the registry's default) keeps its package."""
    if not ref or ref == "installed":
        return None
    from repro.compare import CompareError, materialize, parse_ref
    from repro.targets.registry import get_adapter

    try:
        ad = get_adapter(adapter_name)
        return materialize(parse_ref(ref), python, ref_location=ad.ref_location, adapter=ad)
    except CompareError as e:
        raise HuntError(f"--ref {ref}: {e}") from None


def _counts(check: Any) -> tuple[dict, dict, dict]:
    if check is None:
        return {}, {}, {}
    return dict(check.entered), dict(check.matched), dict(check.fired)


def trial_seed(base: Any, trial: Trial) -> int:
    """The burst seed of one trial: the base scenario's seed + the trial number (the baseline uses the base seed)."""
    return int(base.burst.seed) + trial.n


def _run_trials(runner: Any, p: Any, ro: Any, base: Any, cat: Catalogue, trials: Sequence[Trial], log: HuntLog,
                clock: _Clock, observe: Observer, opts: HuntOptions, spare_p: Any = None) -> None:
    """Drive every trial on one session; after a hang/crash swap to the spare server (``spare_p``'s, when given)
    or restart; mark the rest NOT RUN when the budget ends."""
    if clock.remaining <= 0:  # the baseline used up the budget: do not start a trial server for nothing
        _not_run(log, trials, f"budget of {opts.budget_min:g} min ended before this trial")
        return
    from repro.runner import VariantItem, run_variants  # the one multi-variant loop (runner may be a stand-in)

    started = [0]  # trials started so far (a spare is worth launching while one more is left after the next)
    session: Any = _session(runner, p, observe)
    if spare_p is not None:
        session = SparedSession(session, _session(runner, spare_p, observe),
                                want_spare=lambda: clock.remaining > 0 and started[0] + 1 < len(trials), log=log)
    by_name = {t.name: t for t in trials}
    items = [VariantItem(t.name, command=(opts.command_line or f"repro hunt {opts.scenario_path}") + f"  # trial {t.name}",
                         seed=trial_seed(base, t), session_info={"hunt": str(log.folder)}) for t in trials]

    def before(i: int, item: Any) -> Optional[str]:
        return f"budget of {opts.budget_min:g} min ended before this trial" if clock.remaining <= 0 else None

    def on_start(i: int, item: Any) -> None:
        started[0] = i + 1
        observe("trial_start", {"trial": by_name[item.variant], "n": i + 1, "total": len(trials), "remaining_s": clock.remaining})

    def on_result(d: Any) -> None:
        t = by_name[d.item.variant]
        sp = session.p  # the server this trial ran on (the spare after a swap)
        tr = _trial_result(runner, sp, base, cat, t, d.variant, d.outcome, d.run_dir.path, session.rank_pids, log.folder,
                           opts, _log_since(sp.evidence.file("server.log"), d.log_offset) if not d.outcome.clean else "")
        results[d.item.variant] = tr
        log.add(tr)
        observe("trial", {"result": tr, "n": d.index + 1, "total": len(trials), "remaining_s": clock.remaining})

    def on_died_between(prev: Any, since_s: float, log_text: str) -> None:
        _amend_died_after(log, results[prev.item.variant], since_s, log_text, cat)

    def on_interrupt(item: Any, run_dir: Any) -> None:
        log.event("interrupted_during", trial=item.variant, evidence=str(run_dir.path))
        log.header["interrupted_during"] = f"{item.variant} (partial evidence: {run_dir.path})"

    results: dict[str, TrialResult] = {}
    try:
        run_variants(session, ro, items, on_result, before=before, on_start=on_start,
                     on_not_run=lambda rest, why: _not_run(log, [by_name[x.variant] for x in rest], why),
                     on_died_between=on_died_between, on_interrupt=on_interrupt, settle_s=SETTLE_S,
                     max_restart_failures=MAX_RESTART_FAILURES, finish=runner.finish_evidence,
                     snapshot=runner.snapshot_session)
    finally:
        session.stop()
        session.close_drivers()
        p.evidence.set_status("complete")
        if spare_p is not None:
            spare_p.evidence.set_status("complete")
            log.header["restarts"] = session.summary()
            log.event("restarts", swaps=session.swaps, plain_restarts=session.restarts)


class SparedSession:
    """A hunt's trial server with a spare: two :class:`repro.runner.Session` over two plans of the same trials.

    Looks like one session to :func:`repro.runner.run_variants` (``p``, ``server``, ``rank_pids``, ``healthy_s``,
    ``start``, ``restart``, ``drive``, ``stop``, ``close_drivers``; ``p`` is the active server's plan, so each
    trial's evidence, log slice and injector records come from the server it ran on). Once the active server is
    healthy the other session's server is launched in the background (``Session.launch``, only while
    ``want_spare()``); after a hang or a crash ``restart`` swaps: the hung server is torn down in a thread while
    the spare's remaining start-up is waited for (it must answer health, map its ranks and resolve its sites like
    any fresh server: a fresh process tree, nothing of the hung one reused), and a new spare is launched on the
    freed plan. With no spare launched, ``restart`` stops and starts as a plain session does.

    The two servers run at once only while one of them starts or idles; the launcher gives each its own ports and
    HiCache storage folder. ``stop`` ends both (also on KeyboardInterrupt: the teardown thread is joined first).

    Args:
        active, other: sessions over two prepared plans of the same trial variants (``runner.prepare`` twice).
        want_spare: asked before each launch of a spare (e.g. "a trial is left after the next one, budget left").
        log: the hunt log: one ``spare`` event per swap or failed spare launch.
    """

    def __init__(self, active: Any, other: Any, want_spare: Callable[[], bool], log: Optional[HuntLog] = None) -> None:
        self.active, self.other = active, other
        self.want_spare = want_spare
        self.log = log
        self.spare_launched = False
        self.stopper: Optional[threading.Thread] = None
        self.swaps: list[dict] = []  # per swap: seconds blocked waiting for the spare, its start-up since launch
        self.restarts = 0  # plain restarts (no spare was launched to swap to)

    @property
    def p(self) -> Any:
        return self.active.p

    @property
    def server(self) -> Any:
        return self.active.server

    @property
    def rank_pids(self) -> dict:
        return self.active.rank_pids

    @property
    def healthy_s(self) -> Optional[float]:
        return self.active.healthy_s

    def _event(self, **data: Any) -> None:
        if self.log is not None:
            self.log.event("spare", **data)

    def _join_stopper(self) -> None:
        if self.stopper is not None:
            self.stopper.join()
            self.stopper = None

    def _launch_spare(self) -> None:
        if self.spare_launched or not self.want_spare():
            return
        self._join_stopper()  # the other plan's previous server is fully gone before its plan is reused
        failed = self.other.launch()
        if failed is not None:
            self.other.stop()
            self._event(action="launch_failed", reason=failed.reason)
            return
        self.spare_launched = True

    def start(self) -> Optional[Any]:
        """Start the active server (waits healthy), then launch the spare. Returns None or the failure verdict."""
        failed = self.active.start()
        if failed is None:
            self._launch_spare()
        return failed

    def restart(self) -> Optional[Any]:
        """After a hang or a crash: swap to the spare (or, with none launched, restart the active server).

        Returns:
            None once the new active server is healthy, else the INCONCLUSIVE verdict saying why it is not.
        """
        old = self.active
        if not self.spare_launched:
            self.restarts += 1
            failed = old.restart()
        else:
            self.active, self.other, self.spare_launched = self.other, old, False
            self.stopper = threading.Thread(target=old.stop, name="repro-hunt-teardown")
            self.stopper.start()
            t0 = time.time()
            failed = self.active.start()  # the rest of its start-up, checked like any fresh server
            self.swaps.append({"waited_s": round(time.time() - t0, 1), "healthy_s": round(self.active.healthy_s or 0.0, 1),
                               "ok": failed is None})
            self._event(action="swap", evidence=str(self.active.p.evidence.path), **self.swaps[-1],
                        **({"reason": failed.reason} if failed is not None else {}))
        if failed is None:
            self._launch_spare()
        return failed

    def drive(self, *a: Any, **kw: Any) -> Any:
        return self.active.drive(*a, **kw)

    def stop(self) -> list:
        """End both servers (idempotent); returns what was left running of either."""
        self._join_stopper()
        self.spare_launched = False
        return [*self.active.stop(), *self.other.stop()]

    def close_drivers(self) -> None:
        self.active.close_drivers()
        self.other.close_drivers()

    def summary(self) -> str:
        """One line for HUNT.md: swaps to the spare (and the seconds waited for it in all), plain restarts."""
        waited = sum(x["waited_s"] for x in self.swaps)
        return (f"{len(self.swaps)} swap(s) to the spare server (waited {waited:.0f} s in all for it to be healthy), "
                f"{self.restarts} plain restart(s)")


def _session(runner: Any, p: Any, observe: Observer) -> Any:
    """The session of ``p`` as every verb builds it (``runner.make_session``: one server, or the whole stack of a
    multi-server base scenario), its teardown SIGKILLing what is left after :data:`STOP_GRACE_S` seconds. Used
    for the baseline, the trials and the spare alike."""
    s = runner.make_session(p, observe)
    s.stop_grace_s = STOP_GRACE_S
    return s


def _not_run(log: HuntLog, trials: Sequence[Trial], why: str) -> None:
    """Record each of ``trials`` as NOT RUN, saying why."""
    for t in trials:
        log.add(TrialResult(t, NOT_RUN, why))


def _amend_died_after(log: HuntLog, r: TrialResult, after_s: float, log_text: str, cat: Catalogue) -> None:
    """The server died after trial ``r`` ended clean (later than SETTLE_S): make ``r`` INCONCLUSIVE, say why.

    The trial's line in hunt.jsonl stays as written; an ``amended`` line follows it and HUNT.md is rewritten.
    """
    diag = crash_diagnosis(log_text, cat) if log_text else None
    tail = [ln for ln in log_text.splitlines() if ln.strip()][-1:] if log_text else []
    r.verdict = INCONCLUSIVE
    r.reason = (f"the server died {after_s:.0f} s after this trial's clean burst, before the next trial (nothing else "
                f"ran in between); verdict before: ALL REQUESTS SUCCEEDED" + (f"; last log line: {tail[0][:200]}" if tail else ""))
    r.diagnosis = diag or r.diagnosis
    t = r.trial
    r.hazard = (hazard_statement(t, INCONCLUSIVE, diag, sum(r.matched.values()), sum(r.fired.values()), 0)
                if diag and diag.crash is not None else
                f"rank-local `{t.row.point}` {t.perturbation.says} on rank {t.rank} ({t.row.where}): the server died "
                f"{after_s:.0f} s after the burst (a delayed crash: see the server log)")
    log.event("amended", trial=t.name, verdict=r.verdict, reason=r.reason)
    log._write_md()


def _log_since(path: Path, offset: int, max_bytes: int = 4_000_000) -> str:
    """The server log written since ``offset`` (bytes), at most the last ``max_bytes`` (``repro.runner.log_since``)."""
    from repro.runner import log_since

    return log_since(path, offset, max_bytes)


def _trial_result(runner: Any, p: Any, base: Any, cat: Catalogue, t: Trial, variant: Any, outcome: Any, run_dir: Path,
                  rank_pids: dict, hunt_folder: Path, opts: HuntOptions, log_text: str = "") -> TrialResult:
    v: Verdict = outcome.verdict
    check = None
    if rank_pids:
        try:
            # the records finish_evidence already read (Outcome.injector), else the folder
            _, _, checks, _ = runner.injection_checks(getattr(outcome, "injector", None) or p.evidence.injector_dir,
                                                      variant, rank_pids)
            check = checks[0] if checks else None
        except Exception:
            check = None
    entered, matched, fired = _counts(check)
    diag = None
    if v.verdict == DEADLOCKED:
        a = outcome.analysis
        diag = diagnose(a.to_dict() if hasattr(a, "to_dict") else a, cat)
    elif log_text:
        diag = crash_diagnosis(log_text, cat)
    if v.verdict == DESYNCED and getattr(v, "desync", None):  # the ledgers named where the ranks' collectives differ
        from repro.discover.hunting import desync_diagnosis

        diag = diag or desync_diagnosis(v.desync, cat)
    world = base.server.tp_size
    verdict = v.verdict
    hazard = hazard_statement(t, verdict, diag, sum(matched.values()), sum(fired.values()), world)
    if verdict == INCONCLUSIVE and not (diag and diag.crash is not None):
        hazard = f"rank-local `{t.row.point}` {t.perturbation.says} on rank {t.rank} ({t.row.where}): inconclusive ({v.reason[:200]})"
    tr = TrialResult(t, verdict, v.reason, float(outcome.timings.get("burst_s", outcome.timings.get("to_verdict_s", 0.0))),
                     diag, hazard, run_dir, None, entered, matched, fired, tuple(v.notes))
    if verdict == DEADLOCKED or tr.desync_crash:
        held = getattr(outcome, "ledger", None)  # the diagnosis finish_evidence aligned, else its ledger.json
        if held is not None:
            tr.ledger = str(held.divergence.summary or "")
        else:
            led = ev.EvidenceDir.open(run_dir).ledger.read(missing_ok=True) or {}
            tr.ledger = str(((led.get("divergence") or {}) if isinstance(led, dict) else {}).get("summary") or "")
    if verdict == DESYNCED:
        tr.ledger = str((getattr(v, "desync", None) or {}).get("summary") or v.reason)
    if verdict in (DEADLOCKED, DESYNCED):
        f = hunt_folder / "scenarios" / f"{t.name}.toml"
        f.write_text(finding_scenario(base, opts.scenario_path, cat, t, diag, verdict, _trial_extra(opts, cat, t)), encoding="utf-8")
        tr.scenario_file = f
    return tr


def _confirm(runner: Any, log: HuntLog, python: Optional[str], prepend: tuple, opts: HuntOptions, clock: _Clock,
             observe: Observer) -> None:
    """Re-run each new scheduling/cache finding from its scenario file on a fresh server (a finding must reproduce)."""
    for r in list(log.results):
        d = r.diagnosis
        if (r.verdict not in (DEADLOCKED, DESYNCED) or r.scenario_file is None or not d or d.family != FAMILY_SCHED or d.known
                or r.trial.perturbation.by_construction):
            continue
        if clock.remaining <= 0:
            break
        observe("confirm", {"trial": r.trial, "scenario": str(r.scenario_file)})
        ro = runner.RunOptions(scenario_path=r.scenario_file, python=python, evidence_root=opts.evidence_root,
                               label=f"confirm-{r.trial.name}", pythonpath_prepend=prepend)
        res = runner.run(ro, observe)
        r.confirmed = res.verdict.verdict == r.verdict
        log.event("confirm", trial=r.trial.name, verdict=res.verdict.verdict, evidence=str(res.evidence))
        log._write_md()


# ----------------------------------------------------------------------------------- workloads and configurations
class _Done(Exception):
    """The workload path of :func:`hunt` finished its baselines and trials (control flow only)."""


_NEMESES_CACHE: dict[str, Any] = {}


def _nemeses_for(opts: HuntOptions, cat: Catalogue) -> Any:
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


def _trial_extra(opts: HuntOptions, cat: Catalogue, t: Trial) -> dict:
    if not t.workload:
        return {}
    return workload_extra(_nemeses_for(opts, cat).workload(t.workload))


def _admin_summary(admin: Sequence[dict]) -> str:
    """``DELETE /hicache/storage-backend → 400; POST /flush_cache → 400, 400, 200`` (per call: each answer)."""
    by: dict[tuple, list[str]] = {}
    for a in sorted(admin, key=lambda a: (a.get("call", 0), a.get("n", 0))):
        ans = str(a.get("http_status")) if a.get("http_status") is not None else ("timeout" if a.get("timeout") else "not called" if not a.get("done", True) else "error")
        by.setdefault((a.get("call", 0), a.get("method"), a.get("path")), []).append(ans)
    return "; ".join(f"{m} {p} → {', '.join(v)}" for (_, m, p), v in by.items())


def _hunt_workloads(runner: Any, base: Any, cat: Catalogue, ncat: Any, points: Sequence[DecisionPoint], ranks: Sequence[int],
                    hf: Path, log: HuntLog, result: HuntResult, clock: _Clock, observe: Observer, opts: HuntOptions,
                    python: Optional[str], prepend: tuple) -> list[Row]:
    """One server group of a hunt under workloads: each workload's clean run (observe-only probes, its own verdict in
    HUNT.md; a deadlock/desync there is a finding: FINDING-<workload>.md) on ONE server, then every row it reached ×
    perturbation × rank under that workload on the trial server.

    Returns:
        The rows of every workload (union; a row reached by two workloads is tried under each).
    Raises:
        HuntError: the quiet workload (the base scenario's own burst) did not succeed clean.
    """
    from repro.nemeses import QUIET
    from repro.runner import VariantItem, run_variants

    names = list(opts.group_workloads)
    vname = {w: "baseline" if w == QUIET else f"baseline-{w}" for w in names}
    probes_by = {w: {f"probe-{p.name}" + ("" if w == QUIET else f".{w}"): p.name for p in points} for w in names}
    specs = {w: ncat.workload(w) for w in names}
    probe_file = hf / "scenarios" / "baseline.toml"
    probe_file.write_text(scenario_toml(
        base, base.name, "repro hunt baseline: each workload clean, observe-only probes on every decision point",
        [(vname[w], "success", f"clean run under workload {w}: {specs[w].says}",
          [{"id": pid, "site": list(cat.point(pn).sites), "action": {"kind": "none", "record_callers": True},
            "gate": {"occurrence": {"mode": "every"}}} for pid, pn in probes_by[w].items()], workload_extra(specs[w]))
         for w in names]), encoding="utf-8")
    ro = runner.RunOptions(scenario_path=probe_file, python=python, evidence_root=opts.evidence_root, label="hunt-baseline",
                           requests=opts.requests, pythonpath_prepend=prepend, command_line=opts.command_line)
    try:
        p0 = runner.prepare(ro, label_default="hunt-baseline", variants=[vname[w] for w in names])
    except runner.RunError as e:
        raise HuntError(str(e)) from None
    result.baseline = p0.evidence.path
    observe("baseline", {"evidence": str(p0.evidence.path)})
    session = _session(runner, p0, observe)
    done: dict[str, Any] = {}
    items = [VariantItem(vname[w], command=(opts.command_line or f"repro hunt {opts.scenario_path}") + f"  # clean run, workload {w}",
                         session_info={"hunt": str(hf), "workload": w}) for w in names]
    log_path = p0.evidence.file("server.log")
    t0 = time.time()
    try:
        run_variants(session, ro, items, lambda d: done.__setitem__(d.item.variant, d), settle_s=SETTLE_S,
                     before=lambda i, item: (f"budget of {opts.budget_min:.1f} min ended before this clean run"
                                             if clock.remaining <= 0 else None),
                     max_restart_failures=MAX_RESTART_FAILURES, finish=runner.finish_evidence, snapshot=runner.snapshot_session,
                     on_not_run=lambda rest, why: log.event("baseline_not_run", variants=[x.variant for x in rest], why=why))
    finally:
        session.stop()
        session.close_drivers()
        p0.evidence.set_status("complete")
    log.header["baseline_s"] = round(time.time() - t0, 1)
    versions = runner.collect_versions(p0.evidence.injector_dir, p0.python)
    from repro.targets.registry import get_adapter

    engine_key = (getattr(p0, "adapter", None) or get_adapter(base.server.adapter)).ref_location.version_key
    log.header.update({k: versions.get(k) for k in (engine_key, "torch", "python")})
    seen = read_seen(p0.evidence.injector_dir)
    baselines: list[dict] = []
    rows_by: dict[str, list[Row]] = {}
    for w in names:
        d = done.get(vname[w])
        spec = specs[w]
        entry: dict = {"workload": w, "says": spec.says, "verdict": NOT_RUN, "reason": "the budget ended before this clean run"}
        if d is not None:
            st, v = d.outcome.state, d.outcome.verdict
            entry.update(verdict=v.verdict, reason=v.reason, evidence=str(d.run_dir.path),
                         ok=st.ok if st else 0, aborted=st.aborted if st else 0, failed=st.failed if st else 0,
                         admin=_admin_summary(st.admin if st else ()), burst_s=round(d.outcome.timings.get("burst_s", 0.0), 1))
            if spec.expect_log:
                text = _log_since(log_path, d.log_offset)
                hits = {pat: len(re.findall(pat, text)) for pat in spec.expect_log}
                entry["log"] = "; ".join(f"'{k}' ×{n}" if n else f"no '{k}' (the nemesis did not take effect)" for k, n in hits.items())
            if v.verdict in (DEADLOCKED, DESYNCED):
                entry["finding"] = str(_workload_finding(base, opts, cat, w, spec, d, hf))
                result.findings.append(entry["finding"])
        baselines.append(entry)
        log.event("workload_baseline", **entry)
        ids = probes_by[w]
        rows_by[w] = rows_from_seen(cat, [e for e in seen if e.get("id") in ids], ids)
    log.header["workload_baselines"] = baselines
    quiet = next((b for b in baselines if b["workload"] == QUIET), None)
    if quiet is not None and quiet["verdict"] not in (SUCCEEDED, NOT_RUN):
        raise HuntError(f"the clean baseline burst did not succeed ({quiet['verdict']}: {quiet.get('reason', '')}); a hunt "
                        f"needs a healthy base scenario. Evidence: {quiet.get('evidence') or p0.evidence.path}")
    all_probes = {k: v for w in names for k, v in probes_by[w].items()}
    rows = rows_from_seen(cat, seen, all_probes)
    seen_points = {r.point for r in rows}
    log.header["points_not_seen"] = [p.name for p in points if p.name not in seen_points]
    log.set_rows(rows)
    log.event("baseline", evidence=str(p0.evidence.path), seen=len(seen), rows=len(rows), healthy_s=session.healthy_s,
              rows_by_workload={w: len(r) for w, r in rows_by.items()})
    observe("rows", {"rows": rows, "not_seen": log.header["points_not_seen"]})
    trials: list[Trial] = []
    for w in names:
        trials += plan_trials(cat, rows_by[w], ranks, opts.perturbations, workload="" if w == QUIET else w,
                              first_n=len(trials) + 1)
    if opts.clean_only:
        log.event("clean_only", trials_planned=len(trials))
        trials = []
    log.header["trials_total"] = len(trials)
    if trials:
        _trial_phase(runner, base, cat, trials, hf, log, clock, observe, opts, python, prepend)
    log.finish("complete", wall_s=clock.elapsed)
    return rows


def _workload_finding(base: Any, opts: HuntOptions, cat: Catalogue, w: str, spec: Any, d: Any, hf: Path) -> Path:
    """A clean workload that deadlocked or desynced: its scenario file (no injection) and FINDING-<workload>.md."""
    v = d.outcome.verdict
    diag = None
    if v.verdict == DEADLOCKED and d.outcome.analysis is not None:
        a = d.outcome.analysis
        diag = diagnose(a.to_dict() if hasattr(a, "to_dict") else a, cat)
    sc = hf / "scenarios" / f"workload-{w}.toml"
    expect = "desync" if v.verdict == DESYNCED else "deadlock"
    sc.write_text(scenario_toml(base, re.sub(r"[^A-Za-z0-9_.-]+", "_", f"hunt_workload_{w}"),
                                f"repro hunt: the engine {v.verdict} under workload {w} with no perturbation",
                                [("finding", expect, spec.says, [], workload_extra(spec))],
                                comment=f"Written by `repro hunt` from {opts.scenario_path}: workload {w}, no injection.\n"
                                        f"Run: repro run <this file>   (expects {v.verdict})"), encoding="utf-8")
    f = hf / f"FINDING-{w}.md"
    lines = [f"# {v.verdict} under workload `{w}`, with no perturbation", "",
             f"**The load:** {spec.says}. Engine flags: `{' '.join(base.server.args)}`.", "",
             f"**What happened:** {v.reason}", ""]
    if diag is not None:
        lines += [f"**Divergent collective:** {diag.collective} (family: {diag.family}; ranks in it: "
                  f"{', '.join(map(str, diag.in_ranks)) or '?'})", ""]
        lines += [f"- rank {k}: {where}" for k, where in sorted(diag.where.items())] + [""]
    lines += [f"**Minimal scenario:** [`{_rel(sc, hf)}`]({_rel(sc, hf)}) (`repro run {sc}`).",
              f"**Evidence:** [{_rel(d.run_dir.path, hf)}]({_rel(d.run_dir.path, hf)}/REPORT.md).", "",
              "**Not yet confirmed** from the scenario file on a fresh server; re-run it before filing upstream."]
    f.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return f


def hunt_matrix(opts: HuntOptions, observe: Observer = _noop, *, runner: Any = None) -> HuntResult:
    """``repro hunt --workload … --config …``: the base configuration and each named one × every workload.

    Workloads whose engine flags agree run on one server group (``repro.nemeses.server_groups``); each group is one
    hunt (its own folder, HUNT.md with each workload's clean verdict, trials under each workload). The budget is
    shared: each group gets the time left divided by the groups left. The top folder's HUNT.md has one row per
    group and workload: configuration, flags, clean verdict, rows, trials, verdicts, wall time.

    Returns:
        A :class:`HuntResult` of the top folder, with every group's rows and results.
    Raises:
        HuntError: bad workload/config name or file, before anything is launched; a group's own errors are
            recorded in its row and the next group runs.
        KeyboardInterrupt: after the running group tore its server down; the top HUNT.md says so.
    """
    import dataclasses

    from repro import nemeses
    from repro.scenario import ScenarioError, load_scenario

    try:
        base = load_scenario(opts.scenario_path)
    except ScenarioError as e:
        raise HuntError(str(e)) from None
    cat = load_catalogue(opts.catalogue_path or catalogue_for(base.server.adapter))
    ncat = _nemeses_for(opts, cat)
    wanted = list(opts.workloads)
    if "all" in wanted:
        wanted = list(ncat.workloads)
    names = [nemeses.QUIET] + [w for w in dict.fromkeys(wanted) if w != nemeses.QUIET]
    configs = ["base"] + [c for c in dict.fromkeys(opts.configs) if c != "base"]
    try:
        for w in names:
            ncat.workload(w)
        groups = nemeses.server_groups(base.server.args, ncat, configs, names)
    except nemeses.NemesisError as e:
        raise HuntError(str(e)) from None
    try:
        top = ev.EvidenceDir(opts.evidence_root, base.name, "hunt-matrix")
    except ev.EvidenceError as e:
        raise HuntError(str(e)) from None
    (top.path / "scenarios").mkdir(exist_ok=True)
    observe("hunt_folder", {"folder": str(top.path)})
    clock = _Clock(opts.budget_min * 60.0)
    entries: list[dict] = []
    out = HuntResult(top.path, [], [])
    status = "running"

    def write() -> None:
        ev.write_text_atomic(top.path / ev.Layout.HUNT_MD.name, matrix_markdown(opts, ncat, groups, entries, status, clock.elapsed, top.path))
        ev.write_text_atomic(top.path / "matrix.json", json.dumps({"status": status, "wall_s": round(clock.elapsed, 1),
                                                                   "groups": entries}, indent=1, default=str))

    write()
    try:
        for i, g in enumerate(groups):
            entry: dict = {"config": g.config, "args": list(g.args), "workloads": list(g.workloads), "status": NOT_RUN}
            entries.append(entry)
            left = clock.remaining / max(1, len(groups) - i)
            if left <= 0:
                entry["why"] = f"budget of {opts.budget_min:g} min ended before this group"
                write()
                continue
            b = base.model_copy(update={"server": base.server.model_copy(update={"args": list(g.args)})})
            f = top.path / "scenarios" / f"{i + 1:02d}-{g.label}.toml"
            f.write_text(scenario_toml(b, b.name, f"repro hunt group {g.label}: {base.name} with flags {' '.join(g.args)}",
                                       [("base", "success", "the base burst", [])]), encoding="utf-8")
            sub = dataclasses.replace(opts, scenario_path=f, workloads=(), configs=(), group_workloads=g.workloads,
                                      budget_min=left / 60.0, evidence_root=top.path, workload_file=ncat.path,
                                      catalogue_path=cat.path)
            t0 = time.time()
            try:
                r = hunt(sub, observe, runner=runner)
            except HuntError as e:
                entry.update(status="failed", error=str(e), wall_s=round(time.time() - t0, 1))
                write()
                continue
            md = (r.folder / ev.Layout.HUNT_JSONL.name)
            baselines = []
            if md.exists():
                for line in md.read_text(encoding="utf-8").splitlines():
                    try:
                        e = json.loads(line)
                    except ValueError:
                        continue
                    if e.get("event") == "workload_baseline":
                        baselines.append(e)
            counts: dict[str, dict[str, int]] = {}
            for tr in r.results:
                counts.setdefault(tr.trial.workload or nemeses.QUIET, {}).setdefault(tr.verdict, 0)
                counts[tr.trial.workload or nemeses.QUIET][tr.verdict] += 1
            entry.update(status="interrupted" if r.interrupted else "complete", folder=str(r.folder), rows=len(r.rows),
                         trials=len(r.results), wall_s=round(time.time() - t0, 1), baselines=baselines, verdicts=counts,
                         budget_s=round(left, 1))
            out.rows += r.rows
            out.results += r.results
            out.findings += r.findings
            write()
    except KeyboardInterrupt:
        status = "interrupted"
        out.interrupted = True
        write()
        raise
    status = "complete"
    out.wall_s = clock.elapsed
    out.budget_exhausted = any(e["status"] == NOT_RUN for e in entries) or any(r.verdict == NOT_RUN for r in out.results)
    write()
    return out


def matrix_markdown(opts: HuntOptions, ncat: Any, groups: Sequence[Any], entries: Sequence[dict], status: str,
                    wall_s: float, folder: Path) -> str:
    """The top HUNT.md of :func:`hunt_matrix`: one row per server group × workload."""
    out = ["# repro hunt: workloads × server configurations", "",
           f"- **scenario**: {_md(str(opts.scenario_path))}", f"- **workload file**: {_md(str(ncat.path))}",
           f"- **budget**: {opts.budget_min:g} min; **status**: {status}; wall time {wall_s:.0f} s; "
           f"{len(groups)} server group(s)", f"- **command**: {_md(opts.command_line)}", "",
           "Each workload runs clean first (its own verdict: a deadlock or desync there needs no perturbation and gets a "
           "FINDING-<workload>.md), then under each perturbation of every row it reached.", "",
           "| group | config | flags | workload | clean verdict | requests ok / aborted / failed | admin | log | trials (verdicts) | group wall s | HUNT.md |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, e in enumerate(entries):
        link = f"[HUNT.md]({_rel(Path(e['folder']), folder)}/HUNT.md)" if e.get("folder") else _md(e.get("error") or e.get("why") or "")
        flags = " ".join(e["args"])
        by = {b["workload"]: b for b in e.get("baselines") or []}
        for w in e["workloads"]:
            b = by.get(w, {})
            vc = (e.get("verdicts") or {}).get(w, {})
            tv = ", ".join(f"{k} {n}" for k, n in sorted(vc.items())) or "—"
            out.append(f"| {i + 1} | {e['config']} | `{_md(flags)}` | `{w}` | {b.get('verdict', e['status'])} | "
                       f"{b.get('ok', '')} / {b.get('aborted', '')} / {b.get('failed', '')} | {_md(b.get('admin') or '—')} | "
                       f"{_md(b.get('log') or '—')} | {tv} | {e.get('wall_s', '')} | {link} |")
    if ncat.not_run:
        out += ["", "## Not run on this testbed, and why", ""] + [f"- `{k}`: {_md(v)}" for k, v in ncat.not_run.items()]
    return "\n".join(out) + "\n"
