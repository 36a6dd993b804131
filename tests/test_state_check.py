"""The conftest's lockstep state check (tests/state_check.py) on small synthetic run folders: written with the
store's writers (``repro.evidence``) and the injector's own digest (``repro_injector._digest.Digest`` on
scheduler-shaped objects), read with the product's readers. A clean run passes; a divergence, a probe that did not
resolve on one rank, and a burst that moved nothing each fail, naming the folder, the probe and the rank; runs
without a ledger, with the digest off or from before the digest are skipped with a reason; runs that fired an
injection or did not succeed are not held to it. The wiring (a marked test fails) is checked in a child pytest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "injectors"))

from repro_injector import _digest  # noqa: E402

import state_check  # noqa: E402
from repro import evidence as ev  # noqa: E402
from repro.verdict import DEADLOCKED, SUCCEEDED, Verdict  # noqa: E402
from state_check import Outcome, check_run  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
T0 = 1_700_000_000.0  # tick k's collective is entered at T0 + k (epoch seconds)
TICKS = 10
BURST = (4.5, 7.5)  # requests.jsonl spans T0 + 4.5 … T0 + 7.5: ticks 5–7 (+ the start of tick 8)
PROBES = [{"name": "req_to_token_pool.available", "path": "req_to_token_pool.available_size()"},
          {"name": "waiting_queue.rids", "path": "waiting_queue[*].rid"},
          {"name": "extra", "path": "extra()"}]


class _Pool:
    def __init__(self, n: int) -> None:
        self.n = n

    def available_size(self) -> int:
        return self.n


class _Req:
    def __init__(self, rid: str) -> None:
        self.rid = rid


class _Sched:
    """The Scheduler's shape for the probes above; ``extra()`` raises on ``broken_rank``."""

    def __init__(self, rank: int, broken_rank: Optional[int]) -> None:
        self.rank, self.broken_rank = rank, broken_rank
        self.req_to_token_pool = _Pool(8)
        self.waiting_queue: list = []

    def extra(self) -> int:
        if self.rank == self.broken_rank:
            raise RuntimeError("no such pool on this rank")
        return 1


def _state(s: _Sched, tick: int, moves_at: tuple[int, ...], diverge: bool) -> None:
    """A request arrives at the first tick of ``moves_at`` and leaves at the last (its slot taken, then freed)."""
    if tick == moves_at[0]:
        s.waiting_queue.append(_Req("r1"))
        s.req_to_token_pool.n = 7
    if tick == moves_at[-1]:
        s.waiting_queue.clear()
        s.req_to_token_pool.n = 8
    if diverge and s.rank == 0 and tick == 7:
        s.req_to_token_pool.n -= 1  # a slot leaked on rank 0 only


def make_run(root: Path, *, moves_at: tuple[int, ...] = (6, 7), diverge: bool = False, broken_rank: Optional[int] = None,
             digest: bool = True, digest_in_plan: bool = True, states: bool = True, ledger: bool = True,
             verdict: str = SUCCEEDED, fired_at: Optional[float] = None, session: bool = False,
             release: str = "0.5.23", at: Optional[Path] = None, requests: bool = True,
             rank1_probes: Optional[list] = None) -> Path:
    """One run folder of a TP=2 server (pids 10, 11) as the runner leaves it (``at``: that folder, e.g. a PD
    server's ``servers/<role>/``, which has no ``requests.jsonl`` of its own: ``requests=False``)."""
    if at is not None:
        (at / ev.Layout.INJECTOR.name).mkdir(parents=True)
        evd = ev.EvidenceDir.open(at)
    else:
        evd = ev.EvidenceDir(root, "s", "control")
    if session:
        evd.session.write({"session": str(root / "session"), "rank_pids": {"0": 10, "1": 11}})
    plan: dict = {"arm_file": str(evd.path / "ARM"), "out_dir": str(evd.injector_dir), "injections": [],
                  "ledger": {"enabled": ledger}}
    if digest_in_plan:
        plan["ledger"]["digest"] = {"enabled": digest, "package": "sglang", "releases": {"0.5.23": PROBES}}
    evd.plan.write(plan)
    evd.env.write({"sglang": release})
    if requests:
        evd.requests.write([{"t": T0 + BURST[0], "request": 0, "event": "sent"},
                            {"t": T0 + BURST[1], "request": 0, "event": "done"}])
    for rank, pid in ((0, 10), (1, 11)):
        if not ledger:
            continue
        probes = rank1_probes if rank == 1 and rank1_probes is not None else PROBES
        d = _digest.Digest({"probes": probes, "ring": 100}, str(evd.injector_dir), pid)
        s = _Sched(rank, broken_rank)
        lines = [{"e": "header", "pid": pid, "rank": rank, "part": 0, "dropped": 0, "max_records": 1000, "time": T0},
                 {"e": "group", "g": "1", "name": "1", "ranks": [0, 1], "backend": "gloo", "label": "tp/cpu"}]
        text = "".join(json.dumps(x) + "\n" for x in lines)
        for tick in range(1, TICKS + 1):
            _state(s, tick, moves_at, diverge)
            if states and digest:
                text += "".join(x + "\n" for x in d.tick(tick, s))  # the injector's own state lines
            text += json.dumps({"e": "enter", "g": "1", "seq": tick, "op": "broadcast", "api": "torch.distributed.broadcast",
                                "red": None, "shapes": [[1]], "dtypes": ["int64"], "site": ["m:f"], "tick": tick,
                                "t": T0 + tick, "inj": None, "thread": "MainThread"}) + "\n"
            text += json.dumps({"e": "exit", "g": "1", "seq": tick, "t": T0 + tick + 0.1, "err": None}) + "\n"
        (evd.injector_dir / ev.Layout.ledger_file(pid)).write_text(text)
        if fired_at is not None:
            evd.fire_log(pid).write_text("".join(json.dumps(x) + "\n" for x in [
                {"event": "armed", "time": fired_at - 1, "pid": pid, "rank": rank, "ids": ["leak"], "arm_seq": 1},
                {"event": "fire", "time": fired_at, "pid": pid, "rank": rank, "id": "leak", "arm_seq": 1, "n": 1,
                 "action": {"kind": "state"}}]))
    evd.verdict.write(ev.verdict_record(Verdict(verdict, "r"), exit_code=0, evidence=evd.path, scenario="s",
                                        variant="control", variant_expects="success", rank_pids={0: 10, 1: 11}))
    return evd.path


def test_a_clean_run_with_equal_state_every_probe_resolved_and_a_change_in_the_burst_passes(tmp_path: Path):
    c = check_run(make_run(tmp_path))
    assert c.outcome == Outcome.OK, c.problems
    assert c.problems == [] and "3 probes compared" in c.reason and c.seconds < 1.0


def test_a_divergence_fails_naming_the_folder_the_probe_the_tick_and_each_rank(tmp_path: Path):
    run = make_run(tmp_path, diverge=True)
    c = check_run(run)
    assert c.outcome == Outcome.FAILED
    assert c.problems == [f"{run}: state diverged at tick 7: probe `req_to_token_pool.available` rank 0 = 7, rank 1 = 8"]


def test_a_probe_that_did_not_resolve_on_one_rank_fails_naming_that_probe_and_rank(tmp_path: Path):
    run = make_run(tmp_path, broken_rank=1)
    c = check_run(run)
    assert c.outcome == Outcome.FAILED
    assert f"{run}: probe `extra` did not resolve on rank 1: RuntimeError: no such pool on this rank" in c.problems
    assert not any("rank 0" in p for p in c.problems)  # rank 0 resolved it


def test_a_probe_one_rank_never_recorded_fails_naming_that_probe_and_rank(tmp_path: Path):
    run = make_run(tmp_path, rank1_probes=PROBES[:2])  # rank 1's probe list lacks `extra`
    c = check_run(run)
    assert c.outcome == Outcome.FAILED
    assert f"{run}: probe `extra` never recorded on rank 1 (recorded on another rank)" in c.problems


def test_a_burst_that_moved_no_probe_fails_on_every_rank(tmp_path: Path):
    run = make_run(tmp_path, moves_at=(20,))  # never moves within the 10 ticks
    c = check_run(run)
    assert c.outcome == Outcome.FAILED
    assert c.problems == [f"{run}: no probe value changed on rank {r} during the burst (ticks 5–8)" for r in (0, 1)]


def test_changes_before_the_burst_only_do_not_count_for_it(tmp_path: Path):
    # a shared server's run folder holds the earlier runs' ticks too: their changes are not this burst's
    c = check_run(make_run(tmp_path, moves_at=(2, 3)))
    assert c.outcome == Outcome.FAILED and all("during the burst (ticks 5–8)" in p for p in c.problems)
    assert check_run(make_run(tmp_path, moves_at=(2, 8))).outcome == Outcome.OK  # the start of tick 8 shows tick 7


def test_a_run_with_the_digest_off_or_no_ledger_is_skipped_with_a_reason(tmp_path: Path):
    off = check_run(make_run(tmp_path, digest=False))
    assert off.outcome == Outcome.SKIPPED and "digest off" in off.reason
    none = check_run(make_run(tmp_path, ledger=False))
    assert none.outcome == Outcome.SKIPPED and "no ledger" in none.reason


def test_a_run_from_before_the_digest_reads_no_digest_recorded_and_is_skipped(tmp_path: Path):
    c = check_run(make_run(tmp_path, states=False, digest_in_plan=False))
    assert c.outcome == Outcome.SKIPPED and c.reason.startswith("no digest recorded") and "equal" not in c.reason
    other = check_run(make_run(tmp_path, states=False, release="0.5.9"))  # a release without a probe file
    assert other.outcome == Outcome.SKIPPED and "release 0.5.9" in other.reason


def test_a_release_with_a_probe_file_that_recorded_no_digest_fails(tmp_path: Path):
    run = make_run(tmp_path, states=False)
    c = check_run(run)
    assert c.outcome == Outcome.FAILED
    assert f"{run}: sglang 0.5.23 has a probe file but rank 1 recorded no state digest" in c.problems[1]


def test_runs_that_fired_an_injection_or_did_not_succeed_are_not_held_to_it(tmp_path: Path):
    fired = check_run(make_run(tmp_path, diverge=True, fired_at=T0 + 6))
    assert fired.outcome == Outcome.NOT_CLEAN and "`leak` on rank 0" in fired.reason
    hung = check_run(make_run(tmp_path, diverge=True, verdict=DEADLOCKED))
    assert hung.outcome == Outcome.NOT_CLEAN and hung.reason == DEADLOCKED


def test_on_a_shared_server_a_fire_of_an_earlier_run_does_not_make_this_one_unclean(tmp_path: Path):
    # the session's fire log is copied into every run folder; this run began when its session.json was written
    c = check_run(make_run(tmp_path, session=True, fired_at=T0 + 6))  # T0 is long before session.json's mtime
    assert c.outcome == Outcome.OK, (c.reason, c.problems)


def test_a_pd_servers_folder_is_checked_on_its_own_ledgers_within_its_run_folders_burst(tmp_path: Path):
    run = make_run(tmp_path)
    role = make_run(tmp_path, moves_at=(2, 3), at=run / "servers" / "prefill", requests=False)
    c = check_run(role)
    assert c.outcome == Outcome.FAILED and c.problems[0] == \
        f"{role}: no probe value changed on rank 0 during the burst (ticks 5–8)"  # the run's burst, not the ledger's
    assert state_check.run_folders([tmp_path], 0.0, set()) == [run.resolve(), role.resolve()]


def test_run_folders_finds_each_new_verdict_once(tmp_path: Path):
    a = make_run(tmp_path)
    seen: set = set()
    assert state_check.run_folders([tmp_path], 0.0, seen) == [a.resolve()]
    assert state_check.run_folders([tmp_path], 0.0, seen) == []
    assert state_check.run_folders([tmp_path], os.path.getmtime(a / "verdict.json") + 1, set()) == []


def test_a_marked_test_whose_clean_run_diverged_fails_with_the_folder_the_probe_and_the_rank(tmp_path: Path):
    """The wiring: tests/conftest.py loaded as a plugin into a child pytest; a test marked ``sglang`` that leaves a
    diverged clean run fails; one marked nothing that leaves the same folder passes; the summary names both."""
    (tmp_path / "test_child.py").write_text(
        "import pytest\nimport test_state_check as t\n\n"
        "@pytest.mark.sglang\ndef test_marked(tmp_path):\n    t.make_run(tmp_path, diverge=True)\n\n"
        "def test_unmarked(tmp_path):\n    pass\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-q", "-p", "no:cacheprovider",
                        "--basetemp", str(tmp_path / "bt"), "-W", "ignore::pytest.PytestUnknownMarkWarning",
                        str(tmp_path / "test_child.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    assert "1 failed, 1 passed" in out, out[-3000:]
    assert "FAILED" in out and "test_marked" in out
    assert "state diverged at tick 7: probe `req_to_token_pool.available` rank 0 = 7, rank 1 = 8" in out
    assert "lockstep state check of clean runs" in out and "failed: " in out
