"""The full natural hunt on the CPU testbed (issue 35): ``repro hunt --natural`` over plain + HiCache (each prefetch
policy through the workload file's configs), with the storage-warm base scenario.

Runs ``repro hunt BASE --natural --json`` as a child in its own process group (wrap it in /work/bin/server-slot on a
shared box), measures the wall time and trials/hour, and prints per trial: nature, fires on the target rank, the
effect (the probe that moved and where it was reconciled, or the first divergent state) and the verdict — the table
for benchmarks/RESULTS.md. Checks that nothing of the hunt is left running afterwards.

    python benchmarks/natural_hunt.py [--scenario scenarios/sglang/natural_hunt_hicache.toml] [--budget-min 60]
        [--evidence-dir /tmp/repro-natural-hunt] [--extra --config prefetch_wait_complete ...] [--json-out out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from repro.procs import processes_mentioning  # noqa: E402

BASE = REPO / "scenarios" / "sglang" / "natural_hunt_hicache.toml"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", type=Path, default=BASE)
    ap.add_argument("--budget-min", type=float, default=60.0)
    ap.add_argument("--evidence-dir", type=Path, default=Path("/tmp/repro-natural-hunt"))
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more `repro hunt` options")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--reread", type=Path, default=None,
                    help="a --json-out file of an earlier run: re-read every trial's effect from its evidence with "
                         "this checkout's repro.natural_effect and print the tables (no server started)")
    args = ap.parse_args()
    if args.reread:
        saved = json.loads(args.reread.read_text())
        res = [{**r, **reread_effect(r)} for r in saved["results"]]
        print(json.dumps(saved["summary"], indent=1))
        return tables(res, [])
    root = args.evidence_dir.resolve()
    cmd = [sys.executable, "-m", "repro.cli", "hunt", str(args.scenario), "--natural", "--budget-min", str(args.budget_min),
           "--evidence-dir", str(root), "--json", *args.extra]
    t0 = time.time()
    child = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = child.communicate(timeout=args.budget_min * 60 + 1800)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        stdout, stderr = child.communicate()
    wall = time.time() - t0
    time.sleep(2.0)
    left = processes_mentioning(root)
    summary: dict = {"rc": child.returncode, "wall_s": round(wall, 1), "left_running": left}
    if not stdout.strip().startswith("{"):
        summary["stderr_tail"] = stderr[-3000:]
        print(json.dumps(summary, indent=1))
        return 1
    out = json.loads(stdout)
    res = [r for r in out["results"] if r["verdict"] != "NOT RUN"]
    summary.update({"folder": out["folder"], "rows": len(out["rows"]), "trials": len(res),
                    "trials_per_hour": round(len(res) / (wall / 3600.0), 1) if wall else None,
                    "verdicts": dict(Counter(r["verdict"] for r in res)),
                    "natures": dict(Counter(r.get("nature") for r in res))})
    print(json.dumps(summary, indent=1))
    if args.json_out:
        args.json_out.write_text(json.dumps({"summary": summary, "results": res}, indent=1))
    return tables(res, left)


def reread_effect(r: dict) -> dict:
    """``{"effect_status", "effect"}`` of one saved trial, read again from its evidence: the trial's own injector
    folder when it ran on a fresh server, else the latest trial-server session folder before it."""
    from repro.hunt.loop import fault_fates
    from repro.injection_records import read_injector_dir
    from repro.ledger import load_ledgers
    from repro.natural_effect import natural_effect

    ev = Path(r.get("evidence") or "")
    sessions = sorted((d for d in ev.parent.glob("*-hunt-session*") if d.name < ev.name), reverse=True)
    for folder in [ev / "injector"] + [d / "injector" for d in sessions]:
        if not folder.is_dir():
            continue
        mine = [f for log in read_injector_dir(folder).logs for f in log.fires
                if f.injection_id == r["trial"] and f.rank == r["rank"]]
        if mine:
            t = min(f.time for f in mine)
            eff = natural_effect(server_ledgers(folder, t, mine[0].pid), r["rank"], since_time=t)
            return {"effect_status": eff.status, "effect": eff.summary + fault_fates(mine),
                    "short": short_effect(eff) + fault_fates(mine)}
    return {"effect_status": "not recorded", "effect": "no fire of this trial found in its evidence", "short": "—"}


def short_effect(eff) -> str:
    """One cell for RESULTS.md: the first lockstep episode, else the longest attributed transient one (probe, ranks'
    values, ticks, the reconciling reduction's function), else where the peer was held; the jitter count."""
    def caller(chain: str) -> str:  # the first frame that is not a reduction wrapper (_all_reduce*)
        names = [f.split(" [")[0].split(" (tick")[0].rpartition(".")[2] for f in chain.split(" ← ")]
        return next((n for n in names if not n.startswith("_all_reduce")), names[-1])

    def fn(c: str) -> str:  # "all_reduce MIN @ A ← B ← C [thread]" -> "all_reduce MIN in `B` [thread]"
        head, _, chain = c.partition(" @ ")
        return f"{head} in `{caller(chain)}`" + (" [" + chain.split(" [")[1] if " [" in chain else "")

    def ep(e) -> str:
        vals = " vs ".join(f"{v:.0f}" if isinstance(v, float) else str(v) for v in e.values.values())
        if e.end_tick is None:
            return f"`{e.probe}` ({vals}) from tick {e.start_tick}, still different at the end"
        via = fn(e.collectives[0]) if e.collectives and " @ " in e.collectives[0] else (e.collectives[0] if e.collectives else "?")
        return f"`{e.probe}` ({vals}) ticks {e.start_tick}–{e.end_tick}, reconciled by {via}"

    if eff.status == "not recorded":
        return "not recorded: " + eff.summary
    if eff.episodes:
        out = ep(eff.episodes[0]) + (" — **first divergent state**" if eff.episodes[0].end_tick is None else "")
    elif eff.transient:
        best = max(eff.transient, key=lambda e: (e.end_tick is None, (e.end_tick or 10**9) - e.start_tick))
        out = ep(best)
    else:
        out = "none moved"
    if eff.held:
        h = eff.held[0]
        out += f"; held: {h.split(' @ ')[0]} in `{caller(h.split(' @ ')[1])}`"
    if eff.later:
        out += f"; {eff.later} jitter"
    return out


def server_ledgers(folder: Path, t: float, target_pid: int) -> dict:
    """rank → ledger of the server that ran at epoch ``t`` (a session folder holds every restarted server's)."""
    from repro.ledger import load_ledgers

    pids = sorted({int(m.group(1)) for f in folder.iterdir() if (m := re.match(r"ledger-(\d+)", f.name))})
    out: dict = {}
    for pid in pids:
        for rank, led in load_ledgers(folder, [pid]).items():
            times = [x.t_enter for x in led.records]
            if pid == target_pid or (times and min(times) <= t <= max(times)):
                if rank not in out or pid == target_pid:
                    out[rank] = led
    return out


def tables(res: list, left: list) -> int:
    """Print the hunt table and the pool-count table (markdown); 0 unless something was left running."""
    print("| # | policy | point | perturbation | nature | rank | fired on rank | effect status | effect | verdict |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in res:
        print(f"| {r['n']} | {policy(r)} | `{r['point']}` | {r['perturbation']}{' under ' + r['workload'] if r.get('workload') else ''} | "
              f"{r.get('nature')} | {r['rank']} | {r.get('fired_on_target')} | {r.get('effect_status') or '—'} | "
              f"{(r.get('short') or r.get('effect') or '').replace('|', '/')} | {r['verdict']} |")
    print()
    print("Pool counts (the #30760 family, issue 35 item 4): did a natural nemesis make them drift between the ranks?")
    print("| # | policy | point | perturbation | pool counts |")
    print("|---|---|---|---|---|")
    for r in res:
        print(f"| {r['n']} | {policy(r)} | `{r['point']}` | {r['perturbation']} | {pool_counts(r.get('effect') or '')} |")
    return 0 if not left else 1


POOLS = ("req_to_token_pool.available", "token_to_kv_pool_allocator.available")


def policy(r: dict) -> str:
    """The trial server's --hicache-storage-prefetch-policy, from the trial's processes.json ("—": none found)."""
    f = Path(r.get("evidence") or "") / "processes.json"
    try:
        m = re.search(r"--hicache-storage-prefetch-policy\W+(\w+)", f.read_text())
    except OSError:
        return "?"
    return m.group(1) if m else "—"


def pool_counts(effect: str) -> str:
    """``drifted: <probe>`` when the effect names a pool probe among its lockstep episodes, else the ticks compared."""
    lockstep = effect.split("; transient")[0]
    moved = [p for p in POOLS if f"`{p}`" in lockstep]
    if moved:
        return "**drifted**: " + ", ".join(moved)
    m = re.search(r"every tick (\d+)–(\d+)", effect)
    return f"equal on both ranks at every tick {m.group(1)}–{m.group(2)}" if m else "not read"


if __name__ == "__main__":
    sys.exit(main())
