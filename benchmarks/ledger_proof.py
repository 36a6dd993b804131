"""The ledger proof's cost and speed on the CPU testbed (real SGLang TP=2): proof latency, throughput with the
ledger on vs off, false verdicts on clean bursts, the follower's own CPU.

Every command starts real servers: run it under the shared lock, ``flock /tmp/repro-e2e.lock python
benchmarks/ledger_proof.py …``. Results print as one JSON line per run and a summary; copy the numbers into
``benchmarks/RESULTS.md``.

- ``latency [--repeats 10] [--stall-repeats 1] [--only smoke|30760-extra|30760-drift]``: each deadlock variant
  (smoke ``extra_collective``; #30760 ``extra_collective`` and ``allocatable_drift``) on a fresh server per run,
  with the default detect stage (ledger proof first). Per run: verdict, proof kind, ``proof_latency_s`` (enter of
  the record that closed the proof → verdict), ``last_progress_to_verdict_s``, ``ledger_follow_cpu_s``. With
  ``--stall-repeats`` > 0 also that many runs with the stall rule alone (the figure the proof replaces).
- ``clean [--bursts 20]``: one server; ``control``, ``desync_control`` and ``desync_reduce_op`` of the smoke
  scenario once, then ``--bursts`` clean control bursts: any DEADLOCKED or DESYNCED on a clean burst is a false one.
- ``throughput [--pairs 5] [--requests 16] [--max-new-tokens 64]``: two servers of the smoke scenario, one with
  the ledger on, one with it off (``ledger = false``), bursts of the ``control`` variant interleaved on/off; output
  tokens/s per burst (requests × max_new_tokens / burst seconds) and the on/off ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SMOKE = REPO / "scenarios" / "sglang" / "smoke_extra_allreduce.toml"
H30760 = REPO / "scenarios" / "sglang" / "hicache_prefetch_30760.toml"
CASES = {"smoke": (SMOKE, "extra_collective"), "30760-extra": (H30760, "extra_collective"),
         "30760-drift": (H30760, "allocatable_drift")}


def _emit(d: dict) -> None:
    print(json.dumps(d), flush=True)


def _run_one(path: Path, variant: str, root: Path, stall_only: bool) -> dict:
    from repro import runner
    from repro.detect import StallDetector
    from repro.evidence import read_json

    opts = runner.RunOptions(scenario_path=path, variant=variant, evidence_root=root)
    p = runner.prepare(opts)
    if not stall_only:
        res = runner.run_prepared(p, opts)
        v = read_json(res.evidence / "verdict.json")
    else:  # the stall rule alone: a session whose detect stage is only StallDetector
        s = runner.Session(p, detectors=[StallDetector()])
        try:
            failed = s.start()
            out = runner.Outcome(failed, clean=False) if failed else s.drive(p.variant, p.evidence)
            runner.finish_evidence(p, opts, p.variant, p.evidence, out, s.rank_pids, False)
        finally:
            s.stop()
            s.close_drivers()
        v = read_json(p.evidence.path / "verdict.json")
    t = v.get("timings", {})
    return {"variant": variant, "mode": "stall-only" if stall_only else "proof", "verdict": v["verdict"],
            "proof": (v.get("proof") or {}).get("kind"), "proof_latency_s": t.get("proof_latency_s"),
            "last_progress_to_verdict_s": t.get("last_progress_to_verdict_s"),
            "ledger_follow_cpu_s": t.get("ledger_follow_cpu_s"), "burst_s": t.get("burst_s"),
            "evidence": v.get("evidence")}


def latency(a: argparse.Namespace, root: Path) -> None:
    summary = {}
    for name in a.only or list(CASES):
        path, variant = CASES[name]
        rows = []
        for i in range(a.repeats):
            r = _run_one(path, variant, root, False)
            rows.append(r)
            _emit({"case": name, "i": i, **r})
        stall = []
        for i in range(a.stall_repeats):
            r = _run_one(path, variant, root, True)
            stall.append(r)
            _emit({"case": name, "i": i, **r})
        lat = [r["proof_latency_s"] for r in rows if r["proof_latency_s"] is not None]
        lp = [r["last_progress_to_verdict_s"] for r in rows if r["last_progress_to_verdict_s"] is not None]
        summary[name] = {"runs": len(rows), "deadlocked_with_proof": sum(1 for r in rows if r["verdict"] == "DEADLOCKED"
                                                                        and r["proof"]),
                         "proof_kinds": sorted({r["proof"] for r in rows if r["proof"]}),
                         "proof_latency_median_s": statistics.median(lat) if lat else None,
                         "proof_latency_max_s": max(lat) if lat else None,
                         "last_progress_to_verdict_median_s": statistics.median(lp) if lp else None,
                         "last_progress_to_verdict_max_s": max(lp) if lp else None,
                         "follower_cpu_s_max": max((r["ledger_follow_cpu_s"] or 0) for r in rows) if rows else None,
                         "stall_only_last_progress_to_verdict_s": [r["last_progress_to_verdict_s"] for r in stall],
                         "stall_only_verdicts": [r["verdict"] for r in stall]}
    _emit({"summary": summary})


def clean(a: argparse.Namespace, root: Path) -> None:
    from repro.runner import RunOptions, run_many

    names = ["control", "desync_control", "desync_reduce_op"]
    res = run_many(RunOptions(scenario_path=SMOKE, evidence_root=root), names)
    for n, r in zip(names, res):
        _emit({"variant": n, "verdict": r.verdict.verdict})
    tmp = Path(tempfile.mkdtemp(prefix="repro-clean-"))
    # one server, N control bursts: run_many needs unique injection ids per variant, so give each burst a copy
    text = SMOKE.read_text()
    m = re.search(r'(\[\[variants\]\]\nname = "control".*?)(?=\n\[\[variants\]\]|\Z)', text, re.S)
    block = m.group(1)
    extra = "".join("\n" + block.replace('name = "control"', f'name = "control_{i}"')
                    .replace('id = "observe_run_batch"', f'id = "observe_run_batch_{i}"') for i in range(a.bursts))
    scn = tmp / "smoke_extra_allreduce.toml"
    scn.write_text(text + extra)
    names = [f"control_{i}" for i in range(a.bursts)]
    res = run_many(RunOptions(scenario_path=scn, evidence_root=root), names)
    verdicts = [r.verdict.verdict for r in res]
    _emit({"summary": {"clean_bursts": len(verdicts), "verdicts": {v: verdicts.count(v) for v in set(verdicts)},
                       "false_deadlocks": verdicts.count("DEADLOCKED"), "false_desyncs": verdicts.count("DESYNCED")}})


def throughput(a: argparse.Namespace, root: Path) -> None:
    from repro import runner
    from repro.evidence import EvidenceDir

    tmp = Path(tempfile.mkdtemp(prefix="repro-tput-"))
    text = SMOKE.read_text()
    text = re.sub(r"max_new_tokens = \d+", f"max_new_tokens = {a.max_new_tokens}", text)
    text = re.sub(r"requests = \d+", f"requests = {a.requests}", text)
    text = re.sub(r"concurrency = \d+", "concurrency = 8", text)
    on, off = tmp / "on.toml", tmp / "off.toml"
    on.write_text(text.replace("budget_s = 90", "budget_s = 600"))
    off.write_text(text.replace("budget_s = 90", "budget_s = 600\nledger = false"))
    sessions = {}
    try:
        for name, path in (("on", on), ("off", off)):
            p = runner.prepare(runner.RunOptions(scenario_path=path, variant="control", evidence_root=root,
                                                 label=f"tput-{name}"))
            s = runner.Session(p)
            failed = s.start()
            if failed:
                raise SystemExit(f"{name}: {failed.reason}")
            sessions[name] = (p, s)
        tps = {"on": [], "off": []}
        cpu = []
        for i in range(a.pairs):
            for name in (("on", "off") if i % 2 == 0 else ("off", "on")):
                p, s = sessions[name]
                d = EvidenceDir(p.evidence.root, p.scenario.name, f"tput-{name}-{i}")
                out = s.drive(p.scenario.variant("control"), d)
                rate = a.requests * a.max_new_tokens / out.timings["burst_s"]
                tps[name].append(rate)
                if name == "on":
                    cpu.append(out.timings.get("ledger_follow_cpu_s"))
                _emit({"pair": i, "ledger": name, "verdict": out.verdict.verdict, "burst_s": out.timings["burst_s"],
                       "tokens_per_s": round(rate, 1), "follower_cpu_s": out.timings.get("ledger_follow_cpu_s")})
        ratio = statistics.median(tps["on"]) / statistics.median(tps["off"])
        _emit({"summary": {"pairs": a.pairs, "median_tokens_per_s_on": statistics.median(tps["on"]),
                           "median_tokens_per_s_off": statistics.median(tps["off"]), "ratio_on_off": round(ratio, 4),
                           "follower_cpu_s_per_burst": cpu}})
    finally:
        for _p, s in sessions.values():
            s.stop()
            s.close_drivers()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    la = sub.add_parser("latency")
    la.add_argument("--repeats", type=int, default=10)
    la.add_argument("--stall-repeats", type=int, default=1)
    la.add_argument("--only", nargs="*", choices=list(CASES))
    cl = sub.add_parser("clean")
    cl.add_argument("--bursts", type=int, default=20)
    tp = sub.add_parser("throughput")
    tp.add_argument("--pairs", type=int, default=5)
    tp.add_argument("--requests", type=int, default=16)
    tp.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--evidence-dir", default="")
    a = ap.parse_args()
    root = Path(a.evidence_dir) if a.evidence_dir else Path(tempfile.mkdtemp(prefix="repro-bench-proof-"))
    {"latency": latency, "clean": clean, "throughput": throughput}[a.cmd](a, root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
