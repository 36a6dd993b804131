"""Added cost per collective of the collective ledger (goal: <= 10 us per collective).

One process, a world-size-1 gloo group (the collective itself is as cheap as gloo gets, so the ledger's share is
not hidden in network time). Timings, each the median of ``--repeats`` runs of ``--calls`` calls:

- baseline: ``torch.distributed.all_reduce`` on a 1-element tensor, no ledger;
- ledger: the same call with the ledger installed (record queued, frames walked for the call site, exit queued;
  the writer thread serialises in the background, outside the calling thread);
- coordinator: a GroupCoordinator-shaped method that calls ``torch.distributed.all_reduce`` on its group, with the
  ledger recording the outer call once (nested rule) vs the same method unpatched.

Reported per call in microseconds: wall, the calling thread's CPU time (``time.thread_time``) and the whole
process's (``time.process_time``: the writer thread's share included, the run's queue written inside the timed
span). Disabled
ledger = nothing patched: cost zero by construction (the plan key is read once at activation).

``--hang-latency N``: instead, N times, start the 2-rank gloo job ``tests/gloo_programs/ledger_sched.py --mode
extra`` (rank 0 enters an all_reduce its peer never joins, and blocks), poll rank 0's ledger file every 2 ms and
report how long after the record's enter time it was on disk (the writer thread writes every 150 ms while the
rank is blocked in gloo). Both ranks are ended by process group.

Usage: ``python benchmarks/ledger_overhead.py [--calls 5000] [--repeats 7] [--hang-latency 5]`` with an
interpreter that has torch (the CPU testbed's venv python).
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


class GroupCoordinator:
    def __init__(self, dist, pg) -> None:
        self.dist = dist
        self.device_group = self.cpu_group = pg
        self.world_size = 2  # the ledger skips world_size == 1 coordinators (no communication); pretend TP=2
        self.group_name = "tp"

    def all_reduce(self, t):
        self.dist.all_reduce(t, group=self.device_group)
        return t


def scheduler_tick(fn, t, calls: int) -> None:
    for _ in range(calls):
        fn(t)


def _run(fn, t, calls: int, repeats: int, drain=None) -> tuple[float, float, float]:
    """Median per call: wall, the calling thread's CPU, and the whole process's CPU (writer thread included, with
    what is left queued written by ``drain`` inside the timed span)."""
    walls, cpus, procs = [], [], []
    for _ in range(repeats):
        w0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        scheduler_tick(fn, t, calls)
        walls.append((time.perf_counter() - w0) / calls)
        cpus.append((time.thread_time() - c0) / calls)
        if drain is not None:
            drain()
        procs.append((time.process_time() - p0) / calls)
    return statistics.median(walls), statistics.median(cpus), statistics.median(procs)


def hang_latency(n: int) -> None:
    import signal
    import subprocess

    prog = REPO / "tests" / "gloo_programs" / "ledger_sched.py"
    lat = []
    for _ in range(n):
        tmp = Path(tempfile.mkdtemp(prefix="ledger-hang-"))
        out = tmp / "out"
        out.mkdir()
        plan = {"version": 1, "scenario": "bench", "variant": "v", "out_dir": str(out), "arm_file": str(tmp / "arm"),
                "injections": [], "ledger": {"enabled": True, "max_records": 1000,
                                             "tick_function": "ledger_sched:Scheduler.get_next_batch_to_run",
                                             "coordinators": ["ledger_sched:GroupCoordinator"]}}
        (tmp / "plan.json").write_text(json.dumps(plan))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "REPRO_PLAN")}
        env.update(PYTHONPATH=str(REPO / "injectors"), REPRO_PLAN=str(tmp / "plan.json"), OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable, str(prog), str(r), "2", str(tmp / "init"), str(out), "--mode", "extra",
                                   "--ticks", "3", "--lifetime-s", "60"], env=env, start_new_session=True,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in range(2)]
        try:
            deadline = time.time() + 60
            seen = None
            while time.time() < deadline and seen is None:
                for f in out.glob("ledger-*.jsonl"):
                    for line in f.read_text().splitlines():
                        if '"red":"MAX"' in line and '"e":"enter"' in line:
                            seen = time.time() - json.loads(line)["t"]
                time.sleep(0.002)
            if seen is not None:
                lat.append(seen)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    print(f"hung record on disk after (ms, {len(lat)}/{n} runs): " + ", ".join(f"{x * 1e3:.0f}" for x in lat)
          + (f"; median {statistics.median(lat) * 1e3:.0f}, max {max(lat) * 1e3:.0f}" if lat else ""))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--hang-latency", type=int, default=0)
    args = ap.parse_args()
    if args.hang_latency:
        hang_latency(args.hang_latency)
        return
    import torch
    import torch.distributed as dist

    tmp = Path(tempfile.mkdtemp(prefix="ledger-bench-"))
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'init'}", rank=0, world_size=1)
    t = torch.ones(1)
    pg = dist.new_group(backend="gloo")
    coord = GroupCoordinator(dist, pg)
    raw_ar = lambda x: dist.all_reduce(x)  # noqa: E731  (looks dist.all_reduce up at call time, like sglang)
    orig_ar = dist.all_reduce
    orig_coord = GroupCoordinator.all_reduce
    coord_ar = lambda x: coord.all_reduce(x)  # noqa: E731  (method looked up per call)

    out = tmp / "out"
    out.mkdir()
    plan = {"version": 1, "scenario": "bench", "variant": "v", "out_dir": str(out), "arm_file": str(tmp / "arm"),
            "injections": [], "ledger": {"enabled": True, "max_records": 10_000_000, "tick_function": "",
                                         "coordinators": ["__main__:GroupCoordinator"]}}
    (tmp / "plan.json").write_text(json.dumps(plan))
    os.environ["REPRO_PLAN"] = str(tmp / "plan.json")
    from repro_injector import _runtime

    rt = _runtime.activate()
    assert rt is not None and rt.ledger is not None, "ledger not active"
    rt.ledger._patch_coordinator(sys.modules["__main__"], "GroupCoordinator")
    wrapped_ar, wrapped_coord = dist.all_reduce, GroupCoordinator.all_reduce
    # interleave unpatched and patched runs so machine load hits both alike
    res: dict = {k: ([], [], []) for k in ("base", "led", "base_c", "led_c")}
    for _ in range(args.repeats):
        for key, ar, cm, fn in (("base", orig_ar, orig_coord, raw_ar), ("led", wrapped_ar, wrapped_coord, raw_ar),
                                ("base_c", orig_ar, orig_coord, coord_ar),
                                ("led_c", wrapped_ar, wrapped_coord, coord_ar)):
            dist.all_reduce, GroupCoordinator.all_reduce = ar, cm
            rt.ledger.drain()  # nothing of the previous run left for this one
            w, c, pc = _run(fn, t, args.calls, 1, rt.ledger.drain)
            res[key][0].append(w)
            res[key][1].append(c)
            res[key][2].append(pc)
    dist.all_reduce, GroupCoordinator.all_reduce = wrapped_ar, wrapped_coord
    med = {k: (statistics.median(v[0]), statistics.median(v[1]), statistics.median(v[2])) for k, v in res.items()}
    base, led, base_c, led_c = med["base"], med["led"], med["base_c"], med["led_c"]
    w0 = time.perf_counter()
    rt.ledger.drain()
    drain_s = time.perf_counter() - w0
    n = rt.ledger.total
    rows = [("dist.all_reduce (1 float, world 1)", base, led), ("GroupCoordinator.all_reduce (nested)", base_c, led_c)]
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, {args.calls} calls x {args.repeats} repeats")
    print("| call | baseline wall us | ledger wall us | added wall us | baseline CPU us | ledger CPU us | added CPU us "
          "| added process CPU us (writer included) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, b, l in rows:
        print(f"| {name} | {b[0]*1e6:.1f} | {l[0]*1e6:.1f} | {(l[0]-b[0])*1e6:.1f} | {b[1]*1e6:.1f} | {l[1]*1e6:.1f} | "
              f"{(l[1]-b[1])*1e6:.1f} | {(l[2]-b[2])*1e6:.1f} |")
    print(f"records written: {n}; final drain of the remaining queue {drain_s*1e3:.1f} ms; file "
          f"{sum(f.stat().st_size for f in out.glob('ledger-*.jsonl')) / max(n, 1):.0f} bytes per record")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
