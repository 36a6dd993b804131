"""Trials/hour of `repro hunt` before and after the restart cut (the spare trial server), same subset, same machine.

Runs the same hunt twice, one after the other — ``--no-spare`` (before: a hang restarts the hung server) and
``--spare`` (after: the hunt swaps to a spare server launched in the background) — each as a child in its own
process group, and reports per run: wall time, trials by verdict, trials/hour over the whole hunt (baseline and
launches included, as benchmarks/RESULTS.md's 218 trials/h of issue 8) and over the trial phase alone (from the
trial server's folder to the end), the hangs/crashes, the swaps and the seconds waited for the spare, and whether
anything of the hunt was left running (every process whose command line or environment names the evidence root).

    python benchmarks/hunt_restarts.py [--scenario scenarios/sglang/hicache_prefetch_30760.toml]
        [--budget-min 6] [--evidence-dir /tmp/repro-hunt-restarts] [--order no-spare,spare]
        [--extra --only get_num_allocatable_reqs --rank 0]

Default subset: ``--only get_num_allocatable_reqs --rank 0`` (2 rows × 4 perturbations = 8 trials; the two
``zero_once`` rows deadlock, sglang#30760). Run it under the e2e lock. Prints one JSON summary and markdown rows.
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
SUBSET = ["--only", "get_num_allocatable_reqs", "--rank", "0"]
GRACE_S = 120.0


def one(mode: str, args: argparse.Namespace, extra: list[str]) -> dict:
    root = (args.evidence_dir / mode).resolve()
    cmd = [sys.executable, "-m", "repro.cli", "hunt", str(args.scenario), "--budget-min", str(args.budget_min),
           "--evidence-dir", str(root), "--json", f"--{mode}", *extra]
    t0 = time.time()
    child = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        try:
            stdout, stderr = child.communicate(timeout=args.budget_min * 60 + 600)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            stdout, stderr = child.communicate()
    except KeyboardInterrupt:
        os.killpg(child.pid, signal.SIGINT)
        child.wait(GRACE_S)
        raise
    wall = time.time() - t0
    time.sleep(2.0)
    s: dict = {"mode": mode, "command": " ".join(["repro", *cmd[3:]]), "rc": child.returncode, "wall_s": round(wall, 1),
               "left_running": processes_mentioning(root)}
    hunts = sorted(root.glob("*/*-hunt"))
    if not hunts:
        s["stderr_tail"] = stderr[-2000:]
        return s
    lines = [json.loads(x) for x in (hunts[-1] / "hunt.jsonl").read_text().splitlines()]
    trials = [x for x in lines if x["event"] == "trial"]
    run = [x for x in trials if x["verdict"] != "NOT RUN"]
    t_session = next((x["time"] for x in lines if x["event"] == "session"), None)
    t_end = next((x["time"] for x in reversed(lines) if x["event"] == "end"), time.time())
    rs = next((x for x in lines if x["event"] == "restarts"), {})
    s.update({
        "folder": str(hunts[-1]), "trials": len(run), "verdicts": dict(Counter(x["verdict"] for x in trials)),
        "hangs_or_crashes": [x["trial"] for x in run if x["verdict"] != "ALL REQUESTS SUCCEEDED"],
        "trials_per_hour": round(len(run) / wall * 3600, 1),
        "trial_phase_s": round(t_end - t_session, 1) if t_session else None,
        "trials_per_hour_trial_phase": round(len(run) / (t_end - t_session) * 3600, 1) if t_session else None,
        "swaps": rs.get("swaps", []), "plain_restarts": rs.get("plain_restarts"),
        "deadlocks_known": [(x.get("diagnosis") or {}).get("known") for x in run if x["verdict"] == "DEADLOCKED"],
        "end_status": next((x["status"] for x in reversed(lines) if x["event"] == "end"), None),
    })
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", type=Path, default=BASE)
    ap.add_argument("--budget-min", type=float, default=6.0)
    ap.add_argument("--evidence-dir", type=Path, default=Path("/tmp/repro-hunt-restarts"))
    ap.add_argument("--order", default="no-spare,spare", help="comma-separated: no-spare (before), spare (after)")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=None, help="`repro hunt` options (default: the subset above)")
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args()
    extra = args.extra if args.extra is not None else SUBSET
    out = [one(m.strip(), args, extra) for m in args.order.split(",") if m.strip()]
    print(json.dumps(out, indent=1))
    if args.json_out:
        args.json_out.write_text(json.dumps(out, indent=1))
    for s in out:
        v = s.get("verdicts", {})
        waited = sum(x["waited_s"] for x in s.get("swaps", []))
        print(f"| {s['mode']} | {s.get('trials', '?')} | {v.get('DEADLOCKED', 0)} | {v.get('ALL REQUESTS SUCCEEDED', 0)} | "
              f"{v.get('INCONCLUSIVE', 0)} | {v.get('NOT RUN', 0)} | {s['wall_s']:.0f} s | {s.get('trials_per_hour', '?')} | "
              f"{s.get('trials_per_hour_trial_phase', '?')} | {len(s.get('swaps', []))} swaps, waited {waited:.0f} s; "
              f"{s.get('plain_restarts') if s.get('plain_restarts') is not None else '—'} plain | {len(s['left_running'])} |")
    return 0 if all(not s["left_running"] for s in out) else 1


if __name__ == "__main__":
    sys.exit(main())
