"""The discovering hunt on the CPU testbed (issue 16's budget benchmark): hand catalogue + discovered points.

Runs ``repro hunt BASE --discover --json [--no-hand-catalogue] [extra options]`` as a child in its own process
group (ended by process group on timeout or Ctrl-C), then reports from its hunt.jsonl / JSON:

- rows reached by the baseline and rows whose perturbation fired, split by where the point came from (hand /
  discovered), and the ratio (hand + discovered) / hand of fired rows — the issue's "at least double";
- discovery's precision (of the points added: reached, fired, deadlocked, desynced);
- trials by verdict, wall time, trials per hour, and, when the budget ended early (NOT RUN trials), the
  extrapolated wall time of the whole hunt: the trials run so far, their mean seconds per trial (restarts after
  hangs/crashes included) times every trial planned, plus the two launches;
- that nothing of the hunt is left running.

    python benchmarks/hunt_discover.py [--scenario scenarios/sglang/hicache_prefetch_30760.toml] [--budget-min 60]
        [--evidence-dir /tmp/repro-hunt-discover] [--no-hand] [--json-out out.json] [--extra --rank 0 ...]

The whole discovering hunt is the default (every point, every perturbation, both ranks). On a shared machine run it
under the e2e lock: ``flock /tmp/repro-e2e.lock python benchmarks/hunt_discover.py``.
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
GRACE_S = 120.0


def summarize(out: dict, wall_s: float) -> dict:
    """The benchmark's numbers from ``repro hunt --json`` output (see the module docstring)."""
    res = out["results"]
    ran = [r for r in res if r["verdict"] != "NOT RUN"]
    disc = out.get("discovery") or {}
    rows = disc.get("rows") or {}
    hand_fired = (rows.get("hand") or {}).get("fired", 0)
    all_fired = sum(e.get("fired", 0) for e in rows.values())
    s = {"wall_s": round(wall_s, 1), "rows_total": len(out["rows"]), "rows": rows,
         "fired_ratio_vs_hand": round(all_fired / hand_fired, 2) if hand_fired else None,
         "precision": disc.get("points"), "trials": len(res), "trials_run": len(ran),
         "verdicts": dict(Counter(r["verdict"] for r in res)),
         "trials_per_hour": round(len(ran) / (wall_s / 3600.0), 1) if wall_s else None,
         "deadlocks": [{"trial": r["trial"], "collective": (r["diagnosis"] or {}).get("collective"),
                        "known": (r["diagnosis"] or {}).get("known"), "by_construction": r["by_construction"]}
                       for r in res if r["verdict"] == "DEADLOCKED"],
         "budget_exhausted": out.get("budget_exhausted")}
    if ran and len(ran) < len(res):
        t = [r["time"] for r in ran if r.get("time")]
        span = (max(t) - min(t)) if len(t) > 1 else 0.0
        per = span / max(len(t) - 1, 1)
        s["extrapolated_min"] = round((wall_s + per * (len(res) - len(ran))) / 60.0, 1)
        s["mean_s_per_trial"] = round(per, 1)
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", type=Path, default=BASE)
    ap.add_argument("--budget-min", type=float, default=60.0)
    ap.add_argument("--evidence-dir", type=Path, default=Path("/tmp/repro-hunt-discover"))
    ap.add_argument("--no-hand", action="store_true", help="discovery alone (--no-hand-catalogue)")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more `repro hunt` options")
    args = ap.parse_args()
    root = args.evidence_dir.resolve()
    cmd = [sys.executable, "-m", "repro.cli", "hunt", str(args.scenario), "--discover", "--budget-min", str(args.budget_min),
           "--evidence-dir", str(root), "--json", *(["--no-hand-catalogue"] if args.no_hand else []), *args.extra]
    t0 = time.time()
    child = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = child.communicate(timeout=args.budget_min * 60 + 1800)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        stdout, stderr = child.communicate()
        print(f"hunt did not end in time; process group {child.pid} killed", file=sys.stderr)
    except KeyboardInterrupt:
        os.killpg(child.pid, signal.SIGINT)
        try:
            child.wait(GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
        raise
    wall = time.time() - t0
    time.sleep(2.0)
    left = processes_mentioning(root)
    summary: dict = {"rc": child.returncode, "command": " ".join(cmd[2:]), "left_running": left}
    if stdout.strip().startswith("{"):
        out = json.loads(stdout)
        summary["folder"] = out["folder"]
        summary.update(summarize(out, wall))
    else:
        summary["wall_s"] = round(wall, 1)
        summary["stderr_tail"] = stderr[-2000:]
    print(json.dumps(summary, indent=1))
    if args.json_out:
        args.json_out.write_text(json.dumps(summary, indent=1))
    return 0 if not left and child.returncode in (0, 3) else 1


if __name__ == "__main__":
    sys.exit(main())
