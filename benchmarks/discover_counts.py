"""Discovery's static counts on an installed engine (issue 31): points, their share of ``*available_size`` sites,
candidates by source kind, points added to the hand catalogue, and the scan's wall time. Static only: nothing is
launched (no server), the scan reads the engine's files with ``ast`` in the target interpreter.

    python benchmarks/discover_counts.py [--python ~/.cache/tp-deadlock-repro/testbed/sglang-0.5.23/venv/bin/python]
        [--json-out out.json]

The scan's answer cache is off here (every run scans); ``seconds`` is the scan's own timing (parse + analysis),
``scan_cpu_seconds`` the same stages in CPU seconds (the scan's own ``time.process_time``), ``scan_cpu_s`` the CPU seconds of the scan's process (user + system: what its wall time is on a quiet box, since the
scan is single-threaded), ``load_avg_1min`` the box's load when it ended.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import resource
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from repro.discover import default_rules_path, discover, merge_catalogue, load_rules  # noqa: E402
from repro.hunt import catalogue_for, load_catalogue  # noqa: E402

TESTBED = Path.home() / ".cache/tp-deadlock-repro/testbed/sglang-0.5.23/venv/bin/python"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=str(TESTBED))
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    rules_path = default_rules_path("sglang")
    hand = load_catalogue(catalogue_for("sglang"))
    t0 = time.time()
    c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    d = discover(a.python, rules_path, known_perturbations=sorted(hand.perturbations), use_cache=False)
    wall = time.time() - t0
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime)
    merged, added = merge_catalogue(hand, d.points, load_rules(rules_path))
    avail = [p for p in d.points if fnmatch.fnmatchcase(p.site.rsplit(".", 1)[-1], "*available_size")]
    added_avail = [p for p in added if fnmatch.fnmatchcase(p.site.rsplit(".", 1)[-1], "*available_size")]
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    out = {"commit": commit, "engine": d.scan.get("version"), "points": len(d.points), "added": len(added),
           "available_size_points": len(avail), "available_size_share": round(len(avail) / max(1, len(d.points)), 3),
           "added_available_size": len(added_avail),
           "candidates": len(d.candidates), "huntable": sum(1 for c in d.candidates if c.huntable),
           "candidates_by_kind": dict(Counter(c.source_kind for c in d.candidates)),
           "points_by_kind": dict(Counter(p.candidates[0].source_kind for p in d.points)),
           "guards_by_kind": dict(Counter(c.guard for c in d.candidates)),
           "scan_seconds": d.scan.get("seconds"), "scan_cpu_seconds": d.scan.get("cpu_seconds"),
           "same_decisions_folded": sum(len(getattr(p, "same_decisions", ())) for p in d.points),
           "wall_s": round(wall, 1), "scan_cpu_s": round(cpu, 1),
           "load_avg_1min": round(os.getloadavg()[0], 2), "cpus": os.cpu_count()}
    print(json.dumps(out, indent=1))
    if a.json_out:
        a.json_out.write_text(json.dumps({**out, "point_names": [p.name for p in d.points]}, indent=1))


if __name__ == "__main__":
    main()
