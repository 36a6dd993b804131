"""`repro run` end to end on real SGLang TP=2 on the CPU testbed (issue 4's "Done when").

- `hang`: the smoke scenario's armed variant DEADLOCKS real rank processes; the harness is interrupted (SIGINT)
  mid-burst; the harness is SIGKILLed and `repro cleanup` ends the tree it left. Each owns a server.
- `sglang`: the checker self-test variants (none hangs) share ONE server through `repro.runner.run_many`.
Every test checks that none of the server processes it recorded (pid + create time) is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from repro.evidence import read_json, read_jsonl
from repro.procs import alive, load_procs
from repro import testbed

REPO = Path(__file__).resolve().parent.parent
SMOKE = REPO / "scenarios" / "sglang" / "smoke_extra_allreduce.toml"
SELFTEST = REPO / "scenarios" / "sglang" / "checker_selftest.toml"
HARNESS_S = 900  # bound on one harness subprocess on a loaded 2-core box (start-up alone can take 2 min)


def _repro(*args: str, timeout: float = HARNESS_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "repro", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _assert_tree_gone(run_dir: Path) -> None:
    procs = load_procs(run_dir / "processes.json")
    assert procs, f"{run_dir}/processes.json lists no server process"
    left = [p for p in procs if alive(p)]
    assert not left, f"server processes left running: {[(p.pid, p.title) for p in left]}"


@pytest.mark.hang
def test_smoke_extra_allreduce_deadlocks_with_both_ranks_captured(tmp_path):
    r = _repro("run", str(SMOKE), "--variant", "extra_collective", "--evidence-dir", str(tmp_path), "--json", "--expect", "deadlock")
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"
    out = json.loads(r.stdout)
    assert out["verdict"] == "DEADLOCKED"
    run_dir = Path(out["evidence"])
    _assert_tree_gone(run_dir)
    verdict = read_json(run_dir / "verdict.json")
    assert verdict["verdict"] == "DEADLOCKED" and verdict["exit_code"] == 0 and not verdict["partial"]
    # env.json names the engine and the version the injector saw in the server (issue 30); `sglang` stays for old readers
    env = read_json(run_dir / "env.json")
    assert env["engine"] == "sglang" and env["engine_version"] == env["sglang"] == testbed.SGLANG_VERSION, env
    # the wedged tree is gone within 2 s of verdict.json (issue 36): SIGKILL after repro.runner.WEDGED_STOP_GRACE_S,
    # not the 10 s grace a rank blocked in a collective never uses
    teardown = read_json(run_dir / "teardown.json")
    assert teardown["wedged"] is True and teardown["left_running"] == [], teardown
    assert teardown["time"] - (run_dir / "verdict.json").stat().st_mtime <= 2.0, teardown
    ranks = {r["rank"]: r for r in out["analysis"]["ranks"]}
    assert ranks[0]["state"] == "collective" and ranks[0]["op"] == "all_reduce" and ranks[0]["injected"]
    assert ranks[1]["state"] == "collective" and not ranks[1]["injected"]
    assert any("run_batch" in f or "event_loop" in f for f in ranks[0]["caller_chain"])
    stacks = sorted(p.name for p in (run_dir / "stacks").glob("rank*.txt"))
    assert any(n.startswith("rank0") for n in stacks) and any(n.startswith("rank1") for n in stacks)
    report = (run_dir / "REPORT.md").read_text()
    assert report.splitlines()[0].startswith("# DEADLOCKED")
    assert "| TP0 | collective | all_reduce |" in report and "| TP1 | collective |" in report
    assert "<details>" in report
    # the fire log says where it fired: rank 0 only, once
    fires = [e for f in (run_dir / "injector").glob("fires-*.jsonl") for e in read_jsonl(f) if e.get("event") == "fire"]
    assert [e["rank"] for e in fires] == [0]
    # the ledger proved it (repro.proof): declared without waiting stall_s (8 s) for the stall rule; the latency goal
    # itself is measured in benchmarks/ledger_proof.py, not here
    assert verdict["proof"]["kind"] == "missing_partner" and verdict["reason"].startswith("Ledger proof")
    assert verdict["timings"]["last_progress_to_verdict_s"] < 8.0


@pytest.mark.sglang
def test_checker_selftest_slow_is_not_stuck_and_unentered_site_is_inconclusive(tmp_path):
    from repro.runner import RunOptions, run_many

    names = ["control", "slow_ticks", "one_long_stall", "site_never_entered"]
    results = dict(zip(names, run_many(RunOptions(scenario_path=SELFTEST, evidence_root=tmp_path), names)))
    for name, res in results.items():
        assert res.exit_code == 0, f"{name}: {res.verdict.verdict}: {res.verdict.reason} ({res.evidence})"
    session = Path(read_json(results["control"].evidence / "session.json")["session"])
    _assert_tree_gone(session)

    control = results["control"]
    assert control.verdict.verdict == "ALL REQUESTS SUCCEEDED" and control.requests_ok == control.requests_total == 4
    assert any("fired 0×" in n for n in control.verdict.notes)  # entered on every rank, zero fires

    slow = results["slow_ticks"]
    assert slow.verdict.verdict == "ALL REQUESTS SUCCEEDED"
    assert slow.timings["captures"] == 0 and not list((slow.evidence / "stacks").glob("*.txt"))
    assert slow.timings["burst_s"] > 8.0  # the delays added up to more than stall_s, yet no capture was taken
    fired = [e for f in (slow.evidence / "injector").glob("fires-*.jsonl") for e in read_jsonl(f)
             if e.get("event") == "fire" and e.get("id") == "delay_each_batch"]
    assert len(fired) >= 11 and {e["rank"] for e in fired} == {0}

    long = results["one_long_stall"]
    assert long.verdict.verdict == "ALL REQUESTS SUCCEEDED"
    stalls = read_json(long.evidence / "stalls.json")
    assert stalls and not any(s["deadlocked"] for s in stalls)
    assert "busy" in stalls[0]["reason"] and "0" in stalls[0]["reason"]

    never = results["site_never_entered"]
    assert never.verdict.verdict == "INCONCLUSIVE"
    assert "check_prefetch_progress" in never.verdict.reason and "never entered" in never.verdict.reason


def _start_harness(tmp_path: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "repro", "run", str(SMOKE), "--variant", "extra_collective", "--evidence-dir", str(tmp_path)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )


def _wait_for_burst(tmp_path: Path, harness: subprocess.Popen, timeout_s: float = HARNESS_S) -> Path:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert harness.poll() is None, f"harness exited early ({harness.returncode}): {harness.stdout.read()[-3000:]}"
        for run_dir in tmp_path.glob("smoke_extra_allreduce/*-extra_collective"):
            if any(e.get("event") == "sent" for e in read_jsonl(run_dir / "requests.jsonl")):
                return run_dir
        time.sleep(0.2)
    raise AssertionError("the burst never started")


def _end(harness: subprocess.Popen) -> None:
    if harness.poll() is None:
        os.killpg(harness.pid, signal.SIGKILL)
        harness.wait(10)


@pytest.mark.hang
def test_interrupting_the_harness_mid_burst_tears_down_and_keeps_partial_evidence(tmp_path):
    harness = _start_harness(tmp_path)
    try:
        run_dir = _wait_for_burst(tmp_path, harness)
        harness.send_signal(signal.SIGINT)
        out, _ = harness.communicate(timeout=120)
        assert harness.returncode == 130, out[-3000:]
    finally:
        _end(harness)
    _assert_tree_gone(run_dir)
    assert read_json(run_dir / "run.json")["status"] == "interrupted"
    verdict = read_json(run_dir / "verdict.json")
    assert verdict["partial"] and verdict["verdict"] == "INCONCLUSIVE" and "interrupted" in verdict["reason"]


@pytest.mark.hang
def test_cleanup_ends_the_tree_of_a_sigkilled_harness(tmp_path):
    harness = _start_harness(tmp_path)
    run_dir = None
    try:
        run_dir = _wait_for_burst(tmp_path, harness)
        os.killpg(harness.pid, signal.SIGKILL)  # the harness only: the server runs in its own session
        harness.wait(10)
        procs = load_procs(run_dir / "processes.json")
        assert any(alive(p) for p in procs), "the server should have outlived the SIGKILLed harness"
        assert read_json(run_dir / "run.json")["status"] == "running"  # reads as partial, not as a result
        r = _repro("cleanup", str(run_dir), timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "stopped" in r.stdout
    finally:
        _end(harness)
        if run_dir is not None:  # whatever happened above, never leave the server behind (by pid + create time)
            for p in load_procs(run_dir / "processes.json"):
                if alive(p):
                    os.kill(p.pid, signal.SIGKILL)
    _assert_tree_gone(run_dir)
    r = _repro("cleanup", str(run_dir), timeout=60)
    assert r.returncode == 0 and "nothing to clean" in r.stdout
