"""Added cost per call of a patched method whose gate is evaluated but which never fires (goal: <= 5 us per call).

Three timings of the same method call, each the median of ``--repeats`` runs of ``--calls`` calls:
- baseline: the method unpatched;
- disarmed: patched, arm file empty (the wrapper only checks the arm state);
- armed gate: patched and armed, action ``none`` (a control): the call is counted, the rank is read and the stack
  gate walks the caller frames (``called_from`` two frames up + ``not_called_from``) on every call; never fires.
The overhead is the armed (or disarmed) median minus the baseline median, per call, in microseconds, for wall
time and for the calling thread's CPU time (``time.thread_time``: not inflated by other processes on a busy box).

Usage: ``python benchmarks/injector_overhead.py [--calls 20000] [--repeats 15]`` (stdlib + the injector only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "injectors"))


class Scheduler:
    def get_num_allocatable_reqs(self, running_bs):
        return 8 - running_bs

    def get_new_batch_prefill(self, n):
        f = self.get_num_allocatable_reqs
        for req in range(n):
            f(req & 3)


def entry(s: Scheduler, n: int) -> None:
    s.get_new_batch_prefill(n)


MINS: dict = {}
CPU: dict = {}


def _time(calls: int, repeats: int, tag: str = "") -> float:
    """Median wall seconds per call over ``repeats`` runs. Side results: MINS[tag] = fastest run (wall), CPU[tag] =
    median thread CPU seconds per call (what the calling thread itself spent: insensitive to other processes)."""
    s = Scheduler()
    samples = []
    cpu = []
    for _ in range(repeats):
        c0 = time.thread_time()
        t0 = time.perf_counter()
        entry(s, calls)
        samples.append((time.perf_counter() - t0) / calls)
        cpu.append((time.thread_time() - c0) / calls)
    MINS[tag] = min(samples)
    CPU[tag] = statistics.median(cpu)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()

    base = _time(args.calls, args.repeats, 'base')
    with tempfile.TemporaryDirectory(prefix="repro-bench-") as tmp:
        mod = __name__
        plan = {
            "version": 1, "scenario": "bench", "variant": "v", "out_dir": os.path.join(tmp, "out"),
            "arm_file": os.path.join(tmp, "arm"), "arm_poll_s": 0.1, "faulthandler_signal": "",
            "injections": [{
                "id": "observe",
                "site": {"alternatives": [f"{mod}:Scheduler.get_num_allocatable_reqs"], "aliases": []},
                "gate": {"called_from": [f"{mod}:Scheduler.get_new_batch_prefill", f"{mod}:entry"],
                         "not_called_from": ["*:*.bulk_check_prefetch_progress"], "max_depth": 16, "inside_loop": None,
                         "ranks": [], "rank_group": None, "occurrence": {"mode": "first", "nth": 1, "max_fires": 0}},
                "action": {"kind": "none"},
            }],
        }
        path = os.path.join(tmp, "plan.json")
        with open(path, "w") as fh:
            json.dump(plan, fh)
        os.environ["REPRO_PLAN"] = path
        import repro_injector

        rt = repro_injector.activate()
        assert rt is not None and rt.sites[0].patched is not None, "benchmark site was not patched"
        disarmed = _time(args.calls, args.repeats, 'disarmed')
        with open(plan["arm_file"], "w") as fh:
            fh.write("observe\n")
        rt.poll_arm(force=True)
        armed = _time(args.calls, args.repeats, 'armed')
        c = rt.sites[0].counts
        assert c.matched == c.entered > 0 and c.fired == 0, "gate did not match on every call"
        with_loop = rt.sites[0]
        with_loop.gate.inside_loop = "req"
        with_loop.gate._loops.clear()
        armed_loop = _time(args.calls, args.repeats, 'armed_loop')
    res = {
        "python": sys.version.split()[0],
        "calls": args.calls,
        "repeats": args.repeats,
        "baseline_us": round(base * 1e6, 3),
        "disarmed_overhead_us": round((disarmed - base) * 1e6, 3),
        "armed_gate_overhead_us": round((armed - base) * 1e6, 3),
        "armed_gate_inside_loop_overhead_us": round((armed_loop - base) * 1e6, 3),
        "min_armed_gate_overhead_us": round((MINS["armed"] - MINS["base"]) * 1e6, 3),
        "min_disarmed_overhead_us": round((MINS["disarmed"] - MINS["base"]) * 1e6, 3),
        "cpu_disarmed_overhead_us": round((CPU["disarmed"] - CPU["base"]) * 1e6, 3),
        "cpu_armed_gate_overhead_us": round((CPU["armed"] - CPU["base"]) * 1e6, 3),
        "cpu_armed_gate_inside_loop_overhead_us": round((CPU["armed_loop"] - CPU["base"]) * 1e6, 3),
        "loadavg_1m": os.getloadavg()[0],
        "cpus": os.cpu_count(),
    }
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
