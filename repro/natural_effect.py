"""What a natural nemesis did to the lockstep state: which probe moved, and where the engine reconciled it.

A natural nemesis (``repro.scenario.NATURE``) perturbs one rank's environment; the engine may absorb it. From the
state digest the harness already records (``repro.state_digest``: every lockstep probe's value at each scheduler
tick's start, per rank) :func:`natural_effect` finds every *episode*: a tick at which a lockstep probe differs
between the ranks, and the first later tick at which it is equal again (``end_tick``; None: still different at the
last tick every rank reached: the first divergent state stands). For a closed episode the reconciling collectives
are read from the target rank's collective ledger: the calls it recorded during tick ``end_tick - 1`` (the tick
whose end made the probe equal again), named by API and call site — from the run's ledger, not from the source.

``local`` probes (per-rank by design) are never compared; the ones that changed on the target rank are listed.
Nothing here changes a verdict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from repro.state_digest import read_rank_states

MAX_COLLECTIVES = 4  # call sites named per reconciling tick


@dataclass(frozen=True)
class Episode:
    """One lockstep probe different between the ranks from ``start_tick`` until ``end_tick`` (None: never equal
    again within the compared ticks); ``values``: rank → value at ``start_tick``; ``collectives``: the target
    rank's collectives of tick ``end_tick - 1`` (``op api @ call site``)."""

    probe: str
    start_tick: int
    values: dict
    end_tick: Optional[int] = None
    collectives: tuple[str, ...] = ()


@dataclass(frozen=True)
class NaturalEffect:
    """``status``: ``reconciled`` (every episode closed), ``diverged`` (one is open at the end), ``none moved``, or
    ``not recorded`` (no digest); ``summary``: one line for a hunt row."""

    status: str
    summary: str
    episodes: tuple[Episode, ...] = ()
    local_moved: tuple[str, ...] = ()
    compared: Optional[tuple[int, int]] = None

    def to_dict(self) -> dict:
        return {"status": self.status, "summary": self.summary, "compared": list(self.compared) if self.compared else None,
                "local_moved": list(self.local_moved),
                "episodes": [{"probe": e.probe, "start_tick": e.start_tick, "end_tick": e.end_tick,
                              "values": {str(k): v for k, v in e.values.items()}, "collectives": list(e.collectives)}
                             for e in self.episodes]}


def _collectives_at(ledger: Any, tick: int) -> tuple[str, ...]:
    out: list[str] = []
    for r in getattr(ledger, "records", []) or []:
        if r.tick == tick:
            name = f"{r.op} {r.call_site()}"
            if name not in out:
                out.append(name)
    return tuple(out[:MAX_COLLECTIVES])


def _tick_at(ledger: Any, since_time: float) -> Optional[int]:
    """The tick of the target rank's first collective entered at or after ``since_time`` (epoch seconds)."""
    ticks = [r.tick for r in getattr(ledger, "records", []) or [] if r.t_enter >= since_time]
    return min(ticks) if ticks else None


def natural_effect(ledgers: Mapping[int, Any], target_rank: int, kinds: Optional[Mapping[str, str]] = None,
                   since_time: Optional[float] = None) -> NaturalEffect:
    """The episodes of lockstep-probe difference in one TP group's run (module docstring).

    Args:
        ledgers: rank → ``repro.ledger.RankLedger`` (their state lines and collective records).
        target_rank: the rank the nemesis fired on (its ledger names the reconciling collectives).
        kinds: probe → ``lockstep`` / ``local`` / ``info`` beside what the ledgers' full digests say.
        since_time: epoch seconds of the nemesis's fire: only ticks from the target rank's first collective after
            it are looked at (a shared server's ledgers hold earlier trials); None: every tick.
    """
    states = read_rank_states(ledgers)
    kinds = {**{k: v for s in states.values() for k, v in s.kinds.items()}, **dict(kinds or {})}
    recorded = {r: s for r, s in states.items() if s.first_full() is not None}
    if len(recorded) < 2 or len(recorded) < len(states):
        return NaturalEffect("not recorded", "no state digest on every rank (nothing to compare)")
    names: set[str] = set()
    for s in recorded.values():
        for _, _, v in s.lines:
            names.update(v)
    skipped = {p for s in recorded.values() for p in s.errors}
    compared = sorted(n for n in names if kinds.get(n, "lockstep") == "lockstep" and n not in skipped)
    local = sorted(n for n in names if kinds.get(n) == "local")
    start = max(s.first_full() or 0 for s in recorded.values())
    end = min(s.last_tick for s in recorded.values())
    if since_time is not None:
        since = _tick_at(ledgers.get(target_rank), since_time)
        start = max(start, since if since is not None else end)
    ticks = sorted({t for s in recorded.values() for t, _, _ in s.lines if start <= t <= end} | {start})
    ranks = sorted(recorded)
    open_: dict[str, Episode] = {}
    done: list[Episode] = []
    for t in ticks:
        vals = {r: recorded[r].values_at(t) or {} for r in ranks}
        for p in compared:
            differs = len({json.dumps(vals[r].get(p), sort_keys=True) for r in ranks}) > 1
            if differs and p not in open_:
                open_[p] = Episode(p, t, {r: vals[r].get(p) for r in ranks})
            elif not differs and p in open_:
                e = open_.pop(p)
                done.append(Episode(e.probe, e.start_tick, e.values, t, _collectives_at(ledgers.get(target_rank), t - 1)))
    episodes = tuple(sorted(done + list(open_.values()), key=lambda e: (e.start_tick, e.probe)))
    tr = recorded.get(target_rank)
    moved_local: list[str] = []
    if tr is not None:
        first = tr.values_at(start) or {}
        last = tr.values_at(end) or {}
        moved_local = [p for p in local if json.dumps(first.get(p), sort_keys=True) != json.dumps(last.get(p), sort_keys=True)]
    if not episodes:
        local_txt = (f"; local probes that changed on rank {target_rank}: {', '.join(moved_local)}" if moved_local else "")
        return NaturalEffect("none moved", f"none moved: {len(compared)} lockstep probes equal at every tick {start}–{end}"
                             + local_txt, (), tuple(moved_local), (start, end))
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
    return NaturalEffect(status, "; ".join(parts), episodes, tuple(moved_local), (start, end))


__all__ = ["Episode", "NaturalEffect", "natural_effect"]
