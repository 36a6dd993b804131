"""The natural hunt's effect column: a lockstep probe that moved on one rank and was equal again names the tick and
the collectives the target rank's ledger recorded in the tick that reconciled it; one that stays different is the
first divergent state; none moved says so with the ticks compared."""

from __future__ import annotations

import json
from pathlib import Path

from repro.ledger import load_ledgers
from repro.natural_effect import natural_effect


def _ledger(folder: Path, pid: int, rank: int, states: list, enters: int, site_at: dict | None = None) -> None:
    lines = [{"e": "header", "pid": pid, "rank": rank, "part": 0, "dropped": 0, "max_records": 100, "time": 1.0},
             {"e": "group", "g": "1", "name": "1", "ranks": [0, 1], "backend": "gloo", "label": "tp/cpu"}]
    lines += states
    for i in range(1, enters + 1):
        site = (site_at or {}).get(i, ["m:Scheduler.recv_requests"])
        op = "all_reduce" if i in (site_at or {}) else "broadcast"
        lines.append({"e": "enter", "g": "1", "seq": i, "op": op, "api": f"torch.distributed.{op}", "red": None,
                      "shapes": [[1]], "dtypes": ["int64"], "site": site, "tick": i, "t": float(i), "inj": None,
                      "thread": "MainThread"})
        lines.append({"e": "exit", "g": "1", "seq": i, "t": float(i) + 0.1, "err": None})
    (folder / f"ledger-{pid}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


FULL = {"e": "state", "tick": 1, "full": True, "kinds": {"n": "local"}, "v": {"hits": 0, "n": 0}}


def test_moved_then_equal_names_the_reconciling_tick_and_collective(tmp_path: Path):
    hit = ["m:HiCacheController._sync_prefetch_hit_query", "m:HiCacheController.prefetch_thread_func"]
    _ledger(tmp_path, 10, 0, [FULL, {"e": "state", "tick": 3, "v": {"hits": 2, "n": 4}},
                              {"e": "state", "tick": 5, "v": {"hits": 1}}], enters=7, site_at={4: hit})
    _ledger(tmp_path, 11, 1, [FULL, {"e": "state", "tick": 5, "v": {"hits": 1}}], enters=7, site_at={4: hit})
    eff = natural_effect(load_ledgers(tmp_path), target_rank=0)
    assert eff.status == "reconciled"
    (e,) = eff.episodes
    assert (e.probe, e.start_tick, e.end_tick, e.values) == ("hits", 3, 5, {0: 2, 1: 0})
    assert e.collectives == ("all_reduce HiCacheController._sync_prefetch_hit_query ← HiCacheController.prefetch_thread_func",)
    assert eff.local_moved == ("n",)  # the local probe moved on the target rank, never compared
    assert "equal again at tick 5" in eff.summary


def test_a_probe_that_stays_different_is_the_first_divergent_state(tmp_path: Path):
    _ledger(tmp_path, 10, 0, [FULL, {"e": "state", "tick": 4, "v": {"hits": 3}}], enters=6)
    _ledger(tmp_path, 11, 1, [FULL], enters=6)
    eff = natural_effect(load_ledgers(tmp_path), target_rank=0)
    assert eff.status == "diverged" and eff.episodes[0].end_tick is None
    assert "first divergent state" in eff.summary


def test_none_moved_says_which_ticks_were_compared(tmp_path: Path):
    _ledger(tmp_path, 10, 0, [FULL], enters=5)
    _ledger(tmp_path, 11, 1, [FULL], enters=5)
    eff = natural_effect(load_ledgers(tmp_path), target_rank=1)
    assert eff.status == "none moved" and eff.compared == (1, 5) and "none moved" in eff.summary


def test_since_time_skips_the_episodes_of_earlier_trials_on_the_same_server(tmp_path: Path):
    _ledger(tmp_path, 10, 0, [FULL, {"e": "state", "tick": 2, "v": {"hits": 2}}, {"e": "state", "tick": 3, "v": {"hits": 0}}],
            enters=8)
    _ledger(tmp_path, 11, 1, [FULL], enters=8)
    led = load_ledgers(tmp_path)
    assert natural_effect(led, 0).status == "reconciled"
    late = natural_effect(led, 0, since_time=5.0)  # collectives enter at t = tick: tick 5 on
    assert late.status == "none moved" and late.compared == (5, 8)


# ---- a reduction's per-rank inputs (the ledger's "in" / "out" values) ------------------------------------------
HIT = ["m:HiCacheController._sync_prefetch_hit_query", "m:HiCacheController.prefetch_thread_func"]
ACKS = ["m:UnifiedRadixCache._sync_hicache_ready_counts", "m:UnifiedRadixCache.check_hicache_events"]


def _valued(folder: Path, pid: int, rank: int, calls: list) -> None:
    """A ledger of MIN all_reduces: ``calls`` = [(seq, t, site, thread, in, out)]; out ``"open"``: never returned."""
    lines = [{"e": "header", "pid": pid, "rank": rank, "part": 0, "dropped": 0, "max_records": 100, "time": 1.0},
             {"e": "group", "g": "1", "name": "1", "ranks": [0, 1], "backend": "gloo", "label": "tp/cpu"}]
    for seq, t, site, thread, vin, vout in calls:
        lines.append({"e": "enter", "g": "1", "seq": seq, "op": "all_reduce", "api": "torch.distributed.all_reduce",
                      "red": "MIN", "shapes": [[]], "dtypes": ["int32"], "site": site, "tick": seq, "t": t, "inj": None,
                      "thread": thread, "in": vin})
        if vout != "open":
            lines.append({"e": "exit", "g": "1", "seq": seq, "t": t + 0.01, "err": None, "out": vout})
    (folder / f"ledger-{pid}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_the_first_reduction_after_the_fire_with_different_inputs_on_the_fires_thread(tmp_path: Path):
    """A storage miss on rank 1 at t=10 (prefetch thread): the scheduler's ready counts differ first (t=10.5, jitter
    of another thread), the hit query MIN on the fire's thread next: that one is named, with what each rank put and
    got, and how often that call site's inputs differed before the fire."""
    r0 = [(1, 5.0, HIT, "prefetch", 4, 4), (2, 6.0, HIT, "prefetch", 4, 3), (3, 10.5, ACKS, "MainThread", [1, 0], [0, 0]),
          (4, 11.0, HIT, "prefetch", 4, 0), (5, 20.0, HIT, "prefetch", 4, 0)]
    r1 = [(1, 5.0, HIT, "prefetch", 4, 4), (2, 6.0, HIT, "prefetch", 3, 3), (3, 10.5, ACKS, "MainThread", [0, 0], [0, 0]),
          (4, 11.0, HIT, "prefetch", 0, 0), (5, 20.0, HIT, "prefetch", 0, 0)]
    _valued(tmp_path, 10, 0, r0)
    _valued(tmp_path, 11, 1, r1)
    led = load_ledgers(tmp_path)
    eff = natural_effect(led, 1, since_time=10.0, thread="prefetch")
    assert eff.status == "input reconciled" and eff.inputs is not None
    i = eff.inputs
    assert (i.tick, i.seq, i.inputs, i.outputs, i.before) == (4, 4, {0: 4, 1: 0}, {0: 0, 1: 0}, (1, 2))
    assert i.collective.startswith("all_reduce MIN @ HiCacheController._sync_prefetch_hit_query") and "[prefetch]" in i.collective
    assert "rank 0 put 4, rank 1 put 0; every rank got 0" in eff.summary and "1 of 2 calls" in eff.summary
    # with no thread named, the first one after the fire on any thread
    assert natural_effect(led, 1, since_time=10.0).inputs.seq == 3
    # past the attribution window nothing is attributed
    assert natural_effect(led, 1, since_time=14.0, thread="prefetch").inputs is None  # seq 5 is 6 s later


def test_a_rank_that_never_got_the_reductions_answer_is_input_open(tmp_path: Path):
    _valued(tmp_path, 10, 0, [(1, 11.0, HIT, "prefetch", 4, "open")])
    _valued(tmp_path, 11, 1, [(1, 11.0, HIT, "prefetch", 0, 0)])
    eff = natural_effect(load_ledgers(tmp_path), 1, since_time=10.0)
    assert eff.status == "input open" and "rank 0 got no answer" in eff.summary


def test_equal_inputs_or_a_ledger_without_values_leave_none_moved(tmp_path: Path):
    _valued(tmp_path, 10, 0, [(1, 11.0, HIT, "prefetch", 4, 4)])
    _valued(tmp_path, 11, 1, [(1, 11.0, HIT, "prefetch", 4, 4)])
    eff = natural_effect(load_ledgers(tmp_path), 1, since_time=10.0)
    assert eff.status == "not recorded" and eff.inputs is None  # no digest, no differing input: nothing to say
    (tmp_path / "d").mkdir()
    _ledger(tmp_path / "d", 10, 0, [FULL], enters=5)
    _ledger(tmp_path / "d", 11, 1, [FULL], enters=5)
    plain = natural_effect(load_ledgers(tmp_path / "d"), 1, since_time=2.0)
    assert plain.status == "none moved" and "inputs" not in plain.summary  # no values recorded: no claim about them


def test_a_difference_on_another_thread_is_not_attributed_when_the_fires_own_reductions_were_equal(tmp_path: Path):
    """A pending poll on the scheduler thread whose answer changed nothing: its own thread's next reduction had
    equal inputs, so another thread's differing queue count (jitter) is not the nemesis's effect; with a fire on a
    thread that reduces nothing (an io thread), the first differing reduction elsewhere is named as such."""
    r0 = [(1, 10.2, ACKS, "MainThread", [0, 0], [0, 0]), (2, 10.4, HIT, "prefetch", 4, 3)]
    r1 = [(1, 10.2, ACKS, "MainThread", [0, 0], [0, 0]), (2, 10.4, HIT, "prefetch", 3, 3)]
    _valued(tmp_path, 10, 0, r0)
    _valued(tmp_path, 11, 1, r1)
    led = load_ledgers(tmp_path)
    assert natural_effect(led, 1, since_time=10.0, thread="MainThread").inputs is None
    acks = natural_effect(led, 1, since_time=10.0, thread="io_aux", attribute_s=0.3)  # only the ready counts in reach
    assert acks.inputs is None  # they were equal
    (tmp_path / "e").mkdir()
    _valued(tmp_path / "e", 10, 0, [(1, 10.2, ACKS, "MainThread", [1, 0, 2], [0, 0, 1])])
    _valued(tmp_path / "e", 11, 1, [(1, 10.2, ACKS, "MainThread", [0, 0, 1], [0, 0, 1])])
    el = natural_effect(load_ledgers(tmp_path / "e"), 1, since_time=10.0, thread="MainThread")
    assert el.inputs.elements() == (0, 2) and "(different at elements 0, 2)" in el.summary
    other = natural_effect(led, 1, since_time=10.0, thread="io_aux")
    assert other.inputs is not None and other.inputs.seq == 2 and other.inputs.thread == ""
    assert "on another thread (the fire's did no reduction)" in other.summary


def test_a_long_reduced_vector_is_shown_with_its_runs_folded(tmp_path: Path):
    hit = [63, 63] + [-1] * 22  # sglang 0.5.23's hit query: the count and 23 pool verdicts
    _valued(tmp_path, 10, 0, [(1, 11.0, HIT, "prefetch", hit, [0, 0] + [-1] * 22)])
    _valued(tmp_path, 11, 1, [(1, 11.0, HIT, "prefetch", [0, 0] + [-1] * 22, [0, 0] + [-1] * 22)])
    eff = natural_effect(load_ledgers(tmp_path), 1, since_time=10.0, thread="prefetch")
    assert "rank 0 put [63, 63, -1 ×22], rank 1 put [0, 0, -1 ×22] (different at elements 0, 1)" in eff.summary
    assert "every rank got [0, 0, -1 ×22]" in eff.summary
