"""Time and peak memory of `repro analyze` on big inputs (numbers go to benchmarks/RESULTS.md).

    python benchmarks/analyze_memory.py [--mb 50]

Cases, each run in a fresh `python -m repro analyze` subprocess (peak RSS and CPU seconds from its rusage; CPU
seconds stay comparable on a loaded machine, wall seconds do not):
- stack-like: a 50 MB file of successive py-spy dumps of the 3 real gloo ranks (tests/fixtures/pasted/pyspy_text_gloo3)
  repeated, as a log that captured py-spy every few seconds holds;
- deep: one process whose main thread has 50 MB of frames (a runaway recursion);
- junk: 50 MB of random printable text; binary: 50 MB of random bytes; empty folder.
"""
import argparse
import os
import random
import resource
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


_WRAP = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
         "u = resource.getrusage(resource.RUSAGE_CHILDREN); "
         "print('MAXRSS_KIB', u.ru_maxrss, file=sys.stderr); "
         "print('CPU_S', u.ru_utime + u.ru_stime, file=sys.stderr); "
         "sys.exit(r.returncode)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=50)
    a = ap.parse_args()
    load0 = os.getloadavg()[0]
    size = a.mb * 1024 * 1024
    tmp = Path(tempfile.mkdtemp(prefix="repro-bench-"))
    src = ROOT / "tests" / "fixtures" / "pasted" / "pyspy_text_gloo3"
    unit = "\n".join((src / f"rank{k}.txt").read_text() for k in range(3)) + "\n"
    stack = tmp / "stack_like.txt"
    with open(stack, "w") as f:
        n = 0
        while n < size:
            f.write(unit)
            n += len(unit)
    deep = tmp / "deep.txt"
    with open(deep, "w") as f:
        f.write('Process 1: python deep.py\nPython v3.11.7 (/usr/bin/python3)\n\nThread 1 (active): "MainThread"\n')
        line = "    recurse (deep.py:3)\n"
        f.write(line * (size // len(line)))
    # issue 29 item 1: one "Process" header over 50 MB of thread blocks, the same block again (one thread id) and
    # distinct MainThread blocks (one process: a rank starts only at a header; benchmarks/analyze_one_header.py has
    # the cases built from a real dump)
    blk = ('Thread {tid} (idle): "MainThread"\n    all_reduce (torch/distributed/distributed_c10d.py:2501)\n'
           '    event_loop_normal (sglang/srt/managers/scheduler.py:900)\n\n')
    hdr = "Process 4242: python3 -m sglang.launch_server\nPython v3.11.7 (/usr/bin/python3)\n\n"
    one_same, one_distinct = tmp / "one_header_same.txt", tmp / "one_header_distinct.txt"
    with open(one_same, "w") as f:
        b = blk.format(tid="0x7F00DEADBEEF")
        f.write(hdr + b * (size // len(b)))
    with open(one_distinct, "w") as f:
        f.write(hdr)
        n, k = 0, 0
        while n < size:
            b = blk.format(tid=hex(0x7F0000000000 + k))
            f.write(b)
            n, k = n + len(b), k + 1
    junk = tmp / "junk.txt"
    rnd = random.Random(0)
    with open(junk, "w") as f:
        chunk = "".join(rnd.choice(string.ascii_letters + " .,;:!?\n") for _ in range(1 << 20))
        for _ in range(a.mb):
            f.write(chunk)
    binary = tmp / "core.bin"
    with open(binary, "wb") as f:
        for _ in range(a.mb):
            f.write(rnd.randbytes(1 << 20))
    empty = tmp / "empty"
    empty.mkdir()
    rows = []
    for name, path in [("stack-like (successive py-spy dumps)", stack), ("deep recursion (one thread)", deep),
                       ("one header, one block repeated", one_same),
                       ("one header, distinct MainThread blocks", one_distinct), ("junk text", junk), ("binary", binary), ("empty folder", empty)]:
        t0 = time.time()
        p = subprocess.run([sys.executable, "-c", _WRAP, sys.executable, "-m", "repro", "analyze", str(path)],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
        dt = time.time() - t0
        err = [ln for ln in p.stderr.splitlines() if not ln.startswith(("MAXRSS_KIB", "CPU_S"))]
        rss = int(next(ln.split()[1] for ln in p.stderr.splitlines() if ln.startswith("MAXRSS_KIB")))
        cpu = float(next(ln.split()[1] for ln in p.stderr.splitlines() if ln.startswith("CPU_S")))
        text = "\n".join(err) + "\n" + p.stdout
        lines = [ln for ln in text.splitlines() if ln.strip()]
        rows.append((name, path.stat().st_size if path.is_file() else 0, dt, cpu, rss, p.returncode, len(lines),
                     " ".join(text.split())[:100]))
    print(f"load average at the start: {load0:.1f}, at the end: {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)")
    print("| input | bytes | wall s | CPU s | peak RSS (MiB) | exit | output lines | output starts |")
    print("|---|---|---|---|---|---|---|---|")
    for name, b, dt, cpu, rss, rc, nl, first in rows:
        print(f"| {name} | {b} | {dt:.1f} | {cpu:.1f} | {rss / 1024:.0f} | {rc} | {nl} | {first} |")
    for p in tmp.iterdir():
        if p.is_file():
            p.unlink()
    empty.rmdir()
    tmp.rmdir()


if __name__ == "__main__":
    main()
