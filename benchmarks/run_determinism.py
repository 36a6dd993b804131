"""Determinism and latency of `repro run` on the CPU testbed (issue 4's benchmarks).

Runs the smoke scenario's armed variant N times (expects DEADLOCKED every time) and its control N times (expects
ALL REQUESTS SUCCEEDED every time), each a fresh server, and reports per run: verdict, time from the last progress
event to verdict.json on disk (goal ≤ stall_s + 3 s), time to healthy, whole wall time. Prints a markdown table to
paste into benchmarks/RESULTS.md and writes the raw numbers as JSON.

    python benchmarks/run_determinism.py --repeats 10 [--evidence-dir /tmp/det] [--json-out det.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from repro.evidence import read_json  # noqa: E402
from repro.runner import RunOptions, run  # noqa: E402

SMOKE = REPO / "scenarios" / "sglang" / "smoke_extra_allreduce.toml"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--evidence-dir", type=Path, default=Path("/tmp/repro-determinism"))
    ap.add_argument("--variants", nargs="+", default=["extra_collective", "control"])
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    for variant in args.variants:
        for i in range(args.repeats):
            t0 = time.time()
            res = run(RunOptions(scenario_path=SMOKE, variant=variant, evidence_root=args.evidence_dir, label=f"{variant}-{i}"))
            wall = time.time() - t0
            v = read_json(res.evidence / "verdict.json") or {}
            row = {
                "variant": variant, "i": i, "verdict": res.verdict.verdict, "wall_s": round(wall, 1),
                "healthy_s": round(res.timings.get("healthy_s", 0.0), 1),
                "last_progress_to_verdict_s": v.get("timings", {}).get("last_progress_to_verdict_s"),
                "evidence": str(res.evidence),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print("| variant | runs | verdicts | last progress → verdict (median / max, s) | healthy (median, s) | wall (median, s) |")
    print("|---|---|---|---|---|---|")
    for variant in args.variants:
        rs = [r for r in rows if r["variant"] == variant]
        counts: dict[str, int] = {}
        for r in rs:
            counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
        lat = [r["last_progress_to_verdict_s"] for r in rs if r["last_progress_to_verdict_s"] is not None]
        lat_s = f"{statistics.median(lat):.1f} / {max(lat):.1f}" if lat else "-"
        print(f"| {variant} | {len(rs)} | {', '.join(f'{n}/{len(rs)} {k}' for k, n in counts.items())} | {lat_s} | "
              f"{statistics.median(r['healthy_s'] for r in rs):.1f} | {statistics.median(r['wall_s'] for r in rs):.1f} |")
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
