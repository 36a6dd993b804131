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
