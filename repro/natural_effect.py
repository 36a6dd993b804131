"""What a natural nemesis did to the engine's state: which probe moved, and where the engine reconciled it.

A natural nemesis (``repro.scenario.NATURE``) perturbs one rank's environment; the engine may absorb it. From the
state digest the harness already records (``repro.state_digest``: every probe's value at each scheduler tick's
start, per rank) :func:`natural_effect` finds every *episode*: a tick at which a probe differs between the ranks,
and the first later tick at which it is equal again (``end_tick``; None: still different at the last tick every
rank reached). For a closed episode the reconciling collectives are read from the target rank's collective ledger:
the calls it recorded during tick ``end_tick - 1`` (the tick whose end made the probe equal again), named by API,
reduce op and call site — from the run's ledger, not from the source.

Two kinds of probe are compared (``repro.state_probes``):

- ``lockstep``: an open episode is the *first divergent state* (status ``diverged``); closed ones ``reconciled``.
- ``transient``: a per-rank *input to a reconciliation* (a queue the engine MIN-reduces before draining, a thread's
  progress): it may differ between the ranks until the engine reconciles it. Its episodes say "moved on rank R at
  tick T, equal again at tick N, reconciled in tick N-1 by <collective>" (status ``transient reconciled``); one
  still open at the end (a stopped thread's progress stuck) is reported plainly (``transient open``) and is never a
  first divergent state. Numbers within the probe's ``tolerance`` (the ledger's ``tol``) count as equal. Only when
  no lockstep probe moved does a transient episode decide the status. Background threads make transient probes
  differ for a few ticks on an unperturbed server too: a closed episode of at most ``JITTER_TICKS`` ticks of a probe
  without a tolerance is jitter, and with ``since_time`` only episodes that start within ``attribute_s`` of the fire
  are the nemesis's; the others are counted as jitter, never attributed.

With ``since_time``, ``held`` names where the other ranks waited for the perturbed one: their reductions entered
right after the fire that took ≥ ``HELD_S`` (a whole-rank stop shows only there: no tick starts on any rank while
one rank is stopped, so no probe read at a tick's start can differ).

``local`` probes (per-rank by design) are never compared; the ones that changed on the target rank are listed.
Nothing here changes a verdict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from repro.state_digest import read_rank_states

MAX_COLLECTIVES = 4  # call sites named per reconciling tick
MAX_TRANSIENT_SHOWN = 2  # transient probes described in a summary (the longest episode of each)
TRANSIENT_COLLECTIVES = 2  # collectives named per transient episode (MIN/MAX first), each by 3 frames
STATUSES = ("diverged", "reconciled", "transient reconciled", "transient open", "none moved", "not recorded")
RECONCILING_REDUCE_OPS = ("MIN", "MAX")  # a transient episode's collectives: these first (then the others)
ATTRIBUTE_S = 5.0  # a transient episode that starts within this many seconds of the fire may be the nemesis's (delay
# 2 s, stop 3 s, a pending's polls, a fault's first effect); later ones are not attributed
HELD_S = 1.0  # a reduction a peer waited in this long, right after the fire, is where it waited for the perturbed rank
HELD_SHOWN = 2
JITTER_TICKS = 4  # a closed episode of a count probe (no tolerance) this short is the background threads' timing
# jitter: the unperturbed baseline of the natural HiCache hunt (0.5.23, TP=2, 408 ticks) had 7 transient episodes,
# the longest 4 ticks (ack_backup_queue 4, backup_queue 3, prefetch_queue 2; benchmarks/RESULTS.md, h37a)


@dataclass(frozen=True)
class Episode:
    """One probe different between the ranks from ``start_tick`` until ``end_tick`` (None: never equal again within
    the compared ticks); ``values``: rank → value at ``start_tick``; ``collectives``: the target rank's collectives
    of tick ``end_tick - 1`` (lockstep: ``op call site``; transient: ``op RED @ 3-frame call site chain [thread]``, MIN/MAX
    reductions first)."""

    @property
    def ticks(self) -> int:
        """How many ticks it lasted (to the last compared tick when open: 0 here, see the summary)."""
        return (self.end_tick - self.start_tick) if self.end_tick is not None else 0

    probe: str
    start_tick: int
    values: dict
    end_tick: Optional[int] = None
    collectives: tuple[str, ...] = ()
    kind: str = "lockstep"  # or "transient"
    moved: tuple[int, ...] = ()  # transient: the ranks whose value changed at start_tick (from the tick before)


@dataclass(frozen=True)
class NaturalEffect:
    """``status``: one of :data:`STATUSES` (module docstring): ``diverged`` / ``reconciled`` from lockstep probes,
    else ``transient reconciled`` / ``transient open``, else ``none moved``; ``not recorded``: no digest.
    ``summary``: one line for a hunt row; ``transient``: the transient probes' episodes."""

    status: str
    summary: str
    episodes: tuple[Episode, ...] = ()
    local_moved: tuple[str, ...] = ()
    compared: Optional[tuple[int, int]] = None
    transient: tuple[Episode, ...] = ()
    later: int = 0  # transient episodes not attributed: jitter-short, or started more than attribute_s after the fire
    held: tuple[str, ...] = ()  # where the other ranks waited for the perturbed one (reductions ≥ HELD_S after the fire)

    def to_dict(self) -> dict:
        return {"status": self.status, "summary": self.summary, "compared": list(self.compared) if self.compared else None,
                "later": self.later, "held": list(self.held),
                "local_moved": list(self.local_moved),
                "episodes": [_ep_dict(e) for e in self.episodes], "transient": [_ep_dict(e) for e in self.transient]}


def _ep_dict(e: Episode) -> dict:
    return {"probe": e.probe, "kind": e.kind, "start_tick": e.start_tick, "end_tick": e.end_tick, "moved": list(e.moved),
            "values": {str(k): v for k, v in e.values.items()}, "collectives": list(e.collectives)}


def _collectives_at(ledger: Any, tick: int) -> tuple[str, ...]:
    out: list[str] = []
    for r in getattr(ledger, "records", []) or []:
        if r.tick == tick:
            name = f"{r.op} {r.call_site()}"
            if name not in out:
                out.append(name)
    return tuple(out[:MAX_COLLECTIVES])


def _reconciling_at(ledger: Any, tick: int) -> tuple[str, ...]:
    """The target rank's collectives of ``tick`` for a transient episode: MIN/MAX reductions first (what
    reconciles a per-rank input), then the others; each ``op RED @ 3-frame site chain [thread]``, deduplicated."""
    first: list[str] = []
    rest: list[str] = []
    for r in getattr(ledger, "records", []) or []:
        if r.tick != tick:
            continue
        thread = f" [{r.thread}]" if getattr(r, "thread", "") and r.thread != "MainThread" else ""
        red = f" {r.red}" if r.red else ""
        name = f"{r.op}{red} @ {r.call_site(3)}{thread}"
        bucket = first if r.red in RECONCILING_REDUCE_OPS else rest
        if name not in first and name not in rest:
            bucket.append(name)
    return tuple((first + rest)[:TRANSIENT_COLLECTIVES])


def _held(ledgers: Mapping[int, Any], target_rank: int, since_time: float, window_s: float) -> tuple[str, ...]:
    """Where the other ranks waited for the perturbed one: their reductions entered within ``window_s`` of the fire
    that took at least ``HELD_S`` to complete, longest first (``rank r waited X s in op RED @ site (tick T) [thread]``).
    Broadcasts are left out (an idle rank waits for the next request there)."""
    found: list[tuple[float, str]] = []
    for rank, led in sorted(ledgers.items()):
        if rank == target_rank:
            continue
        for r in getattr(led, "records", []) or []:
            if r.red is None or r.t_exit is None or not (since_time - 1.0 <= r.t_enter <= since_time + window_s):
                continue
            waited = r.t_exit - r.t_enter
            if waited >= HELD_S:
                thread = f" [{r.thread}]" if getattr(r, "thread", "") and r.thread != "MainThread" else ""
                found.append((waited, f"rank {rank} waited {waited:.2f} s in {r.op} {r.red} @ {r.call_site(3)} (tick {r.tick}){thread}"))
    return tuple(t for _, t in sorted(found, key=lambda x: -x[0])[:HELD_SHOWN])


def _tick_at(ledger: Any, since_time: float) -> Optional[int]:
    """The tick of the target rank's first collective entered at or after ``since_time`` (epoch seconds)."""
    ticks = [r.tick for r in getattr(ledger, "records", []) or [] if r.t_enter >= since_time]
    return min(ticks) if ticks else None


def _same(a: Any, b: Any, tol: float) -> bool:
    if tol and isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return abs(a - b) <= tol
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _differs(vals: Mapping[int, Any], tol: float) -> bool:
    vs = list(vals.values())
    return any(not _same(vs[0], v, tol) for v in vs[1:])


def natural_effect(ledgers: Mapping[int, Any], target_rank: int, kinds: Optional[Mapping[str, str]] = None,
                   since_time: Optional[float] = None, attribute_s: float = ATTRIBUTE_S) -> NaturalEffect:
    """The episodes of probe difference in one TP group's run: lockstep and transient (module docstring).

    Args:
        ledgers: rank → ``repro.ledger.RankLedger`` (their state lines and collective records).
        target_rank: the rank the nemesis fired on (its ledger names the reconciling collectives).
        kinds: probe → ``lockstep`` / ``transient`` / ``local`` / ``info`` beside what the ledgers' full digests say.
        since_time: epoch seconds of the nemesis's fire: only ticks from the target rank's first collective after
            it are looked at (a shared server's ledgers hold earlier trials); None: every tick.
        attribute_s: with ``since_time``, transient episodes starting later than this many seconds after it (the
            tick of the target rank's first collective past it) are not attributed (nor ones ≤ ``JITTER_TICKS``).
    Returns:
        A :class:`NaturalEffect`; never raises on a run without digests (status ``not recorded``).
    """
    states = read_rank_states(ledgers)
    kinds = {**{k: v for s in states.values() for k, v in s.kinds.items()}, **dict(kinds or {})}
    tols = {k: float(v) for s in states.values() for k, v in s.tols.items()}
    recorded = {r: s for r, s in states.items() if s.first_full() is not None}
    if len(recorded) < 2 or len(recorded) < len(states):
        return NaturalEffect("not recorded", "no state digest on every rank (nothing to compare)")
    names: set[str] = set()
    for s in recorded.values():
        for _, _, v in s.lines:
            names.update(v)
    skipped = {p for s in recorded.values() for p in s.errors}
    compared = sorted(n for n in names if kinds.get(n, "lockstep") == "lockstep" and n not in skipped)
    transient = sorted(n for n in names if kinds.get(n) == "transient" and n not in skipped)
    local = sorted(n for n in names if kinds.get(n) == "local")
    start = max(s.first_full() or 0 for s in recorded.values())
    end = min(s.last_tick for s in recorded.values())
    if since_time is not None:
        since = _tick_at(ledgers.get(target_rank), since_time)
        start = max(start, since if since is not None else end)
    ticks = sorted({t for s in recorded.values() for t, _, _ in s.lines if start <= t <= end} | {start})
    ranks = sorted(recorded)
    target = ledgers.get(target_rank)
    open_: dict[str, Episode] = {}
    done: list[Episode] = []
    prev: dict[int, dict] = {}
    for t in ticks:
        vals = {r: recorded[r].values_at(t) or {} for r in ranks}
        for p in compared + transient:
            kind = "transient" if p in transient else "lockstep"
            at = {r: vals[r].get(p) for r in ranks}
            differs = _differs(at, tols.get(p, 0.0)) if kind == "transient" else _differs(at, 0.0)
            if differs and p not in open_:
                moved = tuple(r for r in ranks if r in prev and not _same(prev[r].get(p), at[r], tols.get(p, 0.0)))
                open_[p] = Episode(p, t, at, kind=kind, moved=moved)
            elif not differs and p in open_:
                e = open_.pop(p)
                via = (_reconciling_at(target, t - 1) if kind == "transient" else _collectives_at(target, t - 1))
                done.append(Episode(e.probe, e.start_tick, e.values, t, via, kind, e.moved))
        prev = vals
    every = sorted(done + list(open_.values()), key=lambda e: (e.start_tick, e.probe))
    episodes = tuple(e for e in every if e.kind == "lockstep")
    trans = tuple(e for e in every if e.kind == "transient")
    cut = _tick_at(target, since_time + attribute_s) if since_time is not None else None

    def attributed(e: Episode) -> bool:
        if cut is not None and e.start_tick >= cut:
            return False
        return e.end_tick is None or bool(tols.get(e.probe)) or e.end_tick - e.start_tick > JITTER_TICKS

    later = tuple(e for e in trans if not attributed(e))
    trans = tuple(e for e in trans if attributed(e))
    tr = recorded.get(target_rank)
    moved_local: list[str] = []
    if tr is not None:
        first = tr.values_at(start) or {}
        last = tr.values_at(end) or {}
        moved_local = [p for p in local if json.dumps(first.get(p), sort_keys=True) != json.dumps(last.get(p), sort_keys=True)]
    local_txt = f"; local probes that changed on rank {target_rank}: {', '.join(moved_local)}" if moved_local else ""
    trans_txt = _transient_summary(trans, end)
    held = _held(ledgers, target_rank, since_time, attribute_s) if since_time is not None else ()
    held_txt = f"; held: {'; '.join(held)}" if held else ""
    later_txt = held_txt + (f"; {len(later)} transient episode(s) not attributed (≤ {JITTER_TICKS} ticks, or > {attribute_s:g} s "
                 f"after the fire: thread-timing jitter; first at tick {later[0].start_tick})" if later else "")
    if not episodes:
        if trans:
            status = "transient reconciled" if any(e.end_tick is not None for e in trans) else "transient open"
            return NaturalEffect(status, f"no lockstep probe moved ({len(compared)} equal at every tick {start}–{end}); "
                                 + trans_txt + later_txt + local_txt, (), tuple(moved_local), (start, end), trans,
                                 len(later), held)
        return NaturalEffect("none moved", f"none moved: {len(compared)} lockstep probes equal at every tick {start}–{end}"
                             + (f", {len(transient)} transient probes: no episode beyond jitter" if transient else "")
                             + later_txt + local_txt, (), tuple(moved_local), (start, end), (), len(later), held)
    parts = []
    for e in episodes:
        vals = ", ".join(f"rank {r} = {v}" for r, v in e.values.items())
        if e.end_tick is None:
            parts.append(f"`{e.probe}` differs from tick {e.start_tick} ({vals}) to the end: first divergent state")
        else:
            via = "; ".join(e.collectives) or "no collective recorded that tick"
            parts.append(f"`{e.probe}` differed at tick {e.start_tick} ({vals}), equal again at tick {e.end_tick} "
                         f"(reconciled in tick {e.end_tick - 1}: {via})")
    status = "diverged" if any(e.end_tick is None for e in episodes) else "reconciled"
    return NaturalEffect(status, "; ".join(parts) + (f"; transient: {trans_txt}" if trans else "") + later_txt, episodes,
                         tuple(moved_local), (start, end), trans, len(later), held)


def _transient_summary(trans: tuple[Episode, ...], end: int) -> str:
    """Per transient probe (the ``MAX_TRANSIENT_SHOWN`` with the longest episode), its longest closed episode — or
    its open one — in words, with how many episodes it had."""
    by: dict[str, list[Episode]] = {}
    for e in trans:
        by.setdefault(e.probe, []).append(e)

    def length(e: Episode) -> int:
        return (e.end_tick if e.end_tick is not None else end) - e.start_tick

    def key(p: str) -> tuple:
        return (-max(length(e) for e in by[p]), p)

    parts = []
    for p in sorted(by, key=key)[:MAX_TRANSIENT_SHOWN]:
        eps = by[p]
        closed = [e for e in eps if e.end_tick is not None]
        opened = [e for e in eps if e.end_tick is None]
        e = max(closed, key=length) if closed else opened[0]
        vals = ", ".join(f"rank {r} = {_show(v)}" for r, v in e.values.items())
        on = f"moved on rank {', '.join(map(str, e.moved))}" if e.moved else "differed"
        n = f" [{len(eps)} episodes of it]" if len(eps) > 1 else ""
        if e.end_tick is None:
            parts.append(f"transient `{p}` {on} at tick {e.start_tick} ({vals}), still different at the last tick {end}: "
                         f"not reconciled within the run (a stopped thread's progress, or the run ended first){n}")
        else:
            via = "; ".join(e.collectives) or "no collective recorded that tick"
            parts.append(f"transient `{p}` {on} at tick {e.start_tick} ({vals}), equal again at tick {e.end_tick}, "
                         f"reconciled in tick {e.end_tick - 1} by {via}{n}"
                         + (f"; also open at the end from tick {opened[0].start_tick}" if opened else ""))
    more = len(by) - len(parts)
    return "; ".join(parts) + (f"; {more} more transient probe(s) moved" if more > 0 else "")


def _show(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    return "absent" if v is None else str(v)


__all__ = ["Episode", "NaturalEffect", "STATUSES", "natural_effect"]
