"""Capture time for 2, 4, 8 ranks of a hung gloo job (goal: 8 ranks ≤ 3 s on 2 cores).

Usage: python benchmarks/capture_time.py [--python PY] [--ranks 2 4 8] [--repeat 5] [--native] [--json]

Starts tests/gloo_programs/desync.py with N ranks (rank 0 makes one extra all_reduce, so the job hangs), waits
until every rank reached its hang point, then times ``repro.capture.capture_ranks`` (py-spy ``--json`` + text per
rank, all ranks in parallel, CPU window ``--cpu-window-s``, default 0.2 s) ``--repeat`` times. Every rank is ended by process group at the end,
on failure and on Ctrl-C. Prints one line per N: median and max wall seconds, and whether all captures were ok.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from gloo_programs.job import GlooJob  # noqa: E402
from repro.analysis import analyze  # noqa: E402
from repro.capture import capture_ranks, py_spy_version  # noqa: E402


def _torch_python(given: str) -> str:
    if given:
        return given
    from repro import testbed

    py = testbed.testbed_python()
    if not py:
        sys.exit("no interpreter with torch: pass --python or run scripts/cpu_testbed/setup.sh")
    return str(py)


def bench(python: str, n: int, repeat: int, native: bool, cpu_window_s: float = 0.2) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"capture-bench-{n}-") as tmp:
        with GlooJob(python, n, Path(tmp) / "job") as job:
            t_start = time.monotonic()
            job.wait_ready(timeout_s=300)
            ready_s = time.monotonic() - t_start
            times, all_ok, diverged, native_ok = [], True, True, True
            for i in range(repeat):
                t0 = time.monotonic()
                caps = capture_ranks(job.pids, Path(tmp) / "stacks", timeout_s=10, native=native, tag=f"-{i}",
                                     cpu_window_s=cpu_window_s)
                times.append(time.monotonic() - t0)
                all_ok = all_ok and all(c.ok for c in caps)
                native_ok = native_ok and all(c.native == native for c in caps)  # False: --native was retried without
                a = analyze(caps)
                odd_ok = a.even_split if n == 2 else a.odd_ranks == [0]  # TP=2 is always 1 against 1
                diverged = diverged and a.diverged and odd_ok
    return {"ranks": n, "native": native, "repeat": repeat, "median_s": round(statistics.median(times), 3),
            "max_s": round(max(times), 3), "all_ok": all_ok, "native_kept": native_ok, "diagnosis_ok": diverged,
            "job_ready_s": round(ready_s, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--python", default="", help="interpreter with torch (default: the CPU testbed's)")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--native", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--cpu-window-s", type=float, default=0.2, help="capture_ranks cpu_window_s (the time floor)")
    args = p.parse_args()
    py = _torch_python(args.python)
    rows = [bench(py, n, args.repeat, args.native, args.cpu_window_s) for n in args.ranks]
    if args.json:
        print(json.dumps({"py_spy": py_spy_version(), "rows": rows}, indent=2))
        return
    print(f"{py_spy_version()}; capture_ranks wall time over {args.repeat} captures, cpu_window_s={args.cpu_window_s}")
    for r in rows:
        print(f"{r['ranks']} ranks{' --native' if r['native'] else ''}: median {r['median_s']:.3f} s, "
              f"max {r['max_s']:.3f} s, all ok={r['all_ok']}, {'native kept=' + str(r['native_kept']) + ', ' if r['native'] else ''}diagnosis ok={r['diagnosis_ok']} "
              f"(job ready after {r['job_ready_s']} s)")


if __name__ == "__main__":
    main()
