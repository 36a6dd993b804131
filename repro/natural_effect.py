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

A third kind of evidence needs no probe: a reduction's per-rank *inputs*. A nemesis that changes an answer the
engine reduces at once (a completion poll answering not-done, a storage query missing, a read failing) leaves no
per-rank state at a tick's start; the ledger records the values a small CPU tensor carries into and out of an
``all_reduce`` (injectors/repro_injector/_ledger_args.py). With ``since_time``, :func:`reduction_inputs` finds the
first all_reduce after the fire (on the fire's thread first) whose inputs differed between the ranks: "rank 1 put
0, rank 0 put 3, every rank got 0, at tick T" (status ``input reconciled``; ``input open`` when a rank got no answer),
with how often that call site's inputs differed before the fire (background threads make some differ on an
unperturbed server too). It decides the status only when no lockstep or attributed transient episode did.

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
STATUSES = ("diverged", "reconciled", "transient reconciled", "transient open", "input reconciled", "input open",
            "none moved", "not recorded")
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
class InputEpisode:
    """One all_reduce whose per-rank inputs differed (the ledger's ``in`` values), paired across the ranks by group
    and sequence number. ``inputs`` / ``outputs``: rank → the values put in / got back (an output None: that rank's
    call did not return, or its values were not recorded); ``collective``: ``op RED @ 3-frame call site [thread]``;
    ``before``: at the same call site on the target rank before the fire, (calls whose inputs differed, calls
    compared)."""

    tick: int
    group: str
    seq: int
    collective: str
    inputs: dict
    outputs: dict
    before: tuple[int, int] = (0, 0)
    thread: str = ""  # the fire's thread when the reduction ran on it ("": another thread, the fire's did none)

    @property
    def reconciled(self) -> bool:
        """Every rank got an answer and the answers are equal."""
        outs = list(self.outputs.values())
        return all(o is not None for o in outs) and all(_same(outs[0], o, 0.0) for o in outs[1:])

    def describe(self) -> str:
        """``all_reduce MIN @ … at tick T (seq S): rank 1 put 0, rank 0 put 4; every rank got 0 (before the fire: 0
        of 12 calls at this call site had different inputs)``."""
        put = ", ".join(f"rank {r} put {_show(v)}" for r, v in self.inputs.items())
        if self.reconciled:
            got = f"every rank got {_show(next(iter(self.outputs.values())))}"
        else:
            got = "; ".join(f"rank {r} got {'no answer' if o is None else _show(o)}" for r, o in self.outputs.items())
        n, of = self.before
        where = "on the fire's thread" if self.thread else "on another thread (the fire's did no reduction)"
        at = self.elements()
        return (f"{self.collective} at tick {self.tick} (seq {self.seq}), {where}: {put}"
                + (f" (different at element{'s' * (len(at) > 1)} {', '.join(map(str, at))})" if at else "")
                + f"; {got} (before the fire: {n} of {of} calls at this call site had different inputs)")

    def elements(self) -> tuple[int, ...]:
        """Where the inputs differ when they are equally long lists (0-based indices); () otherwise."""
        vals = list(self.inputs.values())
        if not all(isinstance(v, list) for v in vals) or len({len(v) for v in vals}) != 1:
            return ()
        return tuple(i for i in range(len(vals[0])) if len({json.dumps(v[i]) for v in vals}) > 1)


@dataclass(frozen=True)
class NaturalEffect:
    """``status``: one of :data:`STATUSES` (module docstring): ``diverged`` / ``reconciled`` from lockstep probes,
    else ``transient reconciled`` / ``transient open``, else ``input reconciled`` / ``input open`` (a reduction's
    per-rank inputs, :func:`reduction_inputs`), else ``none moved``; ``not recorded``: no digest.
    ``summary``: one line for a hunt row; ``transient``: the transient probes' episodes."""

    status: str
    summary: str
    episodes: tuple[Episode, ...] = ()
    local_moved: tuple[str, ...] = ()
    compared: Optional[tuple[int, int]] = None
    transient: tuple[Episode, ...] = ()
    later: int = 0  # transient episodes not attributed: jitter-short, or started more than attribute_s after the fire
    held: tuple[str, ...] = ()  # where the other ranks waited for the perturbed one (reductions ≥ HELD_S after the fire)
    inputs: Optional[InputEpisode] = None  # the first reduction after the fire whose per-rank inputs differed

    def to_dict(self) -> dict:
        i = self.inputs
        return {"status": self.status, "summary": self.summary, "compared": list(self.compared) if self.compared else None,
                "later": self.later, "held": list(self.held),
                "inputs": None if i is None else {"tick": i.tick, "group": i.group, "seq": i.seq,
                                                  "collective": i.collective, "before": list(i.before),
                                                  "inputs": {str(k): v for k, v in i.inputs.items()},
                                                  "outputs": {str(k): v for k, v in i.outputs.items()}},
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
        name = _chain(r)
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


def _chain(r: Any) -> str:
    """``op RED @ 3-frame call site chain [thread]`` of a ledger record (the thread left out for MainThread)."""
    thread = f" [{r.thread}]" if getattr(r, "thread", "") and r.thread != "MainThread" else ""
    red = f" {r.red}" if r.red else ""
    return f"{r.op}{red} @ {r.call_site(3)}{thread}"


def reduction_inputs(ledgers: Mapping[int, Any], target_rank: int, since_time: float, window_s: float = ATTRIBUTE_S,
                     thread: str = "") -> Optional[InputEpisode]:
    """The first all_reduce the target rank entered within ``window_s`` seconds after ``since_time`` (epoch seconds)
    whose recorded inputs differed between the ranks, paired with the other ranks' records of the same group and
    sequence number. When ``thread`` (the fire's thread) did reductions with values in that window, only those are
    looked at (the fired call's answer goes into its own thread's next reduction: one of them differing elsewhere is
    not attributed); else the first on any thread. None when none differed (or the ledgers hold no values: a
    ledger written before values were recorded, device or float tensors only).
    ``before`` counts the target rank's calls at the same call site (3 frames, reduce op and shapes: the same
    reduction) before ``since_time``."""
    target = ledgers.get(target_rank)
    if target is None:
        return None
    peers = {r: {(x.group, x.seq): x for x in getattr(led, "records", []) or [] if x.vin is not None}
             for r, led in ledgers.items() if r != target_rank}
    if not peers:
        return None
    before: dict[tuple, list[int]] = {}
    found: list[tuple[Any, dict]] = []
    on_thread = 0  # reductions with values on the fire's thread in the window
    for rec in getattr(target, "records", []) or []:
        if rec.op != "all_reduce" or rec.vin is None or rec.t_enter > since_time + window_s:
            continue
        others = {r: m.get((rec.group, rec.seq)) for r, m in peers.items()}
        if any(o is None for o in others.values()):
            continue  # not recorded on every rank (rotated out, or a rank never reached it)
        differs = any(not _same(o.vin, rec.vin, 0.0) for o in others.values())
        if rec.t_enter < since_time:
            b = before.setdefault((rec.site[:3], rec.red, rec.shapes), [0, 0])
            b[0] += differs
            b[1] += 1
            continue
        on_thread += bool(thread) and rec.thread == thread
        if differs:
            found.append((rec, others))
    if on_thread:
        found = [(r, o) for r, o in found if r.thread == thread]
    if not found:
        return None
    rec, others = found[0]
    ranks = {target_rank: rec, **others}
    b = before.get((rec.site[:3], rec.red, rec.shapes), [0, 0])
    return InputEpisode(rec.tick, rec.group, rec.seq, _chain(rec), {r: x.vin for r, x in sorted(ranks.items())},
                        {r: (x.vout if x.t_exit is not None else None) for r, x in sorted(ranks.items())}, (b[0], b[1]),
                        thread if on_thread else "")


def _valued(ledgers: Mapping[int, Any]) -> bool:
    """Some record holds a reduction's input values (a ledger written before they were recorded holds none)."""
    return any(r.vin is not None for led in ledgers.values() for r in getattr(led, "records", []) or [])


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
                   since_time: Optional[float] = None, attribute_s: float = ATTRIBUTE_S, thread: str = "") -> NaturalEffect:
    """The episodes of probe difference in one TP group's run: lockstep and transient (module docstring).

    Args:
        ledgers: rank → ``repro.ledger.RankLedger`` (their state lines and collective records).
        target_rank: the rank the nemesis fired on (its ledger names the reconciling collectives).
        kinds: probe → ``lockstep`` / ``transient`` / ``local`` / ``info`` beside what the ledgers' full digests say.
        since_time: epoch seconds of the nemesis's fire: only ticks from the target rank's first collective after
            it are looked at (a shared server's ledgers hold earlier trials); None: every tick.
        attribute_s: with ``since_time``, transient episodes starting later than this many seconds after it (the
            tick of the target rank's first collective past it) are not attributed (nor ones ≤ ``JITTER_TICKS``);
            :func:`reduction_inputs` looks this far after it.
        thread: the name of the thread the nemesis fired on (its reductions are looked at first).
    Returns:
        A :class:`NaturalEffect`; never raises on a run without digests (status ``not recorded``, unless a
        reduction's inputs differed: ``input reconciled`` / ``input open``).
    """
    inputs = reduction_inputs(ledgers, target_rank, since_time, attribute_s, thread) if since_time is not None else None
    input_txt = f"; inputs: {inputs.describe()}" if inputs is not None else ""
    input_status = None if inputs is None else ("input reconciled" if inputs.reconciled else "input open")
    states = read_rank_states(ledgers)
    kinds = {**{k: v for s in states.values() for k, v in s.kinds.items()}, **dict(kinds or {})}
    tols = {k: float(v) for s in states.values() for k, v in s.tols.items()}
    recorded = {r: s for r, s in states.items() if s.first_full() is not None}
    if len(recorded) < 2 or len(recorded) < len(states):
        if inputs is not None:
            return NaturalEffect(input_status or "", f"no state digest on every rank; the first reduction after the fire "
                                 f"with different inputs: {inputs.describe()}", inputs=inputs)
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
                                 + trans_txt + input_txt + later_txt + local_txt, (), tuple(moved_local), (start, end),
                                 trans, len(later), held, inputs)
        if inputs is not None:
            return NaturalEffect(input_status or "", f"no probe moved ({len(compared)} lockstep probes equal at every tick "
                                 f"{start}–{end}); the first reduction after the fire with different inputs: "
                                 f"{inputs.describe()}" + later_txt + local_txt, (), tuple(moved_local), (start, end), (),
                                 len(later), held, inputs)
        return NaturalEffect("none moved", f"none moved: {len(compared)} lockstep probes equal at every tick {start}–{end}"
                             + (f", {len(transient)} transient probes: no episode beyond jitter" if transient else "")
                             + ", no reduction with different inputs after the fire" * (since_time is not None and _valued(ledgers))
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
    # a lockstep episode is the answer: the inputs stay in the record (to_dict), not in the sentence
    return NaturalEffect(status, "; ".join(parts) + (f"; transient: {trans_txt}" if trans else "") + later_txt,
                         episodes, tuple(moved_local), (start, end), trans, len(later), held, inputs)


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
    if isinstance(v, list) and len(v) > 8:  # a reduced vector (the hit query's 24 ints): runs of 3+ as "v ×n"
        out: list[str] = []
        i = 0
        while i < len(v):
            j = i
            while j < len(v) and v[j] == v[i]:
                j += 1
            out += [f"{_show(v[i])} ×{j - i}"] if j - i >= 3 else [_show(x) for x in v[i:j]]
            i = j
        return "[" + ", ".join(out) + "]"
    return "absent" if v is None else str(v)


__all__ = ["Episode", "InputEpisode", "NaturalEffect", "STATUSES", "natural_effect", "reduction_inputs"]
