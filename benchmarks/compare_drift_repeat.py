"""Repeat the #30760 drift after-run N times (default 5) and say, for any failed repeat, which collective diverged.

The `allocatable_drift` variant makes rank 0 leave the waiting-queue loop one request early, once. With our 0.5.23
bulk-prefetch patch that drift is harmless *only while* the request rank 0 dropped is not admitted by the other
rank in that tick (its prefetch is still live): otherwise the ranks build different batches and the model forward
desynchronises, a separate hazard the fix does not claim to address. This script measures how often it holds with
the scenario's burst (8 requests, all at once, 64-token prompts, prefetches live ~1.4 s on the CPU testbed).

Each repeat runs ``repro compare SCENARIO --variant allocatable_drift --before installed --after patch:PATCH
--only after`` (one server, torn down after). A failed repeat is diagnosed from its evidence (analysis.json):
a rank blocked under ``check_prefetch_progress`` / ``_can_terminate_prefetch`` → "prefetch: the fix failed";
a rank blocked under a model ``forward`` → "model forward: batch composition"; else the verdict's reason.

Usage: python benchmarks/compare_drift_repeat.py [--repeats 5] [--evidence-dir DIR] [--out results.json]
Prints one line per repeat and a summary; exit 0 iff every repeat passed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCENARIO = REPO / "scenarios" / "sglang" / "hicache_prefetch_30760.toml"
PATCH = REPO / "scenarios" / "sglang" / "patches" / "sglang-0.5.23-30760-bulk-prefetch.patch"
PREFETCH_FRAMES = ("check_prefetch_progress", "_can_terminate_prefetch", "bulk_check_prefetch_progress")


def diagnose(evidence: Path, reason: str) -> str:
    """Which collective diverged in a failed repeat, read from its analysis.json (the last capture)."""
    p = evidence / "analysis.json"
    if not p.is_file():
        return f"no capture: {reason}"
    data = json.loads(p.read_text())
    data = json.loads(data) if isinstance(data, str) else data
    parts = []
    for r in data.get("ranks", []):
        chain = r.get("caller_chain") or []
        if any(any(f in c for f in PREFETCH_FRAMES) for c in chain):
            parts.append(f"TP{r['rank']} in a prefetch collective (the fix failed)")
        elif any(c.endswith(".forward") or "forward_batch" in c for c in chain):
            parts.append(f"TP{r['rank']} in the model forward (batch composition differs)")
        else:
            parts.append(f"TP{r['rank']} {r.get('state')}: {' ← '.join(chain[:3])}")
    return "; ".join(parts) or reason


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--evidence-dir", type=Path, default=REPO / "evidence")
    ap.add_argument("--out", type=Path, default=None, help="write the per-repeat records as JSON here")
    args = ap.parse_args()
    rows = []
    for i in range(1, args.repeats + 1):
        t0 = time.time()
        r = subprocess.run(
            [sys.executable, "-m", "repro.cli", "compare", str(SCENARIO), "--variant", "allocatable_drift", "--before", "installed",
             "--after", f"patch:{PATCH}", "--only", "after", "--label", f"drift-repeat{i}", "--evidence-dir", str(args.evidence_dir),
             "--json"],
            cwd=REPO, capture_output=True, text=True,
        )
        wall = time.time() - t0
        try:
            side = json.loads(r.stdout)["sides"][0]
        except (ValueError, KeyError, IndexError):
            rows.append({"repeat": i, "ok": False, "wall_s": round(wall, 1), "diagnosis": f"compare exit {r.returncode}: {r.stderr.strip()[-300:]}"})
            print(f"repeat {i}: ERROR exit {r.returncode}", flush=True)
            continue
        counts = {x["rank"]: x["counts"] for x in side["ranks"]}
        checks = {k: c.get("count_prefetch_checks", {}).get("entered", 0) for k, c in counts.items()}
        ticks = {k: c.get("count_ticks", {}).get("entered", 0) for k, c in counts.items()}
        fired = {k: c.get("allocatable_zero_once", {}).get("fired", 0) for k, c in counts.items()}
        ok = side["verdict"] == "ALL REQUESTS SUCCEEDED"
        row = {"repeat": i, "ok": ok, "verdict": side["verdict"], "wall_s": round(wall, 1), "to_verdict_s": side["timings"].get("to_verdict_s"),
               "drift_fired": fired, "prefetch_checks": checks, "ticks": ticks, "evidence": side["evidence"]}
        if not ok:
            row["diagnosis"] = diagnose(Path(side["evidence"]), side["reason"])
        rows.append(row)
        print(f"repeat {i}: {side['verdict']:24s} wall {wall:5.1f} s  drift fired {fired}  prefetch checks {checks}  ticks {ticks}"
              + (f"  → {row['diagnosis']}" if not ok else ""), flush=True)
    passed = sum(1 for x in rows if x["ok"])
    walls = [x["wall_s"] for x in rows]
    print(f"summary: {passed}/{len(rows)} repeats ALL REQUESTS SUCCEEDED; wall per repeat min {min(walls):.1f} s, "
          f"max {max(walls):.1f} s, mean {sum(walls) / len(walls):.1f} s")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
