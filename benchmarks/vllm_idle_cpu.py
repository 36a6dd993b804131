"""Does an idle vLLM worker spin in ``MessageQueue.dequeue``? CPU use of each ``VLLM::Worker_TP<k>`` after its last step.

vllm 0.32.0 ``distributed/device_communicators/shm_broadcast.py``: a reader that finds no new block calls
``SpinCondition.wait``, which only ``sched_yield``s (a busy loop) for ``busy_loop_s`` (1 s) after its last read and
then waits in a zmq poll. This measures it on the vLLM CPU testbed: one ``repro serve`` of the smoke's control
variant (nothing fires), one completion, then each worker's CPU time (user + system, psutil) in windows after the
answer, and one py-spy dump of each worker at the end (its innermost frames).

Prints one JSON object. Starts a real server: run it under the e2e lock. (Written in session 5 and not run yet:
the lock queue ran past that session's last start time; docs/vllm.md has what the source says.)

    python benchmarks/vllm_idle_cpu.py [--evidence-dir /tmp/vllm-idle]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from repro.targets.registry import get_adapter  # noqa: E402

SMOKE = REPO / "scenarios" / "vllm" / "smoke_extra_allreduce.toml"
WINDOWS = ((0.0, 0.5), (0.5, 1.0), (1.0, 1.5), (1.5, 3.0), (3.0, 6.0), (6.0, 10.0))


def _cpu(procs: dict[int, psutil.Process]) -> dict[int, float]:
    out = {}
    for k, p in procs.items():
        t = p.cpu_times()
        out[k] = t.user + t.system
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--evidence-dir", type=Path, default=Path("/tmp/vllm-idle"))
    args = ap.parse_args()
    serve = subprocess.Popen([sys.executable, "-m", "repro.cli", "serve", str(SMOKE), "--variant", "control",
                              "--evidence-dir", str(args.evidence_dir), "--json"], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    result: dict = {}
    try:
        info = None
        for line in serve.stdout:  # type: ignore[union-attr]
            if line.startswith("{") and json.loads(line).get("event") == "serving":
                info = json.loads(line)
                break
        if info is None:
            print(json.dumps({"error": f"repro serve exited {serve.wait()} before serving"}))
            return 1
        procs = {int(k): psutil.Process(v) for k, v in info["rank_pids"].items()}
        body = get_adapter("vllm").generate_body(list(range(1, 17)), 4, False)
        for _ in range(2):  # the first request compiles a kernel; measure after the second
            r = requests.post(info["url"] + "/v1/completions", json=body, timeout=300)
            r.raise_for_status()
        t_end = time.time()
        c0 = _cpu(procs)
        rows = []
        prev_t, prev = 0.0, c0
        for a, b in WINDOWS:
            time.sleep(max(0.0, t_end + b - time.time()))
            now = _cpu(procs)
            rows.append({"window_s": [a, b], "cpu_pct": {k: round(100 * (now[k] - prev[k]) / (b - prev_t), 1) for k in procs}})
            prev_t, prev = b, now
        dumps = {}
        for k, p in procs.items():
            d = subprocess.run(["py-spy", "dump", "--pid", str(p.pid)], capture_output=True, text=True, timeout=60)
            lines = (d.stdout or d.stderr).splitlines()
            at = next((i for i, ln in enumerate(lines) if ln.startswith("Thread") and "MainThread" in ln), -1)
            dumps[k] = [ln.strip() for ln in lines[at:at + 6]] if at >= 0 else lines[:6]
        result = {"after_last_answer": rows, "innermost_frames": dumps, "loadavg": os.getloadavg()}
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGTERM)
            try:
                serve.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
                serve.wait(timeout=30)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
