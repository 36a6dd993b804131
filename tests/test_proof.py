"""The ledger proof on synthetic ledger files written in the injector's format and followed by tail: the closed set of
waits (smoke shape), unpairable ops (#30760 shape), desyncs that complete, what is never a proof (an idle server, a
collective in flight, a wait on a background thread, a dead rank), and the stated fallback when a ledger is
truncated, rotated out of order, corrupt or missing; the pairing tables; the DESYNCED verdict."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from repro.ledger_follow import LedgerFollower
from repro.proof import PairingTable, Side, find_desyncs, find_proof, table_for
from repro.verdict import (DEADLOCKED, DESYNCED, EXIT_CODES, INCONCLUSIVE, SUCCEEDED, Verdict, combine_with_ledger,
                           exit_code_for)

CPU, DEV = "1", "2"
PIDS = {0: 1000, 1: 1001}


@pytest.fixture(autouse=True)
def _no_followers_kept():
    """The detector keeps a server's follower across bursts (repro.ledger_follow.shared_follower): none outlives a test."""
    from repro.ledger_follow import forget_followers

    yield
    forget_followers()


class Led:
    """One rank's ledger file, written line by line like the injector's writer thread."""

    def __init__(self, d: Path, rank: int, part: int = 0, dropped: int = 0) -> None:
        self.d, self.rank, self.pid = d, rank, PIDS[rank]
        self.path = d / f"ledger-{self.pid}.jsonl"
        self.seq = {CPU: 0, DEV: 0}
        self.t = 100.0 + rank * 0.001
        self._w({"e": "header", "pid": self.pid, "rank": rank, "part": part, "dropped": dropped, "max_records": 1000,
                 "time": self.t})
        for g, lab in ((CPU, "tp:0/cpu"), (DEV, "tp:0/device")):
            self._w({"e": "group", "g": g, "name": g, "ranks": [0, 1], "backend": "gloo", "label": lab,
                     "rank_in_group": rank})

    def _w(self, rec: dict, raw: str = None) -> None:
        with open(self.path, "a") as f:
            f.write(raw if raw is not None else json.dumps(rec) + "\n")

    def enter(self, g, op="broadcast", red=None, shapes=((1,),), dtypes=("int64",), site=("m:broadcast_pyobj",),
              thread="MainThread", src=None, inj=None):
        self.seq[g] += 1
        self.t += 0.01
        self._w({"e": "enter", "g": g, "seq": self.seq[g], "op": op, "api": f"torch.distributed.{op}", "red": red,
                 "shapes": [list(s) for s in shapes], "dtypes": list(dtypes), "site": list(site), "tick": 1,
                 "t": self.t, "inj": inj, "thread": thread, **({"src": src} if src is not None else {})})
        return self.seq[g]

    def exit(self, g, seq=None, err=None):
        self.t += 0.01
        self._w({"e": "exit", "g": g, "seq": seq or self.seq[g], "t": self.t, "err": err})

    def call(self, g, op="broadcast", **kw):
        self.enter(g, op, **kw)
        self.exit(g)

    def tick(self):
        self.call(CPU, src=0)
        self.call(CPU, src=0, shapes=((16,),), dtypes=("uint8",))
        self.call(DEV, "all_reduce", red="SUM", shapes=((16, 64),), dtypes=("float32",), site=("m:VocabParallelEmbedding.forward",))


def healthy(tmp: Path, ticks: int = 3) -> tuple[Led, Led]:
    a, b = Led(tmp, 0), Led(tmp, 1)
    for _ in range(ticks):
        a.tick()
        b.tick()
    return a, b


def follow(tmp: Path, pids=PIDS) -> LedgerFollower:
    f = LedgerFollower(tmp, pids)
    f.poll()
    return f


def smoke_hang(a: Led, b: Led) -> None:
    a.enter(CPU, "all_reduce", red="SUM", shapes=((1,),), dtypes=("int32",), site=("m:Scheduler.run_batch",), inj="x")
    b.enter(DEV, "all_reduce", red="SUM", shapes=((16, 64),), dtypes=("float32",), site=("m:VocabParallelEmbedding.forward",))


def test_closed_set_of_waits_across_two_groups_is_proven(tmp_path: Path):
    a, b = healthy(tmp_path)
    smoke_hang(a, b)
    p = find_proof(follow(tmp_path).alignment)
    assert p is not None and p.kind == "missing_partner" and p.ranks == (0, 1)
    edges = {(e.rank, e.group, e.seq, e.on, e.on_group, e.on_seq) for e in p.edges}
    assert edges == {(0, CPU, 7, 1, DEV, 4), (1, DEV, 4, 0, CPU, 7)}
    assert p.closing.rank == 1 and p.closing.group == DEV  # the later of the two entries closed the cycle
    assert "rank 0 is inside the injected all_reduce(SUM) #7 on tp:0/cpu" in p.summary
    d = p.to_dict()
    assert d["edges"][0]["kind"] == "missing" and d["closing_t_enter"] == p.closing.t_enter


def test_only_one_side_blocked_is_not_yet_a_proof_and_becomes_one_when_the_other_blocks(tmp_path: Path):
    a, b = healthy(tmp_path)
    a.enter(CPU, "all_reduce", red="SUM", shapes=((1,),), dtypes=("int32",), inj="x")
    f = follow(tmp_path)
    assert find_proof(f.alignment) is None  # rank 1 is between collectives: it may still enter tp/cpu #7
    b.enter(DEV, "all_reduce", red="SUM", shapes=((16, 64),), dtypes=("float32",))
    f.poll()
    assert find_proof(f.alignment) is not None


def test_idle_server_with_a_receiver_in_the_request_broadcast_is_not_a_deadlock(tmp_path: Path):
    a, b = healthy(tmp_path)
    b.enter(CPU, src=0)  # rank 1 waits for rank 0's next request broadcast; rank 0 polls zmq (no record open)
    f = follow(tmp_path)
    assert find_proof(f.alignment) is None and find_desyncs(f.alignment, include_pending=True) == []


def test_collective_in_flight_on_both_ranks_is_not_a_deadlock(tmp_path: Path):
    a, b = healthy(tmp_path)
    a.enter(DEV, "all_reduce", red="SUM", shapes=((16, 64),), dtypes=("float32",))
    b.enter(DEV, "all_reduce", red="SUM", shapes=((16, 64),), dtypes=("float32",))
    assert find_proof(follow(tmp_path).alignment) is None


def test_broadcast_against_all_reduce_max_at_one_sequence_number_is_unpairable(tmp_path: Path):
    a, b = healthy(tmp_path)
    a.enter(CPU, src=0)  # rank 0: the next tick's request broadcast
    b.enter(CPU, "all_reduce", red="MAX", shapes=((1,),), dtypes=("int32",), site=("m:_can_terminate_prefetch",))
    p = find_proof(follow(tmp_path).alignment)
    assert p is not None and p.kind == "unpairable" and p.ranks == (0, 1)
    assert {(e.rank, e.on, e.kind) for e in p.edges} == {(0, 1, "unpairable"), (1, 0, "unpairable")}
    assert "cannot pair" in p.summary


def test_unpairable_ops_where_one_rank_left_are_no_proof(tmp_path: Path):
    a, b = healthy(tmp_path)
    a.enter(CPU, src=0)
    a.exit(CPU)
    b.enter(CPU, "all_reduce", red="MAX", shapes=((1,),), dtypes=("int32",))
    assert find_proof(follow(tmp_path).alignment) is None


def test_same_size_all_reduces_with_different_reduce_ops_complete_as_a_desync_not_a_deadlock(tmp_path: Path):
    a, b = healthy(tmp_path)
    a.enter(CPU, "all_reduce", red="MAX", shapes=((1,),), dtypes=("int32",), inj="max")
    b.enter(CPU, "all_reduce", red="MIN", shapes=((1,),), dtypes=("int32",), inj="min")
    f = follow(tmp_path)
    assert find_proof(f.alignment) is None  # gloo pairs them: they will leave
    assert find_desyncs(f.alignment) == []  # not left yet
    assert [d.outcome for d in find_desyncs(f.alignment, include_pending=True)] == ["pending"]
    a.exit(CPU)
    b.exit(CPU)
    f.poll()
    (d,) = find_desyncs(f.alignment)
    assert d.outcome == "completed" and d.fields == ("red",) and d.pairing == "pairs" and d.seq == 7
    assert "red differ and the backend let them complete" in d.summary


def test_mismatch_that_raised_is_a_crashed_desync(tmp_path: Path):
    a, b = healthy(tmp_path)
    a.enter(DEV, "all_reduce", red="SUM", shapes=((16, 64),), dtypes=("float32",))
    b.enter(DEV, "all_reduce", red="SUM", shapes=((8, 64),), dtypes=("float32",))
    a.exit(DEV, err="RuntimeError: Connection reset by peer")
    f = follow(tmp_path)
    (d,) = find_desyncs(f.alignment, alive=[0])
    assert d.outcome == "crashed" and d.fields == ("shapes",)


def test_wait_on_a_background_thread_does_not_stand_for_the_main_thread(tmp_path: Path):
    a, b = healthy(tmp_path)
    a.enter(CPU, "all_reduce", red="SUM", shapes=((1,),), dtypes=("int32",))
    # rank 1's main thread issues tp/cpu; only a background thread of rank 1 is inside a collective
    b.enter(DEV, "all_reduce", red="SUM", shapes=((16, 64),), dtypes=("float32",), thread="prefetch-thread")
    assert find_proof(follow(tmp_path).alignment) is None


def test_a_dead_rank_is_in_no_proof(tmp_path: Path):
    a, b = healthy(tmp_path)
    smoke_hang(a, b)
    f = follow(tmp_path)
    assert find_proof(f.alignment, alive=[0]) is None and find_proof(f.alignment, alive=[0, 1]) is not None


def test_missing_ledger_for_one_rank_falls_back_to_the_stall_rule(tmp_path: Path):
    a, b = healthy(tmp_path)
    smoke_hang(a, b)
    b.path.unlink()
    f = follow(tmp_path)
    assert find_proof(f.alignment) is None
    assert f.alignment.fallback_reasons() == ["rank 1: no ledger records (ledger missing for this rank)"]


def test_truncated_ledger_falls_back_and_never_proves(tmp_path: Path):
    a, b = healthy(tmp_path)
    f = follow(tmp_path)
    smoke_hang(a, b)
    data = b.path.read_bytes()
    b.path.write_bytes(data[: len(data) // 3])  # truncated in place (same inode, shorter)
    f.poll()
    assert find_proof(f.alignment) is None
    assert "shrank" in f.alignment.fallback_reasons()[0] and "truncated" in f.alignment.fallback_reasons()[0]


def test_corrupt_line_in_the_middle_falls_back(tmp_path: Path):
    a, b = healthy(tmp_path)
    b._w({}, raw='{"e": "exit", "g": "2", "se\n')
    smoke_hang(a, b)
    f = follow(tmp_path)
    assert find_proof(f.alignment) is None and "not JSON" in f.alignment.fallback_reasons()[0]


def test_partial_last_line_waits_for_its_newline(tmp_path: Path):
    a, b = healthy(tmp_path)
    a.enter(CPU, "all_reduce", red="SUM", shapes=((1,),), dtypes=("int32",), inj="x")
    line = json.dumps({"e": "enter", "g": DEV, "seq": 4, "op": "all_reduce", "red": "SUM", "shapes": [[16, 64]],
                       "dtypes": ["float32"], "site": [], "tick": 1, "t": 200.0, "thread": "MainThread"})
    b._w({}, raw=line[:25])
    f = follow(tmp_path)
    assert find_proof(f.alignment) is None and f.alignment.fallback_reasons() == []
    b._w({}, raw=line[25:] + "\n")
    f.poll()
    assert find_proof(f.alignment) is not None


def _rotate(led: Led, part: int) -> None:
    os.replace(led.path, led.d / f"ledger-{led.pid}.1.jsonl")
    seq = dict(led.seq)
    led.__init__(led.d, led.rank, part=part, dropped=10)
    led.seq = seq


def test_rotation_by_the_injector_between_polls_is_followed(tmp_path: Path):
    a, b = healthy(tmp_path)
    f = follow(tmp_path)
    a.tick()
    b.tick()
    _rotate(b, 1)  # what the injector does: close, rename to .1, open part 1 with a header and the groups
    b.tick()
    a.tick()
    smoke_hang(a, b)
    f.poll()
    assert f.alignment.fallback_reasons() == []
    p = find_proof(f.alignment)
    assert p is not None and {(e.rank, e.seq) for e in p.edges} == {(0, 11), (1, 6)}


def test_rotated_twice_between_polls_is_a_stated_fallback_never_a_proof(tmp_path: Path):
    a, b = healthy(tmp_path)
    f = follow(tmp_path)
    _rotate(b, 1)
    b.tick()
    _rotate(b, 2)  # part 1 was replaced before the follower read it: records were missed
    smoke_hang(a, b)
    f.poll()
    assert find_proof(f.alignment) is None
    assert "part 2 followed part 0" in f.alignment.fallback_reasons()[0]


def test_follower_reads_only_what_was_appended(tmp_path: Path):
    a, b = healthy(tmp_path, ticks=2)
    f = follow(tmp_path)
    n0 = f.lines
    a.tick()
    assert f.poll() == 6 and f.lines == n0 + 6 and f.poll() == 0


def test_gloo_table_is_measured_and_looked_up_by_features():
    t = table_for("gloo")
    assert t.solo_blocks("all_reduce") and t.solo_blocks("broadcast")
    ar = lambda red, n=1, dt="int32": Side("all_reduce", red, n, dt)  # noqa: E731
    assert t.outcome(ar("SUM", 4096, "float32"), ar("MAX", 4096, "float32")) == "pairs"
    assert t.outcome(ar("SUM"), ar("SUM", 1, "int64")) == "crash"
    assert t.outcome(Side("broadcast", None, 1, "int64", True), ar("MAX")) == "hangs"
    assert t.outcome(ar("MAX"), Side("broadcast", None, 1, "int64", False)) == "hangs"
    assert t.outcome(Side("barrier"), ar("SUM")) == "hangs"
    assert t.outcome(Side("reduce_scatter", "SUM", 4, "int32"), ar("SUM")) == "unknown"  # never measured


def test_conflicting_measurements_claim_nothing(tmp_path: Path):
    a = {"op": "all_reduce", "red": "SUM", "numel": 1, "dtype": "int32", "src": None}
    b = {"op": "broadcast", "red": None, "numel": 1, "dtype": "int64", "src": 0}
    t = PairingTable("gloo", {"cases": [{"a": a, "b": b, "outcome": "hangs"}, {"a": a, "b": b, "outcome": "pairs"}]})
    assert t.outcome(Side("all_reduce", "SUM", 1, "int32"), Side("broadcast", None, 1, "int64", False)) == "unknown"


def test_nccl_table_from_semantics_never_claims_a_hang():
    t = table_for("nccl")
    assert t.outcome(Side("all_reduce", "SUM", 8, "float16"), Side("all_reduce", "MAX", 8, "float16")) == "pairs"
    assert t.outcome(Side("all_reduce", "SUM", 8, "float16"), Side("all_reduce", "SUM", 4, "float16")) == "undefined"
    assert t.outcome(Side("all_reduce", "SUM", 8, "float16"), Side("broadcast", None, 8, "float16")) == "undefined"
    assert table_for("cpu:gloo,cuda:nccl").backend == "nccl" and table_for("mpi") is None


def test_desynced_verdict_word_exit_code_and_precedence():
    assert EXIT_CODES[DESYNCED] == 7 and exit_code_for(DESYNCED, "desync") == 0 and exit_code_for(DESYNCED, None) == 7
    assert exit_code_for(SUCCEEDED, "desync") == 5
    ds = Verdict(DESYNCED, "ranks disagree", desync={"seq": 3})
    ok = combine_with_ledger(Verdict(SUCCEEDED, "all 4 requests answered"), ds)
    assert ok.verdict == DESYNCED and ok.desync == {"seq": 3} and any("ALL REQUESTS SUCCEEDED" in n for n in ok.notes)
    assert combine_with_ledger(Verdict(INCONCLUSIVE, "server died"), ds).verdict == DESYNCED
    assert combine_with_ledger(Verdict(DEADLOCKED, "proof"), ds).verdict == DEADLOCKED
    assert combine_with_ledger(Verdict(SUCCEEDED, "x"), None).verdict == SUCCEEDED
    assert Verdict(DEADLOCKED, "p", proof={"kind": "unpairable"}).to_json()["proof"] == {"kind": "unpairable"}


def test_cli_accepts_expect_desync():
    from repro.scenario import Variant

    assert Variant.model_validate({"name": "v", "expect": "desync"}).expect == "desync"


def test_watch_declares_a_deadlock_from_the_ledgers_without_a_failed_probe(tmp_path: Path, monkeypatch):
    from repro.watch import WatchOptions, Watcher

    monkeypatch.setitem(PIDS, 0, os.getpid())  # live processes stand in for the two ranks (only pid_exists is asked)
    monkeypatch.setitem(PIDS, 1, os.getppid())
    a, b = healthy(tmp_path)
    events = []
    w = Watcher(WatchOptions(url="http://127.0.0.1:9", ledger_dir=tmp_path).validate(), log=events.append,
                discover=lambda: dict(PIDS))
    assert w._ledger_check() is False and w.state != "hung"  # healthy ledgers: nothing
    a.enter(CPU, "all_reduce", red="MAX", shapes=((1,),), dtypes=("int32",))
    b.enter(CPU, "all_reduce", red="MIN", shapes=((1,),), dtypes=("int32",))
    a.exit(CPU)
    b.exit(CPU)
    smoke_hang(a, b)
    assert w._ledger_check() is True and w.state == "hung" and w.ledger_proof.kind == "missing_partner"
    kinds = [e["event"] for e in events]
    assert "desync" in kinds and "ledger_proof" in kinds
    assert next(e for e in events if e["event"] == "desync")["verdict"] == "DESYNCED"
    no_ledger = Watcher(WatchOptions(url="http://127.0.0.1:9").validate(), discover=lambda: dict(PIDS))
    assert no_ledger._ledger_check() is False  # without --ledger-dir: probes only, as before


def test_a_group_used_from_two_threads_of_the_peer_makes_no_wait_edge(tmp_path: Path):
    a, b = healthy(tmp_path)
    b.call(CPU, src=0, thread="prefetch-thread")  # rank 1 also issues tp/cpu collectives from another thread
    a.call(CPU, src=0)
    smoke_hang(a, b)
    assert find_proof(follow(tmp_path).alignment) is None


def _detector_ctx(tmp: Path):
    import time
    from types import SimpleNamespace

    now = time.time()
    return SimpleNamespace(plan={"ledger": {"enabled": True}}, injector_dir=tmp, rank_pids=dict(PIDS),
                           expected_ranks=[0, 1], t_burst=now - 2.0, now=now, state=None, native=False,
                           run_dir=None, emit=lambda *a: None)


def _truncate(a: Led, b: Led) -> None:
    data = b.path.read_bytes()
    b.path.write_bytes(data[: len(data) // 3])  # in place: same inode, shorter


def _rotate_twice(a: Led, b: Led) -> None:
    _rotate(b, 1)
    b.tick()
    _rotate(b, 2)  # part 1 replaced before the follower read it


def _remove(a: Led, b: Led) -> None:
    b.path.unlink()


@pytest.mark.parametrize("damage,said", [(_truncate, "shrank"), (_rotate_twice, "part 2 followed part 0"),
                                         (_remove, None)], ids=["truncated", "rotated-out-of-order", "missing"])
def test_damaged_ledger_mid_run_is_a_stated_fallback_to_the_stall_rule_never_a_proof(tmp_path: Path, monkeypatch,
                                                                                     damage, said):
    """The detect stage's own word (what verdict.json and REPORT.md carry): a ledger truncated, rotated out of order
    or missing for one rank while the burst runs gives no proof, a non-deciding Detection saying the stall rule
    decides, and a note on the final verdict; the same hang on undamaged ledgers is proven (the control)."""
    from repro.proof import LedgerProofDetector

    monkeypatch.setitem(PIDS, 0, os.getpid())  # live processes stand in for the two ranks (only pid_exists is asked)
    monkeypatch.setitem(PIDS, 1, os.getppid())
    ctl = tmp_path / "control"
    ctl.mkdir()
    ca, cb = healthy(ctl)
    smoke_hang(ca, cb)
    assert find_proof(follow(ctl).alignment, alive=[0, 1]) is not None  # control: the hang itself is provable

    d_dir = tmp_path / "damaged"
    d_dir.mkdir()
    ctx = _detector_ctx(d_dir)
    det = LedgerProofDetector()
    a, b = healthy(d_dir)
    if damage is _remove:  # rank 1 never wrote a ledger here: its records exist nowhere the follower looks
        smoke_hang(a, b)
        damage(a, b)
        det.start(ctx)
    else:
        det.start(ctx)  # the burst starts: the ledgers are followed from here
        damage(a, b)
        smoke_hang(a, b)
    got = det.poll(ctx)
    assert det.proof is None and got is not None and not got.decided and got.verdict is None
    assert got.reason.startswith("ledger proof unavailable, the stall rule decides: rank 1: ")
    assert (said or "ledger missing for this rank") in got.reason
    for _ in range(3):  # later polls never turn the damaged ledger into a proof
        assert det.poll(ctx) is None and det.proof is None
    v = det.final_verdict(Verdict(DEADLOCKED, "stall rule: no progress for 8 s, ranks disagree"), ctx)
    assert v.verdict == DEADLOCKED and v.proof is None and v.reason.startswith("stall rule")
    assert any(n.startswith("ledger proof unavailable for part of the run, the stall rule decided: rank 1: ")
               for n in v.notes)


def test_a_servers_ledgers_are_followed_across_its_bursts_never_re_read(tmp_path: Path, monkeypatch):
    """Burst after burst on one server (controls, clean bursts, hunt trials), the detector reads on from where the
    previous burst stopped: nothing is read twice, a desync of an earlier burst is not this burst's, a desync of
    this burst is; a restarted server (new pids) is followed afresh."""
    from repro.ledger_follow import forget_followers, shared_follower
    from repro.proof import LedgerProofDetector

    monkeypatch.setitem(PIDS, 0, os.getpid())  # live processes stand in for the two ranks (only pid_exists is asked)
    monkeypatch.setitem(PIDS, 1, os.getppid())
    try:
        a, b = healthy(tmp_path)
        ctx = _detector_ctx(tmp_path)
        ctx.t_burst = max(a.t, b.t)
        det = LedgerProofDetector()
        det.start(ctx)
        f = det.follower
        a.enter(CPU, "all_reduce", red="MAX", shapes=((1,),), dtypes=("int32",))
        b.enter(CPU, "all_reduce", red="MIN", shapes=((1,),), dtypes=("int32",))
        a.exit(CPU)
        b.exit(CPU)
        a.tick()
        b.tick()
        det.poll(ctx)
        v1 = det.final_verdict(Verdict(SUCCEEDED, "all 4 requests answered"), ctx)
        assert v1.verdict == DESYNCED and v1.desync["records"]["0"]["red"] == "MAX"

        seen = f.lines
        ctx2 = _detector_ctx(tmp_path)
        ctx2.t_burst = max(a.t, b.t) + 0.001
        det2 = LedgerProofDetector()
        det2.start(ctx2)
        assert det2.follower is f and f.lines == seen  # the next burst re-reads nothing
        a.tick()
        b.tick()
        det2.poll(ctx2)
        assert f.lines == seen + 12  # one tick: 3 collectives × (enter + exit) × 2 ranks
        v2 = det2.final_verdict(Verdict(SUCCEEDED, "all 4 requests answered"), ctx2)
        assert v2.verdict == SUCCEEDED and v2.notes == ()

        det3 = LedgerProofDetector()
        det3.start(ctx2)
        smoke_hang(a, b)
        assert det3.follower is f and find_proof(f.alignment, alive=[0, 1]) is None  # not read yet
        det3.follower.poll()
        assert find_proof(f.alignment, alive=[0, 1]) is not None

        assert shared_follower(tmp_path, {0: PIDS[0], 1: 99999}) is not f  # a restarted server: a new follower
    finally:
        forget_followers()


def test_a_wait_on_a_group_the_peer_never_used_makes_no_edge_and_the_proof_names_the_main_thread(tmp_path: Path):
    """#30760 on the testbed: rank 1's HiCache prefetch thread waits in all_reduce(MIN) #1 on the prefetch group,
    which rank 0 never used yet (so which of its threads would enter it is unknown); the main threads' closed set of
    waits is the proof, and it names rank 1's main-thread collective, not the background one."""
    a, b = healthy(tmp_path)
    for led in (a, b):
        led._w({"e": "group", "g": "9", "name": "9", "ranks": [0, 1], "backend": "gloo", "label": "pg9",
                "rank_in_group": led.rank})
        led.seq["9"] = 0
    smoke_hang(a, b)
    b.enter("9", "all_reduce", red="MIN", shapes=((1,),), dtypes=("int32",), thread="Thread-1 (prefetch_thread_func)",
            site=("m:HiCacheController._all_reduce",))
    p = find_proof(follow(tmp_path).alignment)
    assert p is not None and p.kind == "missing_partner" and p.ranks == (0, 1)
    assert {(e.rank, e.thread) for e in p.edges} == {(0, "MainThread"), (1, "MainThread")}
    assert p.records[1].group == DEV and "VocabParallelEmbedding.forward" in p.summary and "pg9" not in p.summary


def test_watch_follows_the_servers_shared_follower_and_drops_the_slots_every_rank_left(tmp_path: Path, monkeypatch):
    """``repro watch`` uses the server's one follower (``shared_follower``: the same object a run's detector gets),
    judges each slot every rank left once (a desync among them is logged once) and drops it, so a long watch
    neither grows the alignment nor re-judges old collectives."""
    from repro.ledger_follow import shared_follower
    from repro.watch import WatchOptions, Watcher

    monkeypatch.setitem(PIDS, 0, os.getpid())
    monkeypatch.setitem(PIDS, 1, os.getppid())
    a, b = healthy(tmp_path)
    events = []
    w = Watcher(WatchOptions(url="http://127.0.0.1:9", ledger_dir=tmp_path).validate(), log=events.append,
                discover=lambda: dict(PIDS))
    assert w._ledger_check() is False
    assert w._follower is shared_follower(tmp_path, dict(PIDS))
    al = w._follower.alignment
    assert al.slots == {}  # healthy ticks: every slot judged and dropped
    a.enter(CPU, "all_reduce", red="MAX", shapes=((1,),), dtypes=("int32",))
    b.enter(CPU, "all_reduce", red="MIN", shapes=((1,),), dtypes=("int32",))
    a.exit(CPU)
    b.exit(CPU)
    for _ in range(3):
        a.tick()
        b.tick()
        assert w._ledger_check() is False
    assert al.slots == {}
    desyncs = [e for e in events if e["event"] == "desync"]
    assert len(desyncs) == 1 and desyncs[0]["verdict"] == "DESYNCED" and desyncs[0]["desync"]["fields"] == ["red"]
    smoke_hang(a, b)
    assert w._ledger_check() is True and w.ledger_proof.kind == "missing_partner"


def test_a_rank_dead_in_the_backends_size_check_is_a_crashed_desync_once_the_survivors_record_lands(
        tmp_path: Path, monkeypatch):
    """Measured in session 8's hunt and runs: gloo's size check aborted rank 0 in C++ (no record of its call); the
    verdict was taken before rank 1's own call failed and its record was written, and the aborted rank, a zombie,
    still counted as alive: INCONCLUSIVE. The detector now counts a zombie dead and waits, boundedly, for the survivor's record when the log of this burst has the backend's mismatch message;
    a mismatch message written before the burst (a hunt session's earlier server) is not this burst's."""
    import subprocess
    import threading
    import time

    from repro.proof import LedgerProofDetector

    dead = subprocess.Popen(["true"])  # rank 0 is gone, a zombie until reaped, as an aborted rank whose parent
    time.sleep(0.3)                     # sleeps before it reaps (sglang: 5 s); pid_exists still says yes
    monkeypatch.setitem(PIDS, 0, dead.pid)
    monkeypatch.setitem(PIDS, 1, os.getpid())  # rank 1 lives on
    inj = tmp_path / "injector"
    inj.mkdir()
    log = tmp_path / "server.log"
    a, b = healthy(inj)
    for old_log, want in (("", DESYNCED), ("Received data size doesn't match expected size\n", INCONCLUSIVE)):
        log.write_text(old_log)
        ctx = _detector_ctx(inj)
        det = LedgerProofDetector()
        det.start(ctx)
        if not old_log:
            log.write_text("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n  what():  "
                           "op.preamble.length <= op.nbytes. 256 vs 224. Received data size doesn't match expected "
                           "size. Is there a distributed collective mismatch in your code?\n")

        def survivor_fails_later(b=b):
            time.sleep(0.3)
            b.enter(DEV, "all_reduce", red="SUM", shapes=((8, 64),), dtypes=("float16",))
            b.exit(DEV, err="RuntimeError: Connection reset by peer")

        th = threading.Thread(target=survivor_fails_later)
        th.start()
        v = det.final_verdict(Verdict(INCONCLUSIVE, "rank 0 died"), ctx)
        th.join()
        assert v.verdict == want, v
        if want == DESYNCED:
            assert v.desync["outcome"] == "crashed" and v.desync["seq"] == 4 and "aborted in the backend" in v.reason
        a.call(DEV, "all_reduce", red="SUM", shapes=((8, 64),), dtypes=("float16",))  # line both up for the next
    dead.wait()


def test_the_measured_gloo_table_never_proves_a_size_mismatch_of_one_op_a_hang():
    """Measured (scripts/measure_pairing.py, session 8): gloo hangs on all_reduce of 1 against 4 int32 but aborts the
    process on larger mismatches (4 vs 8 float32 … 448 vs 512 float16, sglang's model forward). Same features,
    different outcomes unless a single element is its own class (it is): the larger mismatches crash, so one is never called DEADLOCKED (the
    hunt's check_decode_mem trial was, before); different ops keep their measured hang (#30760's shape)."""
    t = table_for("gloo")
    assert t is not None
    assert t.outcome(Side("all_reduce", "SUM", 448, "float16"), Side("all_reduce", "SUM", 512, "float16")) == "crash"
    # a single element against more: measured to hang (vLLM's injected extra all_reduce [1] meets the peer's)
    assert t.outcome(Side("all_reduce", "SUM", 1, "int32"), Side("all_reduce", "SUM", 4, "int32")) == "hangs"
    assert t.outcome(Side("broadcast", None, 1, "int64", True), Side("all_reduce", "MAX", 1, "int64")) == "hangs"


def test_watch_once_declares_a_proven_hang_within_a_second_of_the_closing_ledger_record(tmp_path: Path, monkeypatch):
    """``repro watch --once --ledger-dir`` on a server whose /generate never answers (probe timeout 5 s): the
    ledgers are followed while the probe is in flight, so the hang is declared ≤ 1 s after the record that closes
    the proof, not at the probe timeout; both times are in hang.json."""
    import subprocess
    import sys
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from repro.watch import WatchOptions, Watcher

    release = threading.Event()

    class Hung(BaseHTTPRequestHandler):
        def log_message(self, *a):  # noqa: D401 - silence
            pass

        def do_POST(self):  # noqa: N802 - /generate: never answers (a silent hang)
            release.wait(30)

        def do_GET(self):  # noqa: N802 - /health answers: only the ledgers (or the probe timeout) can tell
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Hung)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    inj = tmp_path / "injector"
    inj.mkdir()
    try:
        for k, p in enumerate(ranks):  # live processes stand in for the two ranks
            monkeypatch.setitem(PIDS, k, p.pid)
        a, b = healthy(inj)
        closing: dict = {}

        def hang_later() -> None:
            a.t = b.t = time.time()
            smoke_hang(a, b)
            closing["t"] = time.time()

        timer = threading.Timer(1.5, hang_later)
        timer.start()
        events: list = []
        opts = WatchOptions(url=f"http://127.0.0.1:{srv.server_address[1]}", once=True, interval_s=5.0,
                            probe_timeout_s=5.0, health_timeout_s=1.0, ledger_dir=inj, confirm_gap_s=0.0,
                            capture_timeout_s=5.0, evidence_root=tmp_path / "ev").validate()
        w = Watcher(opts, events.append, discover=lambda: dict(PIDS))
        code = w.run()
        timer.join()
    finally:
        release.set()
        srv.shutdown()
        srv.server_close()
        for p in ranks:
            p.kill()
            p.wait(timeout=10)
    assert code == 3, [e["event"] for e in events]
    hang = next(e for e in events if e["event"] == "hang")
    evd = Path(next(e for e in events if e["event"] == "evidence")["path"])
    hj = json.loads((evd / "hang.json").read_text())
    assert hj["verdict"] == DEADLOCKED and hj["proof"]["kind"] == "missing_partner", hj["reason"]
    t = hj["timings_s"]
    assert abs(t["proof_record_t"] - closing["t"]) < 0.5 and t["declared_t"] >= t["proof_record_t"]
    assert t["declared_after_proof_record"] <= 1.0, t  # not the 5 s probe timeout
    assert json.loads((evd / "verdict.json").read_text())["verdict"] == DEADLOCKED
    probe = next(e for e in events if e["event"] == "probe")
    assert probe["transition"] == "hang" and probe["generate"]["outcome"] != "timeout", probe


def test_a_first_wait_on_a_group_the_peers_same_thread_will_issue_is_an_edge_vllm_gloo_fallback(tmp_path: Path):
    """vLLM on a CPU whose kernel build has no shm ops (its TP all_reduce falls back to gloo on the device group): the
    ticks so far used only tp:0/cpu; rank 0's main thread is inside an extra all_reduce on tp:0/cpu, rank 1's main
    thread inside the first all_reduce ever on tp:0/device. Rank 0 has issued nothing on tp:0/device, but its main
    thread issues every group rank 1's main thread issues, so that thread is the one that would enter it: proven."""
    a, b = Led(tmp_path, 0), Led(tmp_path, 1)
    for _ in range(2):
        for led in (a, b):
            led.call(CPU, src=0)
    a.enter(CPU, "all_reduce", red="SUM", shapes=((1,),), dtypes=("int32",), site=("m:GroupCoordinator.all_reduce",),
            inj="x")
    b.enter(DEV, "all_reduce", red="SUM", shapes=((16, 128),), dtypes=("float32",),
            site=("m:VocabParallelEmbedding.forward",))
    p = find_proof(follow(tmp_path).alignment)
    assert p is not None and p.ranks == (0, 1), p
    assert {(e.rank, e.group, e.on, e.on_group) for e in p.edges} == {(0, CPU, 1, DEV), (1, DEV, 0, CPU)}
    # the same first wait from a thread of rank 1 that issues no other group stays unknown: no proof
    c = tmp_path / "bg"
    c.mkdir()
    a2, b2 = Led(c, 0), Led(c, 1)
    for led in (a2, b2):
        led.call(CPU, src=0)
    a2.enter(CPU, "all_reduce", red="SUM", shapes=((1,),), dtypes=("int32",), inj="x")
    b2.enter(DEV, "all_reduce", red="SUM", shapes=((16, 128),), dtypes=("float32",), thread="Thread-1 (bg)")
    assert find_proof(follow(c).alignment) is None


def test_a_proof_counts_its_stack_capture_so_the_run_never_says_captures_0(tmp_path: Path, monkeypatch):
    """REPORT.md said "captures 0" next to "proof_capture_s 1.5" on the ledger-proof path: the session sums the
    detectors' ``captures`` (repro.run.session) and the proof detector had none. Its capture of -proof/-proofb
    counts as one now, as the stall rule counts each of its -<n>/-<n>b captures."""
    from types import SimpleNamespace

    from repro.proof import LedgerProofDetector

    monkeypatch.setitem(PIDS, 0, os.getpid())  # live processes stand in for the two ranks (only pid_exists is asked)
    monkeypatch.setitem(PIDS, 1, os.getppid())

    class Captured(LedgerProofDetector):
        def capture(self, ctx):  # the stacks the report shows: a StallCheck's shape, no process dumped here
            judged = SimpleNamespace(reason="ranks disagree", deadlocked=True)
            return SimpleNamespace(second_analysis=None, judgement=judged, cpu_percent={0: 0.0, 1: 0.0})

    a, b = healthy(tmp_path)
    ctx = _detector_ctx(tmp_path)
    det = Captured()
    det.start(ctx)
    assert det.captures == 0
    smoke_hang(a, b)
    got = det.poll(ctx)
    assert got is not None and got.decided and det.proof is not None
    assert det.captures == 1 and "proof_capture_s" in det.timings
