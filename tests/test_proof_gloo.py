"""The ledger proof on real multi-process gloo jobs (tests/gloo_programs/ledger_sched.py under the injector, ledger on),
followed live by tail while the ranks are blocked: the injected extra all_reduce (a closed set of waits across the
CPU and device groups), an extra MAX all_reduce meeting the peer's request broadcast (unpairable: both blocked),
a reduce-op mismatch gloo completes (a desync, never a proof), a healthy job (nothing), and a rank whose ledger is
missing (the stated fallback)."""

from __future__ import annotations

import time
from pathlib import Path

from test_ledger_gloo import WAIT_S, _end, _finish, _plan, _start

from repro.ledger_follow import LedgerFollower
from repro.proof import find_desyncs, find_proof


def _pids(procs) -> dict[int, int]:
    return {r: p.pid for r, p in enumerate(procs)}


def _follow_until_proof(tmp: Path, procs, need_ranks=(0, 1)):
    f = LedgerFollower(tmp / "out", _pids(procs))
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        f.poll()
        p = find_proof(f.alignment)
        if p is not None:
            return f, p
        assert all(pr.poll() is None for pr in procs), "a rank exited instead of hanging"
        time.sleep(0.05)
    raise AssertionError(f"no proof within {WAIT_S} s; fallback: {f.alignment.fallback_reasons()}")


def test_injected_extra_all_reduce_is_proven_as_a_closed_set_of_waits_while_the_ranks_hang(torch_python: str,
                                                                                             tmp_path: Path):
    procs = _start(torch_python, tmp_path, _plan(tmp_path, inject=True), "inject", ticks=3)
    try:
        f, p = _follow_until_proof(tmp_path, procs)
        assert all(pr.poll() is None for pr in procs)
        assert p.kind == "missing_partner" and p.ranks == (0, 1)
        al = f.alignment
        by = {e.rank: e for e in p.edges}
        assert al.groups[by[0].group].label == "tp/cpu" and by[0].op == "all_reduce" and by[0].on == 1
        assert al.groups[by[1].group].label == "tp/device" and by[1].on == 0
        assert p.records[0].inj == "extra" and p.records[0].site[0] == "ledger_sched:Scheduler.run_batch"
        assert (by[0].on_group, by[0].on_seq) == (by[1].group, by[1].seq)
    finally:
        _end(procs)


def test_extra_max_all_reduce_meeting_the_request_broadcast_is_unpairable(torch_python: str, tmp_path: Path):
    procs = _start(torch_python, tmp_path, _plan(tmp_path), "extra", ticks=3, odd=1)
    try:
        f, p = _follow_until_proof(tmp_path, procs)
        assert p.kind == "unpairable" and p.ranks == (0, 1)
        ops = {k: (r.op, r.red) for k, r in p.records.items()}
        assert ops == {0: ("broadcast", None), 1: ("all_reduce", "MAX")}
        assert p.records[0].seq == p.records[1].seq and p.records[0].group == p.records[1].group
        assert p.records[0].src == 0  # the ledger names the broadcast's source
    finally:
        _end(procs)


def test_reduce_op_mismatch_that_gloo_completes_is_a_desync_not_a_proof(torch_python: str, tmp_path: Path):
    procs = _start(torch_python, tmp_path, _plan(tmp_path), "mismatch-red", world=2, ticks=3, odd=1)
    f = LedgerFollower(tmp_path / "out", _pids(procs))
    proofs = []
    try:
        while any(p.poll() is None for p in procs):
            f.poll()
            proofs.append(find_proof(f.alignment, alive=[0, 1]))
            time.sleep(0.02)
    finally:
        _finish(procs)
    f.poll()
    assert not any(proofs)
    (d,) = find_desyncs(f.alignment)
    assert d.outcome == "completed" and d.fields == ("red",) and d.label == "tp/device" and d.pairing == "pairs"
    assert {k: r.red for k, r in d.records.items()} == {0: "SUM", 1: "MIN"}


def test_healthy_job_gives_neither_proof_nor_desync(torch_python: str, tmp_path: Path):
    procs = _start(torch_python, tmp_path, _plan(tmp_path), "ok", ticks=8)
    f = LedgerFollower(tmp_path / "out", _pids(procs))
    seen = []
    try:
        while any(p.poll() is None for p in procs):
            f.poll()
            seen.append(find_proof(f.alignment))
            time.sleep(0.02)
    finally:
        _finish(procs)
    f.poll()
    assert not any(seen) and find_desyncs(f.alignment, include_pending=True) == []
    assert f.alignment.fallback_reasons() == []


def test_a_rank_without_ledger_gives_the_stated_fallback_never_a_proof(torch_python: str, tmp_path: Path):
    procs = _start(torch_python, tmp_path, _plan(tmp_path, inject=True), "inject", ticks=3)
    try:
        f = LedgerFollower(tmp_path / "out", {0: procs[0].pid, 1: 999_999_999})  # rank 1's ledger: not the right pid
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (tmp_path / "out" / "ready-1").exists():
            time.sleep(0.1)
        time.sleep(1.0)
        f.poll()
        assert find_proof(f.alignment) is None
        assert f.alignment.fallback_reasons() == ["rank 1: no ledger records (ledger missing for this rank)"]
    finally:
        _end(procs)


def test_gloo_size_check_abort_is_a_crashed_desync_from_the_ledger_and_the_log(torch_python: str, tmp_path: Path):
    from repro.proof import crash_desync

    procs = _start(torch_python, tmp_path, _plan(tmp_path), "mismatch-dtype", world=2, ticks=3, odd=1)
    f = LedgerFollower(tmp_path / "out", _pids(procs))
    try:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            f.poll()
            time.sleep(0.02)
        time.sleep(0.3)
        f.poll()
        alive = [r for r, p in enumerate(procs) if p.poll() is None]
    finally:
        errs = _end(procs)
    log = tmp_path / "server.log"
    log.write_text("\n".join(errs))
    assert "doesn't match expected size" in log.read_text()  # gloo aborted a rank
    assert find_proof(f.alignment, alive=alive) is None
    ds = find_desyncs(f.alignment, alive=alive, include_pending=True)
    d = ds[0] if ds else crash_desync(f.alignment, alive, log)
    assert d is not None and d.outcome == "crashed" and d.label == "tp/device" and d.seq == 2
    if not ds:  # the aborted rank's own record of #2 never reached disk (the usual case): the log names the check
        assert "aborted in the backend's own mismatch check" in d.summary
        assert crash_desync(f.alignment, alive, tmp_path / "no-such.log") is None
