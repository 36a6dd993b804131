"""A rank of a real SGLang TP=2 server killed with SIGKILL mid-burst is named, with its pid and why (own server).

The control variant (nothing fires) runs a long burst; as soon as the first request is sent, the test kills the
``sglang::scheduler_TP1`` process the run recorded. The verdict must say "rank 1 (pid …) died", not "requests
errored", and neither the verdict nor the ledger diagnosis may say that rank 1 waits anywhere.
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

from repro.procs import alive, load_procs

REPO = Path(__file__).resolve().parent.parent
SMOKE = REPO / "scenarios" / "sglang" / "smoke_extra_allreduce.toml"
HARNESS_S = 900


@pytest.mark.hang
def test_a_rank_killed_mid_burst_is_named_with_its_pid_and_never_waits(tmp_path: Path):
    ev = tmp_path / "ev"
    proc = subprocess.Popen([sys.executable, "-m", "repro", "run", str(SMOKE), "--variant", "control", "--requests", "400",
                             "--evidence-dir", str(ev), "--json"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    killed = None
    try:
        deadline = time.monotonic() + HARNESS_S
        while killed is None and time.monotonic() < deadline and proc.poll() is None:
            for req in ev.glob("*/*/requests.jsonl"):
                if req.stat().st_size > 0:
                    tp1 = [p for p in load_procs(req.parent / "processes.json") if p.title.endswith("scheduler_TP1")]
                    assert tp1, "TP1 not in processes.json"
                    os.kill(tp1[0].pid, signal.SIGKILL)
                    killed = tp1[0]
            time.sleep(0.05)
        out, err = proc.communicate(timeout=HARNESS_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert killed is not None, "the burst never started"
    assert proc.returncode == 4, f"exit {proc.returncode}\n{out}\n{err[-3000:]}"
    res = json.loads(out)
    assert f"rank 1 (pid {killed.pid}) died" in res["reason"], res["reason"]
    assert "requests errored" not in res["reason"] and "waits" not in res["reason"].split("server log tail")[0]
    run_dir = Path(res["evidence"])
    report = (run_dir / "REPORT.md").read_text()
    assert f"rank 1 (pid {killed.pid}) died" in report
    assert "rank 1 never did and waits" not in report
    left = [p for p in load_procs(run_dir / "processes.json") if alive(p)]
    assert not left, f"server processes left running: {[(p.pid, p.title) for p in left]}"
