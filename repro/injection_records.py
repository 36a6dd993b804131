"""Typed reader of what the injector wrote (``injectors/repro_injector/_runtime.py`` documents the format).

``read_injector_dir(path)`` reads every ``loaded-<pid>.json`` and ``fires-<pid>.jsonl`` in an injector folder into
an :class:`InjectorReport`: one :class:`LoadedMarker` per process and, per (pid, rank, injection), the final
counts after that process's latest arming. The verdict asks it: which ranks loaded the injector, which saw the arm
file, was a site entered on every rank, where did it fire. Works the same on a live run and on copied files; a
truncated last line (a process killed mid-write) is skipped, not fatal.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Union

from repro.evidence import Layout


class InjectorRecordsError(ValueError):
    """The injector folder does not exist (the message names it)."""


@dataclass(frozen=True)
class SiteRecord:
    """How one injection's site resolved in one process."""

    injection_id: str
    resolved: Optional[str]
    patched: bool
    error: Optional[str]
    alternatives_tried: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class LoadedMarker:
    """One process where the injector was loaded (``loaded-<pid>.json``).

    ``rank`` is the global rank the injector saw via torch.distributed, else the ``TP<k>`` of an sglang scheduler
    process title, else None. ``create_time`` is epoch seconds comparable with ``psutil.Process.create_time()``.
    """

    pid: int
    create_time: Optional[float]
    start_ticks: Optional[int]
    argv: tuple[str, ...]
    proctitle: str
    rank: Optional[int]
    sites: Mapping[str, SiteRecord]
    python: Optional[str]
    torch: Optional[str]
    engine: Optional[str]
    engine_version: Optional[str]
    time: Optional[float]
    path: Path
    other_versions: Mapping[str, str] = field(default_factory=dict)

    def version_of(self, distribution: str) -> Optional[str]:
        """The engine's version this process saw: ``engine_version``, else (a marker an older injector wrote) the
        value under the engine's distribution name (``ref_location.version_key``)."""
        return self.engine_version or self.other_versions.get(distribution)


@dataclass(frozen=True)
class SiteCounts:
    """Counts of one injection in one process after that process's latest arming (``arm_seq``)."""

    pid: int
    rank: Optional[int]
    injection_id: str
    arm_seq: int
    entered: int
    matched: int
    fired: int
    first_entered: Optional[float] = None
    last_entered: Optional[float] = None
    first_fired: Optional[float] = None
    last_fired: Optional[float] = None
    entered_before_poll: int = 0  # of ``entered``: calls after the arm file was written, before this rank noticed it


@dataclass(frozen=True)
class FireEvent:
    """One ``fire`` line: an action ran (written before the action, so it is on disk even if the action hangs)."""

    pid: int
    rank: Optional[int]
    injection_id: str
    arm_seq: int
    time: float
    n: int
    caller: str
    stack: tuple[str, ...]
    action: Mapping[str, Any]
    completed: Optional[bool] = None  # a matching ``fire_done`` line was seen (None: action still running / hung)
    nature: str = ""  # natural / forced / observe / control (the injector's label; "" in logs older than it)
    thread: str = ""  # the name of the thread the action ran on
    effects: tuple[Mapping[str, Any], ...] = ()  # the natural action's own events for this id (NATURAL_EFFECT_EVENTS)


@dataclass(frozen=True)
class ProcessLog:
    """What one ``fires-<pid>.jsonl`` says about the latest arming."""

    pid: int
    rank: Optional[int]
    arm_seq: int
    armed_ids: tuple[str, ...]
    disarmed: bool
    counts: Mapping[str, SiteCounts]
    fires: tuple[FireEvent, ...]
    errors: tuple[str, ...]
    seen: tuple[Mapping[str, Any], ...] = ()  # every ``seen`` event of the file (observe-only probes), any arming


@dataclass(frozen=True)
class InjectorReport:
    """Everything in one injector folder. ``markers`` and ``logs`` are keyed by nothing: lists in pid order."""

    path: Path
    markers: tuple[LoadedMarker, ...]
    logs: tuple[ProcessLog, ...]
    errors_log: str = ""
    _rank_of_pid: Mapping[int, int] = field(default_factory=dict, repr=False)

    def rank_of(self, pid: int) -> Optional[int]:
        """Rank of a process from its marker or fire log; None if unknown (e.g. detokenizer, HTTP server)."""
        return self._rank_of_pid.get(pid)

    def ranks_loaded(self, expected_ranks: Iterable[int]) -> list[int]:
        """The expected ranks that have a loaded marker (sorted)."""
        have = {m.rank for m in self.markers if m.rank is not None}
        return sorted(r for r in expected_ranks if r in have)

    def ranks_armed(self, expected_ranks: Optional[Iterable[int]] = None) -> list[int]:
        """Ranks whose injector saw a non-empty arm file (their latest arming); restricted to ``expected_ranks``."""
        have = {self.rank_of(lg.pid) for lg in self.logs if lg.arm_seq > 0}
        have.discard(None)
        if expected_ranks is None:
            return sorted(have)  # type: ignore[arg-type]
        return sorted(r for r in expected_ranks if r in have)

    def counts_by_rank(self, injection_id: str) -> dict[str, dict[int, int]]:
        """``{"entered": {rank: n}, "matched": {...}, "fired": {...}}`` after each rank's latest arming."""
        out: dict[str, dict[int, int]] = {"entered": {}, "matched": {}, "fired": {}}
        for lg in self.logs:
            rank = self.rank_of(lg.pid)
            c = lg.counts.get(injection_id)
            if rank is None or c is None:
                continue
            for key in out:
                out[key][rank] = out[key].get(rank, 0) + getattr(c, key)
        return out

    def entered_on_all(self, injection_id: str, ranks: Iterable[int]) -> bool:
        """Was the site entered at least once on every one of ``ranks`` since their latest arming?"""
        entered = self.counts_by_rank(injection_id)["entered"]
        return all(entered.get(r, 0) > 0 for r in ranks)

    def fired_ranks(self, injection_id: str) -> list[int]:
        """Ranks on which the injection fired since their latest arming (sorted)."""
        return sorted(r for r, n in self.counts_by_rank(injection_id)["fired"].items() if n > 0)

    def matched_total(self, injection_id: str) -> int:
        """Gate matches summed over all processes since their latest arming."""
        return sum(self.counts_by_rank(injection_id)["matched"].values()) + sum(
            lg.counts[injection_id].matched for lg in self.logs if self.rank_of(lg.pid) is None and injection_id in lg.counts
        )

    def fires(self, injection_id: Optional[str] = None) -> list[FireEvent]:
        """Fire events of the latest arming, in time order."""
        evs = [f for lg in self.logs for f in lg.fires if injection_id is None or f.injection_id == injection_id]
        return sorted(evs, key=lambda f: f.time)

    def resolved_site(self, injection_id: str) -> Optional[str]:
        """The site alternatives patched for this injection, in the scenario's order, joined by `` + `` (the injector
        patches every alternative that resolves), else None."""
        found: list[str] = []
        for m in self.markers:
            s = m.sites.get(injection_id)
            if s is None or not s.patched:
                continue
            for t in s.alternatives_tried or ():
                if t.get("status") == "patched" and t.get("site") and t["site"] not in found:
                    found.append(str(t["site"]))
            if s.resolved and s.resolved not in found:
                found.append(s.resolved)
        if not found:
            return None
        order = {str(t.get("site")): i for m in self.markers for s in [m.sites.get(injection_id)] if s is not None
                 for i, t in enumerate(s.alternatives_tried or ())}
        return " + ".join(sorted(found, key=lambda x: order.get(x, len(order))))

    def absent_detail(self, injection_id: str) -> Optional[str]:
        """When no process patched the injection and some process recorded its alternatives as ``absent`` (module
        imported, name missing): one line naming each such alternative and why (``has no attribute 'Schedular'``);
        else None (patched somewhere, or never looked up yet)."""
        if self.resolved_site(injection_id) is not None:
            return None
        why: dict[str, str] = {}
        for m in self.markers:
            s = m.sites.get(injection_id)
            for t in (s.alternatives_tried if s is not None else ()):
                if t.get("status") in ("absent", "error") and t.get("site"):
                    why.setdefault(str(t["site"]), str(t.get("error") or t.get("status")))
        return "; ".join(f"{k}: {v}" for k, v in why.items()) or None

    def errors(self) -> list[str]:
        """Error lines from the fire logs (``errors.log`` keeps tracebacks)."""
        return [e for lg in self.logs for e in lg.errors]

    def seen(self) -> list[dict]:
        """Every ``seen`` event (observe-only probes: ``id``, ``caller``, ``stack``, ``loops``) of every process, in
        file order per pid, each with ``rank`` filled in from the process's marker when the line had none."""
        out = []
        for lg in self.logs:
            for e in lg.seen:
                e = dict(e)
                if e.get("rank") is None:  # the line's pid, else the file's (fires-<pid>.jsonl)
                    e["rank"] = self.rank_of(int(e.get("pid") or lg.pid))
                out.append(e)
        return out


def _rank_from_title(title: str) -> Optional[int]:
    """TP rank from a rank process's title, read by the engine adapters (``repro.targets.registry``)."""
    from repro.targets.registry import rank_title_any

    t = rank_title_any(title or "")
    return None if t is None else t.tp


_MARKER_TEXT_FIELDS = frozenset({"proctitle", "python", "torch", "engine", "engine_version", "scenario", "variant", "plan"})


def _read_marker(path: Path) -> Optional[LoadedMarker]:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    sites = {
        k: SiteRecord(k, v.get("resolved"), bool(v.get("patched")), v.get("error"), tuple(v.get("alternatives_tried") or ()))
        for k, v in (d.get("sites") or {}).items()
    }
    rank = d.get("rank")
    if rank is None:
        rank = _rank_from_title(d.get("proctitle", ""))
    return LoadedMarker(
        pid=int(d["pid"]), create_time=d.get("create_time"), start_ticks=d.get("start_ticks"), argv=tuple(d.get("argv") or ()),
        proctitle=d.get("proctitle") or "", rank=rank, sites=sites, python=d.get("python"), torch=d.get("torch"),
        engine=d.get("engine"), engine_version=d.get("engine_version"), time=d.get("time"), path=path,
        other_versions={k: v for k, v in d.items() if isinstance(v, str) and k not in _MARKER_TEXT_FIELDS},
    )


def read_fire_log(path: Union[str, Path], offset: int = 0, tail: bool = True) -> tuple[list[dict], int]:
    """The one reader of a ``fires-<pid>.jsonl`` (the injector's fire log): its events from byte ``offset`` on.

    With ``tail`` (following a live file), only complete lines are read: a last line without its newline (the
    injector is writing it) is left for the next call. Without it (reading a finished file), a last line without
    newline counts when it is whole JSON, and is skipped when torn (a process killed mid-write). A line that is not
    JSON is skipped (the injector writes whole lines; only a killed writer leaves a torn one).

    Args:
        path: the fire log; offset: byte offset to start at (0: the whole file; a tail-follower passes the offset
            this function returned last time); tail: see above.
    Returns:
        ``(events, next_offset)``: the JSON objects in file order and the offset after the last complete line
        (``offset`` unchanged when the file is missing or has no new complete line).
    """
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except OSError:
        return [], offset
    end = data.rfind(b"\n") + 1 if tail else len(data)
    events: list[dict] = []
    for line in data[:end].split(b"\n"):
        if not line.strip():
            continue
        try:
            e = json.loads(line.decode("utf-8", errors="replace"))
        except ValueError:
            continue
        if isinstance(e, dict):
            events.append(e)
    return events, offset + end


# what a natural action's fire was followed by (injectors/repro_injector/_natural.py writes them)
NATURAL_EFFECT_EVENTS = ("clock_shifted", "stopped", "stop_helper_exit", "fault_outcome", "pending_done", "held_done", "missed",
                         "failed")


def fault_outcomes(fires: Iterable[FireEvent]) -> list[str]:
    """``"fault on thread T: <outcome>"`` for each ``fault_outcome`` event of ``fires`` (the injector writes one
    ``observe_s`` after a ``fault`` nemesis raised, injectors/repro_injector/_natural.py: the thread died, caught it
    and called the site again, or neither), without repeats, in order; [] when none. REPORT.md's injections
    section and a hunt row's effect (``repro.hunt.loop.fault_fates``) both say it."""
    out: list[str] = []
    for f in fires:
        for e in f.effects:
            if e.get("event") == "fault_outcome":
                out.append(f"fault on thread {e.get('thread') or f.thread or '?'}: {e.get('outcome') or 'outcome unknown'}")
    return list(dict.fromkeys(out))


def _read_log(path: Path, pid: int) -> ProcessLog:
    events, _ = read_fire_log(path, tail=False)
    rank: Optional[int] = None
    arm_seq = 0
    armed_ids: tuple[str, ...] = ()
    disarmed = False
    counts: dict[str, SiteCounts] = {}
    fires: list[dict] = []
    done: dict[str, bool] = {}
    errors: list[str] = []
    seen: list[dict] = []
    effects: dict[str, list] = {}
    for e in events:
        if e.get("rank") is not None:
            rank = e["rank"]
        kind = e.get("event")
        if kind == "armed":
            arm_seq = int(e.get("arm_seq", arm_seq + 1))
            armed_ids = tuple(e.get("ids") or ())
            disarmed = False
            counts, fires, done, effects = {}, [], {}, {}  # a natural action's events belong to its arming
        elif kind == "disarmed":
            disarmed = True
        elif kind == "counts" and int(e.get("arm_seq", -1)) == arm_seq and arm_seq > 0:
            for iid, c in (e.get("counts") or {}).items():
                counts[iid] = SiteCounts(pid, e.get("rank"), iid, arm_seq, int(c.get("entered", 0)), int(c.get("matched", 0)),
                                         int(c.get("fired", 0)), c.get("first_entered"), c.get("last_entered"),
                                         c.get("first_fired"), c.get("last_fired"), int(c.get("entered_before_poll") or 0))
        elif kind == "fire" and int(e.get("arm_seq", -1)) == arm_seq:
            fires.append(e)
        elif kind == "fire_inapplicable" and e.get("n") is not None:  # a fire the action took back (miss: nothing found)
            fires = [f for f in fires if not (f.get("id") == e.get("id") and int(f.get("n", 0)) == int(e["n"]))]
        elif kind == "fire_done":
            done[e.get("id")] = e.get("error") is None
        elif kind == "error":
            errors.append(str(e.get("message")))
        elif kind == "seen":
            seen.append(e)
        elif kind in NATURAL_EFFECT_EVENTS:
            effects.setdefault(str(e.get("id")), []).append(e)
    fire_events = tuple(
        FireEvent(pid, f.get("rank"), f.get("id", ""), arm_seq, float(f.get("time", 0)), int(f.get("n", 0)), f.get("caller") or "",
                  tuple(f.get("stack") or ()), f.get("action") or {}, done.get(f.get("id")), str(f.get("nature") or ""),
                  str(f.get("thread") or ""), tuple(effects.get(str(f.get("id")), ())))
        for f in fires
    )
    return ProcessLog(pid, rank, arm_seq, armed_ids, disarmed, counts, fire_events, tuple(errors), tuple(seen))


def read_injector_dir(path: Union[str, Path]) -> InjectorReport:
    """Read an injector folder (``<evidence>/injector/``).

    Raises:
        InjectorRecordsError: ``path`` is not a directory.
    """
    p = Path(path)
    if not p.is_dir():
        raise InjectorRecordsError(f"{p}: injector folder not found (expected the plan's out_dir with "
                                   f"{Layout.loaded_marker('<pid>')} files)")
    markers = []
    for f in sorted(p.glob(Layout.LOADED_GLOB)):
        m = _read_marker(f)
        if m is not None:
            markers.append(m)
    logs = []
    for f in sorted(p.glob(Layout.FIRES_GLOB)):
        pid = Layout.pid_of(f.name)
        if pid is None:
            continue
        logs.append(_read_log(f, pid))
    rank_of: dict[int, int] = {}
    for m in markers:
        if m.rank is not None:
            rank_of[m.pid] = m.rank
    for lg in logs:
        if lg.pid not in rank_of and lg.rank is not None:
            rank_of[lg.pid] = lg.rank
    # a marker written before torch.distributed was up has no rank: take it from that process's fire log
    from dataclasses import replace

    markers = [replace(m, rank=rank_of[m.pid]) if m.rank is None and m.pid in rank_of else m for m in markers]
    err = p / Layout.INJECTOR_ERRORS
    errors_log = err.read_text(encoding="utf-8", errors="replace") if err.is_file() else ""
    markers.sort(key=lambda m: m.pid)
    logs.sort(key=lambda lg: lg.pid)
    return InjectorReport(p, tuple(markers), tuple(logs), errors_log, rank_of)
