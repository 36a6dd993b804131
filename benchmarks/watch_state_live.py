"""``repro watch --ledger-dir`` on a real SGLang TP=2 server (CPU testbed) that leaks KV slots on rank 0 and then
deadlocks: when the live state-divergence warning comes, when the hang line comes after the ledger record that
completes the proof, and how fast a second ``watch --once`` declares the already hung server.

Starts one real server: run it under the shared lock, with a timeout::

    flock /tmp/repro-server.lock timeout 600 python benchmarks/watch_state_live.py --out /tmp/watch-state

Steps: ``repro serve scenarios/sglang/state_leak_then_hang.toml`` (unarmed); ``repro watch --ledger-dir
<serve>/injector --interval 2 --probe-timeout 5 --failures 2``; two healthy probe rounds; ``repro arm``; wait for the
watch's evidence; then ``repro watch --once`` on the hung server; SIGTERM to each process group; ``repro cleanup``.
Prints one JSON line: seconds from the arm to the ``state_divergence`` line and to the ``hang`` line, whether the
warning came first, ``declared_after_proof_record`` (hang.json), the ``--once`` exit code and wall time. Copy the
numbers into ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCENARIO = REPO / "scenarios" / "sglang" / "state_leak_then_hang.toml"


def _popen(env: dict, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "repro.cli", *args], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            start_new_session=True, env=env, **kw)


def _stop(p, wait_s: float) -> None:
    if p is None or p.poll() is not None:
        return
    os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the serve and watch evidence")
    ap.add_argument("--serve-timeout-s", type=float, default=400.0)
    a = ap.parse_args()
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="4000")
    serve = watch = None
    ev = None
    result: dict = {}
    try:
        serve = _popen(env, "serve", str(SCENARIO), "--variant", "leak_then_hang", "--evidence-dir", str(out / "serve"),
                       stderr=open(out / "serve.stderr", "w"))
        url = None
        end = time.time() + a.serve_timeout_s
        while time.time() < end and (url is None or ev is None):
            line = serve.stdout.readline()
            if not line:
                if serve.poll() is not None:
                    print(json.dumps({"error": f"repro serve exited {serve.returncode}"}))
                    return 1
                continue
            if line.startswith("serving "):
                url = line.split()[1]
            if line.startswith("evidence: "):
                ev = sorted((out / "serve").glob("*/*/serve.json"))[-1].parent
        if url is None or ev is None:
            print(json.dumps({"error": "repro serve did not report its URL in time"}))
            return 1
        info = json.loads((ev / "serve.json").read_text())
        watch = _popen(env, "watch", "--url", url, "--interval", "2", "--probe-timeout", "5", "--failures", "2",
                       "--pid-root", str(info["pid"]), "--ledger-dir", str(ev / "injector"),
                       "--evidence-dir", str(out / "watch"), stderr=open(out / "watch.stderr", "w"))
        events: list[dict] = []

        def reader() -> None:
            for ln in watch.stdout:
                try:
                    e = json.loads(ln)
                except ValueError:
                    continue
                e["_t"] = time.time()
                events.append(e)

        threading.Thread(target=reader, daemon=True).start()
        end = time.time() + 60
        while time.time() < end and len([e for e in events if e["event"] == "probe"]) < 2:
            time.sleep(0.2)
        t_arm = time.time()
        arm = subprocess.run([sys.executable, "-m", "repro.cli", "arm", str(ev)], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=60)
        end = time.time() + 90
        while time.time() < end and not [e for e in events if e["event"] == "evidence"]:
            time.sleep(0.2)
        first = {}
        for e in events:
            first.setdefault(e["event"], e)
        st, hang, evid = first.get("state_divergence"), first.get("hang"), first.get("evidence")
        hang_json = json.loads((Path(evid["path"]) / "hang.json").read_text()) if evid and evid.get("path") else {}
        result = {
            "arm_rc": arm.returncode,
            "state_divergence": st and {"tick": st["tick"], "fields": st["fields"]},
            "arm_to_state_warning_s": round(st["_t"] - t_arm, 3) if st else None,
            "arm_to_hang_line_s": round(hang["_t"] - t_arm, 3) if hang else None,
            "warning_before_hang_line": bool(st and hang and events.index(st) < events.index(hang)),
            "declared_after_proof_record_s": (hang_json.get("timings_s") or {}).get("declared_after_proof_record"),
            "verdict": evid and evid.get("verdict"),
        }
        (out / "events.json").write_text(json.dumps(events))
        _stop(watch, 30)
        watch = None
        t0 = time.time()
        once = subprocess.run([sys.executable, "-m", "repro.cli", "watch", "--url", url, "--once", "--probe-timeout", "5",
                               "--pid-root", str(info["pid"]), "--ledger-dir", str(ev / "injector"),
                               "--evidence-dir", str(out / "watch-once")],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        once_events = [json.loads(x) for x in once.stdout.splitlines() if x.startswith("{")]
        result.update(once_rc=once.returncode, once_wall_s=round(time.time() - t0, 3),
                      once_events=[e["event"] for e in once_events if e["event"] != "probe"])
    finally:
        _stop(watch, 30)
        _stop(serve, 120)
        if ev is not None:
            subprocess.run([sys.executable, "-m", "repro.cli", "cleanup", str(ev)], cwd=REPO, env=env, timeout=120,
                           capture_output=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
