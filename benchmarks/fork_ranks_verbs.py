"""The verbs a person waits on, spawned ranks vs ranks forked from the launcher (``REPRO_FORK_RANKS=1``), in one run.

Issue 36's done-when asks for the demo on a warm testbed, ``repro compare`` of one #30760 variant and the hunt's
trials/hour, each before/after on the same box with the same plan. This runs each chosen verb once per arm per
repeat, the arms alternating (spawn, fork, then fork, spawn, …) so a drift of the box's load falls on both, each as a
child in its own process group with its own evidence root; the only difference between the arms is
``REPRO_FORK_RANKS`` in the child's environment (``1``, or removed). Per run it records: wall seconds, exit code, the
load average (1-min) before and after, anything of the run left running (every process whose command line or
environment names its evidence root), and for the hunt the trials run, their verdicts and trials/hour (over the
whole hunt and over its trial phase, as benchmarks/hunt_restarts.py counts them).

    python benchmarks/fork_ranks_verbs.py [--verbs demo,compare,hunt] [--repeats 1] [--hunt-budget-min 5]
        [--evidence-dir /tmp/repro-fork-verbs] [--json-out FILE]

Run it under /work/bin/server-slot (it starts real servers, one at a time). Prints one JSON list and markdown rows
(one per run, then the medians per verb and arm).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # runnable from a checkout without `pip install -e .`

from repro.procs import processes_mentioning  # noqa: E402

SCEN_30760 = "scenarios/sglang/hicache_prefetch_30760.toml"
PATCH_30760 = "patch:scenarios/sglang/patches/sglang-0.5.23-30760-bulk-prefetch.patch"
HUNT_SUBSET = ["--only", "get_num_allocatable_reqs", "--rank", "0"]  # 8 trials; the two zero_once rows deadlock
GRACE_S = 60.0


def command(verb: str, root: Path, hunt_budget_min: float) -> list[str]:
    """The verb's command line (the README's), its evidence under ``root``."""
    base = [sys.executable, "-m", "repro.cli"]
    if verb == "demo":
        return [*base, "demo", "--evidence-dir", str(root), "--json"]
    if verb == "compare":
        return [*base, "compare", SCEN_30760, "--variant", "allocatable_drift", "--before", "installed",
                "--after", PATCH_30760, "--evidence-dir", str(root), "--json"]
    if verb == "hunt":
        return [*base, "hunt", SCEN_30760, "--budget-min", str(hunt_budget_min), *HUNT_SUBSET,
                "--evidence-dir", str(root), "--json"]
    raise SystemExit(f"unknown verb {verb!r}: expected demo, compare or hunt")


def load1() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def hunt_summary(root: Path, wall_s: float) -> dict:
    """Trials and trials/hour from the hunt's own ``hunt.jsonl`` (as benchmarks/hunt_restarts.py)."""
    hunts = sorted(root.glob("*/*-hunt"))
    if not hunts:
        return {}
    lines = [json.loads(x) for x in (hunts[-1] / "hunt.jsonl").read_text().splitlines() if x.strip()]
    trials = [x for x in lines if x.get("event") == "trial"]
    ran = [x for x in trials if x["verdict"] != "NOT RUN"]
    t_session = next((x["time"] for x in lines if x.get("event") == "session"), None)
    t_end = next((x["time"] for x in reversed(lines) if x.get("event") == "end"), None)
    phase = (t_end - t_session) if (t_session and t_end) else None
    return {"folder": str(hunts[-1]), "trials": len(ran), "verdicts": dict(Counter(x["verdict"] for x in trials)),
            "trials_per_hour": round(len(ran) / wall_s * 3600, 1),
            "trial_phase_s": round(phase, 1) if phase else None,
            "trials_per_hour_trial_phase": round(len(ran) / phase * 3600, 1) if phase else None}


def launches(root: Path) -> list[dict]:
    """Per run folder under ``root`` (one server launch each, or a variant on a shared server): its verdict, seconds
    to healthy and to the verdict (``verdict.json`` timings) and its teardown (``teardown.json``: grace, wedged, stop)."""
    rows = []
    for vf in sorted(root.glob("**/verdict.json"), key=lambda f: f.stat().st_mtime):
        try:
            v = json.loads(vf.read_text())
        except ValueError:
            continue
        t = v.get("timings") or {}
        tf = vf.parent / "teardown.json"
        td = json.loads(tf.read_text()) if tf.exists() else {}
        rows.append({"run": vf.parent.name, "verdict": v.get("verdict"), "healthy_s": t.get("healthy_s"),
                     "phases": log_phases(vf.parent),
                     "to_verdict_s": t.get("to_verdict_s"), "teardown": {k: td.get(k) for k in ("grace_s", "wedged", "stop_s")}
                     if td else None})
    return rows


# sglang 0.5.23's log lines that mark the start-up phases (as benchmarks/startup_phases.py's PHASES); each line is
# stamped by sglang to the second ("[2026-12-06 08:25:32] ..."), so these phases are ±1 s
LOG_PHASES = [("launcher imports done (server_args line)", re.compile(r"server_args=")),
              ("first rank line", re.compile(r"\bTP\d\]")),
              ("weights loaded (dummy)", re.compile(r"Load weight end")),
              ("KV pool allocated", re.compile(r"KV Cache is allocated")),
              ("Uvicorn listening", re.compile(r"Uvicorn running on")),
              ("warm-up done", re.compile(r"The server is fired up"))]
_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")


def log_phases(run_dir: Path) -> dict:
    """Seconds from the launcher's start (``processes.json`` root ``create_time``) to the first log line of each
    phase in the run's ``server.log`` (sglang's own stamps, UTC, whole seconds); {} when either file is missing."""
    import calendar

    try:
        t0 = json.loads((run_dir / "processes.json").read_text())["root"]["create_time"]
        lines = (run_dir / "server.log").read_text(errors="replace").splitlines()
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    out: dict = {}
    for ln in lines:
        m = _STAMP.match(ln)
        if not m:
            continue
        t = calendar.timegm(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"))
        for name, pat in LOG_PHASES:
            if name not in out and pat.search(ln):
                out[name] = round(t - t0, 1)
    return out


def one(verb: str, arm: str, i: int, args: argparse.Namespace) -> dict:
    root = (args.evidence_dir / f"{verb}-{arm}-{i}").resolve()
    cmd = command(verb, root, args.hunt_budget_min)
    env = {k: v for k, v in os.environ.items() if k != "REPRO_FORK_RANKS"}
    if arm == "fork":
        env["REPRO_FORK_RANKS"] = "1"
    load0 = load1()
    t0 = time.time()
    child = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        try:
            out, err = child.communicate(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            out, err = child.communicate()
    except KeyboardInterrupt:
        os.killpg(child.pid, signal.SIGINT)
        child.wait(GRACE_S)
        raise
    wall = time.time() - t0
    time.sleep(1.0)
    s: dict = {"verb": verb, "arm": arm, "i": i, "rc": child.returncode, "wall_s": round(wall, 1),
               "load_before": load0, "load_after": load1(), "left_running": [p.pid for p in processes_mentioning(root)],
               "command": " ".join(["repro", *cmd[3:]])}
    try:
        s["json"] = json.loads(out) if out.strip() else None
    except ValueError:
        s["json"] = None
    s["launches"] = launches(root)
    if verb == "hunt":
        s.update(hunt_summary(root, wall))
    if child.returncode not in (0,):
        s["stderr_tail"] = err[-1500:]
    return s


def verdicts(s: dict) -> str:
    """A short verdict cell: the demo's / compare's two verdicts, the hunt's counts."""
    j = s.get("json")
    if s["verb"] == "hunt":
        return ", ".join(f"{k} {v}" for k, v in sorted(s.get("verdicts", {}).items()))
    rows = s.get("launches") or []
    if rows:
        return " / ".join(f"{r['verdict']} (healthy {r['healthy_s']:.0f} s)" if r.get("healthy_s") else str(r["verdict"])
                          for r in rows)
    return "?" if j is None else str(j)[:80]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verbs", default="demo,compare,hunt")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--first-repeat", type=int, default=0, help="index of the first repeat (a later run adds repeats "
                    "to an earlier one's folders: index 1 runs fork first)")
    ap.add_argument("--hunt-budget-min", type=float, default=5.0)
    ap.add_argument("--timeout-s", type=float, default=1500.0)
    ap.add_argument("--evidence-dir", type=Path, default=Path("/tmp/repro-fork-verbs"))
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--from-json", type=Path, default=None,
                    help="run nothing: render the table of an earlier --json-out (its folders re-read under --evidence-dir)")
    args = ap.parse_args()
    out: list[dict] = []
    if args.from_json:
        out = json.loads(args.from_json.read_text())
        for s in out:
            s["launches"] = launches((args.evidence_dir / f"{s['verb']}-{s['arm']}-{s['i']}").resolve())
            if s["verb"] == "hunt" and "trials" not in s:
                s.update(hunt_summary((args.evidence_dir / f"hunt-{s['arm']}-{s['i']}").resolve(), s["wall_s"]))
    for verb in [] if args.from_json else [v.strip() for v in args.verbs.split(",") if v.strip()]:
        for i in range(args.first_repeat, args.first_repeat + args.repeats):
            for arm in (("spawn", "fork") if i % 2 == 0 else ("fork", "spawn")):
                s = one(verb, arm, i, args)
                out.append(s)
                print(json.dumps({k: v for k, v in s.items() if k != "json"}), file=sys.stderr, flush=True)
                if args.json_out:
                    args.json_out.write_text(json.dumps(out, indent=1))
    if not args.from_json:
        print(json.dumps(out, indent=1))
    print("| verb | arm | # | exit | wall | verdicts | trials/h (whole; trial phase) | load before → after | left running |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in out:
        tph = f"{s.get('trials_per_hour', '')}; {s.get('trials_per_hour_trial_phase', '')}" if s["verb"] == "hunt" else ""
        print(f"| {s['verb']} | {s['arm']} | {s['i']} | {s['rc']} | {s['wall_s']:.0f} s | {verdicts(s)} | {tph} | "
              f"{s['load_before']:.1f} → {s['load_after']:.1f} | {len(s['left_running'])} |")
    # start-up phases per launch (a compare side, a demo variant: each its own server and server.log), by arm
    for arm in ("spawn", "fork"):
        # demo and compare: one launch per run folder; a hunt's trial folders share servers (their logs hold several)
        rows = [r for s in out if s["arm"] == arm and s["verb"] != "hunt" for r in s.get("launches") or []
                if r.get("phases")]
        if not rows:
            continue
        print(f"\n{arm}: phase (s from the launcher's start; sglang's stamps, ±1 s) | median | min | max | n")
        for name, _ in LOG_PHASES:
            v = [r["phases"][name] for r in rows if name in r["phases"]]
            if v:
                print(f"| {name} | {statistics.median(v):.1f} | {min(v):.1f} | {max(v):.1f} | {len(v)} |")
        h = [r["healthy_s"] for r in rows if r.get("healthy_s")]
        if h:
            print(f"| healthy_s (the harness's, from its Popen) | {statistics.median(h):.1f} | {min(h):.1f} | {max(h):.1f} | {len(h)} |")
    for verb in dict.fromkeys(s["verb"] for s in out):
        for arm in ("spawn", "fork"):
            w = [s["wall_s"] for s in out if s["verb"] == verb and s["arm"] == arm]
            if w:
                print(f"| {verb} | {arm} | median of {len(w)} | | {statistics.median(w):.0f} s | | | | |")
    return 0 if all(not s["left_running"] for s in out) else 1


if __name__ == "__main__":
    sys.exit(main())
