"""Transient probes (issue 35's "moved and reconciled at tick N"): per-rank inputs to a reconciliation are recorded
by the injector's digest (``sum(d.values()[*].x)``, ``len(q.queue)``, a tolerance carried in the ledger), read by
``repro.natural_effect`` as episodes — moved on a rank, equal again at tick N, the MIN/MAX collective of tick N-1
named from the target rank's ledger — and never as a first divergent state; the 0.5.23 probes call nothing the
natural catalogue patches and take no lock the engine's threads use."""

from __future__ import annotations

import json
import queue
import re
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "injectors"))

from repro_injector import _digest  # noqa: E402

from repro.ledger import load_ledgers  # noqa: E402
from repro.natural_effect import STATUSES, natural_effect  # noqa: E402
from repro.state_digest import StateStatus, diagnose_state  # noqa: E402
from repro.state_probes import Probe  # noqa: E402
from repro.targets.sglang import SGLangAdapter  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


# ---- the injector's digest ---------------------------------------------------------------------------------------

class _NoLock:
    """A Queue mutex that fails the test if anything takes it."""

    def __enter__(self):
        raise AssertionError("the probe took the queue's mutex")

    def __exit__(self, *a):
        return False

    acquire = __enter__


def _receiver():
    ops = {"a": SimpleNamespace(operation=SimpleNamespace(completed_tokens=64)),
           "b": SimpleNamespace(operation=SimpleNamespace(completed_tokens=128))}
    waits = {"a": SimpleNamespace(timer=SimpleNamespace(started_at=None), expired=True),
             "b": SimpleNamespace(timer=SimpleNamespace(started_at=12.5), expired=False)}
    q: queue.Queue = queue.Queue()
    q.put(1), q.put(2)
    q.mutex = _NoLock()  # qsize() / empty() would raise: len(q.queue) must not take it
    cc = SimpleNamespace(ack_backup_queue=q)
    return SimpleNamespace(tree_cache=SimpleNamespace(ongoing_prefetch=ops, _storage_prefetch_wait=waits, cache_controller=cc))


def test_sum_of_member_numbers_reads_dict_values_skips_none_and_never_takes_a_queue_mutex(tmp_path: Path):
    probes = [{"name": "done", "path": "sum(tree_cache.ongoing_prefetch.values()[*].operation.completed_tokens)", "kind": "transient"},
              {"name": "started", "path": "sum(tree_cache._storage_prefetch_wait.values()[*].timer.started_at)",
               "kind": "transient", "tolerance": 60.0},
              {"name": "expired", "path": "sum(tree_cache._storage_prefetch_wait.values()[*].expired)", "kind": "transient"},
              {"name": "acks", "path": "len(tree_cache.cache_controller.ack_backup_queue.queue)", "kind": "transient"},
              {"name": "none", "path": "sum(tree_cache.nothing.values()[*].x)", "kind": "transient"}]
    d = _digest.Digest({"probes": probes}, str(tmp_path), 1)
    (line,) = d.tick(1, _receiver())
    rec = json.loads(line)
    assert rec["v"] == {"done": 192, "started": 12.5, "expired": 1, "acks": 2, "none": None}
    assert rec["kinds"] == {p["name"]: "transient" for p in probes} and rec["tol"] == {"started": 60.0}
    assert "tol" in json.loads(d.full_line(2))  # every ledger part's first line carries it too


@pytest.mark.parametrize("path", ["sum(a.b)", "sum(len(a))", "len(a.values()[*].x)"])
def test_sum_needs_a_member_chain_in_both_parsers(path: str):
    with pytest.raises(_digest.ProbeSyntaxError):
        _digest.parse_path(path)
    with pytest.raises(ValueError, match="never free Python"):
        Probe(name="x", path=path)


def test_a_tolerance_is_refused_on_a_lockstep_probe_with_the_fix_named():
    with pytest.raises(ValueError, match=r'tolerance = 1.0 is for kind = "transient" only .*drop tolerance'):
        Probe(name="x", path="a.b", tolerance=1.0)


# ---- the 0.5.23 probes against the natural catalogue -------------------------------------------------------------

SAFE_CALLS = {"available_size", "evictable_size", "protected_size", "values"}  # read-only accessors (0.5.23 sources)


def _catalogue_functions() -> set[str]:
    cat = tomllib.loads((REPO / "scenarios" / "sglang" / "natural_nemeses.toml").read_text())
    out = set()
    for p in cat["points"]:
        for site in [p["site"]] if isinstance(p["site"], str) else p["site"]:
            out.add(site.rpartition(".")[2].rpartition(":")[2])
    return out


def test_0_5_23_probes_call_nothing_the_natural_catalogue_patches_and_no_lock_taking_method():
    ps = SGLangAdapter().release_data().probe_sets()["0.5.23"]
    patched = _catalogue_functions()
    assert {"_count_ready_acks", "is_load_back_event_done", "_page_transfer"} <= patched
    kinds = {p.kind for p in ps.probe}
    assert "transient" in kinds
    for p in ps.probe:
        calls = set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\(\)", p.path))
        assert calls <= SAFE_CALLS, f"{p.name}: calls {calls - SAFE_CALLS} (a pending poll or a lock: read attributes)"
        assert not calls & patched and "qsize" not in p.path and "is_terminated" not in p.path
    trans = {p.name: p for p in ps.probe if p.kind == "transient"}
    assert trans["hicache.prefetch_completed_tokens"].path.startswith("sum(tree_cache.ongoing_prefetch.values()[*]")
    assert trans["hicache.ack_backup_queue.len"].path == "len(tree_cache.cache_controller.ack_backup_queue.queue)"
    assert trans["hicache.prefetch_wait_started_at"].tolerance > 0


# ---- natural_effect over synthetic ledgers -----------------------------------------------------------------------

MIN_SITE = ["m:UnifiedRadixCache._all_reduce_attn_groups", "m:UnifiedRadixCache._all_reduce",
            "m:UnifiedRadixCache._sync_hicache_ready_counts", "m:UnifiedRadixCache.check_hicache_events"]


def _ledger(folder: Path, pid: int, rank: int, states: list, ticks: int) -> None:
    lines = [{"e": "header", "pid": pid, "rank": rank, "part": 0, "dropped": 0, "max_records": 100, "time": 1.0},
             {"e": "group", "g": "1", "name": "1", "ranks": [0, 1], "backend": "gloo", "label": "tp/cpu"}]
    lines += states
    seq = 0
    for t in range(1, ticks + 1):  # each tick: a request broadcast, a forward SUM, the storage-queue MIN
        for op, red, site in (("broadcast", None, ["m:Scheduler.recv_requests"]), ("all_reduce", "SUM", ["m:Llama.forward"]),
                              ("all_reduce", "MIN", MIN_SITE)):
            seq += 1
            lines.append({"e": "enter", "g": "1", "seq": seq, "op": op, "api": f"torch.distributed.{op}", "red": red,
                          "shapes": [[1]], "dtypes": ["int64"], "site": site, "tick": t, "t": float(t), "inj": None,
                          "thread": "MainThread"})
            lines.append({"e": "exit", "g": "1", "seq": seq, "t": float(t) + 0.1, "err": None})
    (folder / f"ledger-{pid}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def _full(**v):
    return {"e": "state", "tick": 1, "full": True, "kinds": {"acks": "transient", "started": "transient"},
            "tol": {"started": 60.0}, "v": {"avail": 8, "acks": 0, "started": 100.0, **v}}


def test_a_transient_probe_that_moved_and_was_equal_again_names_the_min_of_the_tick_before(tmp_path: Path):
    # rank 0's backup acks wait 3 ticks for rank 1's delayed backup thread; the MIN drain of tick 6 empties both
    _ledger(tmp_path, 10, 0, [_full(), {"e": "state", "tick": 4, "v": {"acks": 1}}, {"e": "state", "tick": 9, "v": {"acks": 0}}], 11)
    _ledger(tmp_path, 11, 1, [_full()], 11)
    eff = natural_effect(load_ledgers(tmp_path), target_rank=1)
    assert eff.status == "transient reconciled" and eff.status in STATUSES and not eff.episodes
    (e,) = eff.transient
    assert (e.probe, e.start_tick, e.end_tick, e.moved, e.values) == ("acks", 4, 9, (0,), {0: 1, 1: 0})
    assert e.collectives[0] == ("all_reduce MIN @ UnifiedRadixCache._all_reduce_attn_groups ← UnifiedRadixCache._all_reduce"
                                " ← UnifiedRadixCache._sync_hicache_ready_counts")
    assert len(e.collectives) == 2 and e.collectives[1].startswith("broadcast @ Scheduler.recv_requests")  # SUM-free
    assert "moved on rank 0 at tick 4" in eff.summary and "equal again at tick 9, reconciled in tick 8 by all_reduce MIN" in eff.summary


def test_a_transient_probe_open_at_the_end_is_reported_never_a_first_divergent_state(tmp_path: Path):
    _ledger(tmp_path, 10, 0, [_full(), {"e": "state", "tick": 3, "v": {"acks": 2}}], 6)
    _ledger(tmp_path, 11, 1, [_full()], 6)
    led = load_ledgers(tmp_path)
    eff = natural_effect(led, target_rank=0)
    assert eff.status == "transient open" and eff.transient[0].end_tick is None
    assert "not reconciled within the run" in eff.summary and "first divergent state" not in eff.summary
    assert diagnose_state(led).status == StateStatus.EQUAL  # the verdict's oracle ignores it


def test_transient_numbers_within_the_tolerance_are_equal_and_a_clock_step_is_not(tmp_path: Path):
    _ledger(tmp_path, 10, 0, [_full(), {"e": "state", "tick": 3, "v": {"started": 130.0}},
                              {"e": "state", "tick": 5, "v": {"started": 3700.0}}, {"e": "state", "tick": 8, "v": {"started": 0}}], 9)
    _ledger(tmp_path, 11, 1, [_full(), {"e": "state", "tick": 8, "v": {"started": 0}}], 9)
    eff = natural_effect(load_ledgers(tmp_path), target_rank=0)
    (e,) = eff.transient  # 130 vs 100 (within 60 s) is equal; 3700 vs 100 is the episode
    assert (e.start_tick, e.end_tick, e.moved) == (5, 8, (0,))


def test_a_lockstep_divergence_still_decides_the_status_beside_transient_episodes(tmp_path: Path):
    _ledger(tmp_path, 10, 0, [_full(), {"e": "state", "tick": 3, "v": {"acks": 1, "avail": 7}},
                              {"e": "state", "tick": 9, "v": {"acks": 0}}], 10)
    _ledger(tmp_path, 11, 1, [_full()], 10)
    eff = natural_effect(load_ledgers(tmp_path), target_rank=0)
    assert eff.status == "diverged" and eff.episodes[0].probe == "avail" and eff.transient[0].probe == "acks"
    assert "first divergent state" in eff.summary and "transient: transient `acks`" in eff.summary


def test_only_transient_episodes_starting_within_attribute_s_of_the_fire_are_the_nemesis_s(tmp_path: Path):
    # fire at t = 3.0 (tick 3): an episode of ticks 4-10 is the nemesis's; 12-13 (1 tick, like the unperturbed
    # baseline's jitter) and 18-24 (t = 18 > 3 + 5) are not attributed
    _ledger(tmp_path, 10, 0, [_full(), {"e": "state", "tick": 4, "v": {"acks": 1}}, {"e": "state", "tick": 10, "v": {"acks": 0}},
                              {"e": "state", "tick": 12, "v": {"acks": 2}}, {"e": "state", "tick": 13, "v": {"acks": 0}},
                              {"e": "state", "tick": 18, "v": {"acks": 2}}, {"e": "state", "tick": 24, "v": {"acks": 0}}], 26)
    _ledger(tmp_path, 11, 1, [_full()], 26)
    led = load_ledgers(tmp_path)
    eff = natural_effect(led, target_rank=1, since_time=3.0)
    assert eff.status == "transient reconciled" and [e.start_tick for e in eff.transient] == [4] and eff.later == 2
    assert "2 transient episode(s) not attributed (≤ 4 ticks, or > 5 s after the fire" in eff.summary
    late = natural_effect(led, target_rank=1, since_time=11.5)  # from tick 12: only jitter and a late episode
    assert late.status == "none moved" and late.later == 2 and not late.transient
    assert "no episode beyond jitter; 2 transient episode(s) not attributed" in late.summary


def test_where_the_peer_waited_for_the_perturbed_rank_is_named_from_its_ledger(tmp_path: Path):
    # rank 0 (the peer) waited 3 s in tick 5's MIN right after the fire on rank 1; no probe moved (a whole-rank stop)
    _ledger(tmp_path, 10, 0, [_full()], 8)
    _ledger(tmp_path, 11, 1, [_full()], 8)
    f = tmp_path / "ledger-10.jsonl"
    lines = [json.loads(x) for x in f.read_text().splitlines()]
    for x in lines:
        if x.get("e") == "exit" and x["seq"] == 15:  # tick 5's MIN (3 collectives per tick)
            x["t"] = 8.0
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    eff = natural_effect(load_ledgers(tmp_path), target_rank=1, since_time=4.5)
    assert eff.status == "none moved" and eff.held == (
        "rank 0 waited 3.00 s in all_reduce MIN @ UnifiedRadixCache._all_reduce_attn_groups ← UnifiedRadixCache._all_reduce"
        " ← UnifiedRadixCache._sync_hicache_ready_counts (tick 5)",)
    assert "held: rank 0 waited 3.00 s" in eff.summary
    assert natural_effect(load_ledgers(tmp_path), target_rank=0, since_time=4.5).held == ()  # the target's own waits: not
