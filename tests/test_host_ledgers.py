"""The hosts' ledgers followed live (repro.host_ledgers) through local runners: two "hosts" whose ranks have the same
pid (as in two PID namespaces), ledgers appended and rotated on the host side, the mirror's copies a growing prefix
the follower tails, and the ledger proof of a deadlock found on them as on a local server's."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from repro import evidence as ev
from repro.detect import DetectContext
from repro.hosts import HostSpec, RemoteRank, Runner
from repro.host_ledgers import HostLedgerMirror, HostsLedgerProofDetector
from repro.ledger_follow import forget_followers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_proof import PIDS, Led, smoke_hang  # noqa: E402  (the injector-format ledger writer)


def _two_hosts(tmp_path: Path):
    dirs = {k: tmp_path / f"host{k}" / "injector" for k in (0, 1)}
    for d in dirs.values():
        d.mkdir(parents=True)
    runners = {k: Runner(HostSpec(name=f"h{k}", node_rank=k, python=sys.executable)) for k in (0, 1)}
    return dirs, {k: RemoteRank(k, runners[k], 4242, str(dirs[k])) for k in (0, 1)}


def _ledgers_on_hosts(tmp_path: Path, dirs: dict, monkeypatch) -> tuple[Led, Led]:
    """Rank k's ledger written in host k's folder, named by the pid both hosts give their rank (4242)."""
    monkeypatch.setitem(PIDS, 0, 4242)
    monkeypatch.setitem(PIDS, 1, 4242)
    a, b = Led(dirs[0], 0), Led(dirs[1], 1)
    for _ in range(3):
        a.tick()
        b.tick()
    return a, b


def test_mirror_copies_only_what_each_hosts_ledger_gained_and_follows_a_rotation(tmp_path: Path, monkeypatch):
    dirs, ranks = _two_hosts(tmp_path)
    a, b = _ledgers_on_hosts(tmp_path, dirs, monkeypatch)
    m = HostLedgerMirror(ranks, tmp_path / "mirror")
    n1 = m.fetch()
    assert n1 > 0 and m.calls == 1 and not m.errors
    for k in (0, 1):
        assert (m.dir / f"ledger-{k}.jsonl").read_bytes() == (dirs[k] / "ledger-4242.jsonl").read_bytes()
    assert m.fetch() == 0  # nothing new: nothing copied
    a.tick()  # the old part gains records the mirror has not copied yet ...
    src = dirs[0] / "ledger-4242.jsonl"
    # ... then the injector's rotation (repro_injector._ledger: os.replace(path(0), path(1))): the old part renamed
    # to ledger-<pid>.1.jsonl, a new part opened
    os.rename(src, dirs[0] / "ledger-4242.1.jsonl")
    a2 = Led(dirs[0], 0, part=1)
    a2.seq, a2.t = dict(a.seq), a.t
    a2.tick()
    m.fetch()
    whole = (dirs[0] / "ledger-4242.1.jsonl").read_bytes() + src.read_bytes()
    assert (m.dir / "ledger-0.jsonl").read_bytes() == whole


def test_proof_on_the_mirror_decides_a_deadlock_across_hosts(tmp_path: Path, monkeypatch):
    dirs, ranks = _two_hosts(tmp_path)
    a, b = _ledgers_on_hosts(tmp_path, dirs, monkeypatch)
    m = HostLedgerMirror(ranks, tmp_path / "mirror")
    m.fetch()
    run = ev.EvidenceDir(tmp_path / "ev", "s", "v")
    det = HostsLedgerProofDetector(ranks)
    det.capture = lambda ctx: (_ for _ in ()).throw(OSError("no py-spy here"))  # the verdict must not need stacks
    ctx = DetectContext(m.rank_keys, [0, 1], run, m.dir, {"ledger": {"enabled": True}}, 15.0)
    ctx.t_burst = ctx.now = 1.0
    try:
        det.start(ctx)
        assert det.poll(ctx) is None  # healthy so far
        smoke_hang(a, b)
        m.fetch()
        ctx.now = 2.0
        d = det.poll(ctx)
        assert d is not None and d.decided and d.verdict.verdict == "DEADLOCKED", d
        assert d.verdict.proof["kind"] == "missing_partner" and d.verdict.reason.startswith("Ledger proof of a deadlock")
        assert "capture_error" in d.record and json.dumps(d.evidence[ev.Layout.PROOF])
    finally:
        forget_followers()


def test_a_rank_killed_on_its_host_is_named_with_its_host_pid_and_reason(tmp_path: Path):
    """A rank process that ends on its host: the mirror's next call sees its /proc gone, and the hosts' rank-death
    detector (repro.checker.RankDeathDetector's rule) decides INCONCLUSIVE naming the rank, its host and pid."""
    import subprocess
    import time

    from repro.host_ledgers import hosts_rank_death_detector

    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    dirs = {k: tmp_path / f"host{k}" / "injector" for k in (0, 1)}
    for d in dirs.values():
        d.mkdir(parents=True)
    (tmp_path / "host1" / "server.log").write_text("[TP1] Scheduler hit an exception: RuntimeError: boom\n")
    runners = {k: Runner(HostSpec(name=f"h{k}", node_rank=k, python=sys.executable)) for k in (0, 1)}
    ranks = {k: RemoteRank(k, runners[k], procs[k].pid, str(dirs[k])) for k in (0, 1)}
    try:
        m = HostLedgerMirror(ranks, tmp_path / "mirror")
        m.fetch()
        det = hosts_rank_death_detector(m)
        run = ev.EvidenceDir(tmp_path / "ev", "s", "v")
        ctx = DetectContext(m.rank_keys, [0, 1], run, m.dir, {}, 15.0)
        det.start(ctx)
        assert det.poll(ctx) is None and not m.dead
        procs[1].kill()
        procs[1].wait(timeout=10)
        t0 = time.time()
        m.fetch()
        d = det.poll(ctx)
        assert d is not None and d.decided and d.verdict.verdict == "INCONCLUSIVE", d
        assert d.verdict.reason.startswith(f"rank 1 (pid {procs[1].pid}) died: on host h1: "), d.verdict.reason
        assert "boom" in d.verdict.reason and "rank(s) 0 still running" in d.verdict.reason
        assert d.evidence[ev.Layout.RANK_DEATHS][0]["rank"] == 1 and m.dead[1] >= t0
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


def test_a_dead_rank_of_a_hosts_run_is_never_said_to_wait_in_its_ledger_evidence(tmp_path: Path):
    """ledger.json / the report's ledger sentence of a ``--hosts`` run (its mirror, ledger-<rank>.jsonl) mark the
    ranks rank_deaths.json names as dead, as a local run's do: rank 1 killed on h1 'never did: it died', not 'waits'
    (found on the real rig: the killed rank's REPORT.md said 'rank 1 never did and waits in broadcast')."""
    from repro.multihost import _ledger_evidence_from

    mirror = tmp_path / "mirror"
    mirror.mkdir()
    enter = lambda g, seq, op, t: {"e": "enter", "g": g, "seq": seq, "op": op, "api": "x", "red": None, "shapes": [[1]],
                                   "dtypes": ["int64"], "site": ["m:f"], "tick": 1, "t": t, "inj": None}
    done = lambda g, seq, t: {"e": "exit", "g": g, "seq": seq, "t": t, "err": None}
    for rank, body in ((0, [enter("1", 1, "all_reduce", 1.0), done("1", 1, 1.1), enter("1", 2, "all_reduce", 2.0)]),
                       (1, [enter("1", 1, "all_reduce", 1.0), done("1", 1, 1.1), enter("2", 1, "broadcast", 2.5)])):
        head = {"e": "header", "pid": 4000 + rank, "rank": rank, "part": 0, "dropped": 0, "max_records": 10, "time": 0}
        groups = [{"e": "group", "g": g, "name": g, "ranks": [0, 1], "backend": "gloo", "label": lab}
                  for g, lab in (("1", "tp/device"), ("2", "tp/cpu"))]
        (mirror / f"ledger-{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in [head, *groups, *body]))
    alive = ev.EvidenceDir(tmp_path / "ev", "s", "alive")
    d = _ledger_evidence_from(alive, mirror, [0, 1])
    assert "rank 1 never did and waits in broadcast" in d.divergence.summary, d.divergence.summary  # no death known
    dead = ev.EvidenceDir(tmp_path / "ev", "s", "dead")
    dead.rank_deaths.write([{"rank": 1, "pid": 4001, "reason": "on host h1: exit code -9 (SIGKILL) per the server log",
                             "time": 3.0}])
    d = _ledger_evidence_from(dead, mirror, [0, 1])
    summary = json.loads(dead.ledger.path.read_text())["divergence"]["summary"]
    assert summary == d.divergence.summary and "waits" not in summary, summary
    assert "rank 1 never did: it died (pid 4001: on host h1: exit code -9 (SIGKILL)" in summary, summary
    assert json.loads(dead.ledger.path.read_text())["mirror"] == str(mirror) and dead.timeline.path.is_file()
