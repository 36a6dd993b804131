"""The full default hunt catalogue on the CPU testbed (issue 8's budget benchmark), and an interrupt check.

Runs ``repro hunt BASE --json`` (every decision point, every perturbation, every rank; no ``--sites``) as a child in
its own process group, measures the wall time, counts the trials by verdict, and checks that nothing of the hunt is
left running afterwards (every process whose command line or environment names the evidence root). With
``--interrupt-after S`` it sends SIGINT to the hunt S seconds in and checks the same, plus that HUNT.md/hunt.jsonl
kept the trials run so far and say ``interrupted``.

    python benchmarks/hunt_full.py [--scenario scenarios/sglang/hicache_prefetch_30760.toml] [--budget-min 30]
        [--evidence-dir /tmp/repro-hunt-full] [--ref installed] [--interrupt-after 400] [--json-out hunt.json]

Prints one JSON summary line and a markdown table row to paste into benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # runnable from a checkout without `pip install -e .`

from repro.procs import processes_mentioning  # noqa: E402
BASE = REPO / "scenarios" / "sglang" / "hicache_prefetch_30760.toml"
GRACE_S = 120.0  # seconds the interrupted hunt may take to tear its server down before it is killed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", type=Path, default=BASE)
    ap.add_argument("--budget-min", type=float, default=30.0)
    ap.add_argument("--evidence-dir", type=Path, default=Path("/tmp/repro-hunt-full"))
    ap.add_argument("--ref", default="installed")
    ap.add_argument("--interrupt-after", type=float, default=None, help="send SIGINT after this many seconds")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more `repro hunt` options")
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args()
    root = args.evidence_dir.resolve()
    cmd = [sys.executable, "-m", "repro.cli", "hunt", str(args.scenario), "--budget-min", str(args.budget_min),
           "--evidence-dir", str(root), "--ref", args.ref, "--json", *args.extra]
    t0 = time.time()
    child = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    interrupted_at = None
    try:
        if args.interrupt_after is not None:
            try:
                child.wait(timeout=args.interrupt_after)
            except subprocess.TimeoutExpired:
                interrupted_at = time.time() - t0
                child.send_signal(signal.SIGINT)
        try:
            stdout, stderr = child.communicate(timeout=(GRACE_S if interrupted_at else args.budget_min * 60 + 1800))
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            stdout, stderr = child.communicate()
            print(f"hunt did not end in time; process group {child.pid} killed", file=sys.stderr)
    except KeyboardInterrupt:
        os.killpg(child.pid, signal.SIGINT)
        child.wait(GRACE_S)
        raise
    wall = time.time() - t0
    time.sleep(2.0)
    left = processes_mentioning(root)
    summary: dict = {"rc": child.returncode, "wall_s": round(wall, 1), "left_running": left,
                     "interrupted_at_s": round(interrupted_at, 1) if interrupted_at else None}
    if stdout.strip().startswith("{"):
        out = json.loads(stdout)
        res = out["results"]
        summary.update({
            "folder": out["folder"], "rows": len(out["rows"]), "trials": len(res),
            "verdicts": dict(Counter(r["verdict"] for r in res)),
            "deadlocks": [{"trial": r["trial"], "family": (r["diagnosis"] or {}).get("family"),
                           "collective": (r["diagnosis"] or {}).get("collective"), "known": (r["diagnosis"] or {}).get("known")}
                          for r in res if r["verdict"] == "DEADLOCKED"],
            "budget_exhausted": out["budget_exhausted"],
        })
    else:
        summary["stderr_tail"] = stderr[-2000:]
        hunts = sorted(root.glob("*/*-hunt"))
        if hunts:
            lines = [json.loads(x) for x in (hunts[-1] / "hunt.jsonl").read_text().splitlines()]
            summary["folder"] = str(hunts[-1])
            summary["trials_kept"] = sum(1 for x in lines if x["event"] == "trial")
            summary["end_status"] = next((x["status"] for x in reversed(lines) if x["event"] == "end"), None)
    print(json.dumps(summary, indent=1))
    if args.json_out:
        args.json_out.write_text(json.dumps(summary, indent=1))
    v = summary.get("verdicts", {})
    print(f"| {time.strftime('%Y-%m-%d')} | {summary.get('rows', '?')} | {summary.get('trials', summary.get('trials_kept', '?'))} | "
          f"{v.get('DEADLOCKED', 0)} | {v.get('ALL REQUESTS SUCCEEDED', 0)} | {v.get('INCONCLUSIVE', 0)} | {v.get('NOT RUN', 0)} | "
          f"{wall / 60:.1f} min | {len(left)} |")
    return 0 if not left else 1


if __name__ == "__main__":
    sys.exit(main())
