"""`repro analyze` on 50 MB dumps of one process, and on the bounds' worst cases (issue 29 item 1; numbers go to
benchmarks/RESULTS.md).

    python benchmarks/analyze_one_header.py [--mb 50] [--only NAME ...] [--keep DIR]

Every input but the last is built from a real py-spy 0.4.3 dump of one SGLang TP=2 rank (tests/fixtures/dumps/sglang_tp2_cpu_hang,
rank 1: its scheduler's main thread in all_reduce, a watchdog and a tqdm thread), written out to ``--mb`` MB:
- ``repeated``: one ``Process`` header, then that process's threads again and again (same thread ids), a blank line
  between threads (the layout of issue 29's 50 MB file that was read as 100,438 ranks);
- ``many-threads``: one header, the main thread once, then distinct background threads (new thread ids, half of them
  with the main thread's 33 frames), a blank line between threads: one process with very many threads;
- ``mainthreads``: one header, then distinct ``MainThread`` blocks (each with another thread id), as a paste that
  lost every other header holds;
- ``no-header``: the dump without its ``Process``/``Python`` lines, repeated (same thread ids): the "repeated text
  without headers" kind (issue 29: "another 50 MB file became (2 processes)");
- ``rank-prefixes``: torch's ``[rank<k>]:`` prefix on every line of that dump, a new k for each copy (about 20,000
  ranks): the bound on ranks;
- ``new-frames``: not from the fixture: 1,645 headed processes of 12 threads whose 100 frames are all different
  (no frame repeats): the bound on memory (distinct frames and threads kept per file).
Each case runs in a fresh ``python -m repro analyze FILE`` child; its peak RSS and CPU seconds come from that child's
own rusage (``os.wait4``), and its stdout and stderr go to a file whose non-blank lines are counted. Wall seconds
depend on the machine's load (printed); CPU seconds less so.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "tests" / "fixtures" / "dumps" / "sglang_tp2_cpu_hang" / "rank1.txt"


def _threads(text: str) -> list[list[str]]:
    """The dump's thread blocks (each its 'Thread' line and frames), in order."""
    blocks: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith("Thread "):
            blocks.append([line])
        elif blocks and line.strip():
            blocks[-1].append(line)
    return blocks


def _retid(block: list[str], tid: int, name: str = "") -> str:
    head = re.sub(r"^Thread \d+", f"Thread {tid}", block[0])
    if name:
        head = re.sub(r'"[^"]*"$', f'"{name}"', head)
    return "\n".join([head] + block[1:]) + "\n"


def write_case(name: str, path: Path, size: int) -> None:
    text = SRC.read_text()
    header = "".join(text.splitlines(keepends=True)[:3])  # Process, Python, blank
    body = "\n".join("\n".join(b) for b in _threads(text)) + "\n"
    blank_body = "\n\n".join("\n".join(b) for b in _threads(text)) + "\n\n"
    main, *others = _threads(text)
    with open(path, "w") as f:
        n = 0
        if name in ("repeated", "many-threads", "mainthreads"):
            f.write(header)
        if name == "repeated":
            while n < size:
                f.write(blank_body)
                n += len(blank_body)
        elif name == "many-threads":
            f.write(_retid(main, 9283) + "\n")
            k = 0
            while n < size:
                src = main if k % 2 else others[k % len(others)]
                b = _retid(src, 20000 + k, f"Thread-{k + 2} (worker)") + "\n"
                f.write(b)
                n, k = n + len(b), k + 1
        elif name == "mainthreads":
            k = 0
            while n < size:
                b = _retid(main, 20000 + k) + "\n"
                f.write(b)
                n, k = n + len(b), k + 1
        elif name == "no-header":
            while n < size:
                f.write(body)
                n += len(body)
        elif name == "rank-prefixes":
            k = 0
            while n < size:
                b = "".join(f"[rank{k}]: {ln}\n" for ln in body.splitlines())
                f.write(b)
                n, k = n + len(b), k + 1
        elif name == "new-frames":
            k = 0
            while n < size:
                b = [f"Process {10000 + k}: python job.py\nPython v3.11.7 (/usr/bin/python3)\n\n"]
                for t in range(12):
                    b.append(f'Thread {20000 + k * 16 + t} (idle): "Thread-{t}"\n')
                    b.extend(f"    f{k}_{t}_{i} (m{i}.py:{i})\n" for i in range(100))
                b = "".join(b)
                f.write(b)
                n, k = n + len(b), k + 1
        else:
            raise SystemExit(f"unknown case {name!r}")


CASES = ("repeated", "many-threads", "mainthreads", "no-header", "rank-prefixes", "new-frames")


def run_case(path: Path, out: Path) -> dict:
    t0 = time.time()
    with open(out, "w") as fo:
        p = subprocess.Popen([sys.executable, "-m", "repro", "analyze", str(path)], cwd=ROOT, stdout=fo,
                             stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "200"})
        try:
            _, status, ru = os.wait4(p.pid, 0)
        except BaseException:
            p.kill()  # this script's own child, by pid
            p.wait()
            raise
        p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.time() - t0
    text = out.read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    flat = " ".join(text.split())
    m = re.search(r"read as: (.*?\(\d+ process(?:es)?\))", flat)
    summary = next((ln for ln in lines if re.match(r"^(Only|Not diverged|DIVERGED|All|No )", ln)), lines[0] if lines else "")
    return {"wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime, "rss_mib": ru.ru_maxrss / 1024, "exit": p.returncode,
            "lines": len(lines), "bytes_out": len(text.encode()), "read_as": m.group(1) if m else "",
            "summary": " ".join(summary.split())[:90]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=50)
    ap.add_argument("--only", nargs="*", default=list(CASES))
    ap.add_argument("--keep", type=Path, default=None, help="write the inputs and outputs here and keep them")
    a = ap.parse_args()
    tmp = a.keep or Path(tempfile.mkdtemp(prefix="repro-bench-"))
    tmp.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()[0]
    rows = []
    for name in a.only:
        path = tmp / f"{name}.txt"
        write_case(name, path, a.mb << 20)
        r = run_case(path, tmp / f"{name}.out")
        rows.append((name, path.stat().st_size, r))
        print(name, r, flush=True, file=sys.stderr)
        if a.keep is None:
            path.unlink()
            (tmp / f"{name}.out").unlink()
    if a.keep is None:
        tmp.rmdir()
    print(f"load average at the start: {load0:.1f}, at the end: {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)")
    print("| input | bytes | wall s | CPU s | peak RSS (MiB) | exit | output lines | read as | summary starts |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, size, r in rows:
        print(f"| {name} | {size} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['rss_mib']:.0f} | {r['exit']} | "
              f"{r['lines']} | {r['read_as']} | {r['summary']} |")


if __name__ == "__main__":
    main()
