"""Time from `repro reproduce` to REPRODUCTION.md (numbers go to benchmarks/RESULTS.md).

    flock /tmp/repro-e2e.lock python benchmarks/reproduce_time.py DUMPS... [--only CANDIDATE ...] [--out DIR]

Copies the dumps with every injector and ledger frame (and the injector's own threads) removed, as the issue's
"stacks copied out alone" asks, then runs `python -m repro reproduce` on them (real server on the CPU testbed) and
prints one JSON line: seconds to write the candidates (``--no-run``), seconds to REPRODUCTION.md, exit code, outcome
per candidate. Starts a real SGLang server: run it under the shared e2e lock.
"""
import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_INJECTOR_LINE = re.compile(r"repro_injector|sitecustomize\.py|usercustomize\.py|repro_ledger\[|repro_injected\[|repro_tick\[")


def strip_injector(src: Path, dst: Path) -> None:
    """Copy a py-spy text dump without injector/ledger frames and without the injector's threads."""
    out, skip = [], False
    for line in src.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("Thread "):
            skip = '"repro-' in line
        if skip or _INJECTOR_LINE.search(line):
            continue
        out.append(line)
    dst.write_text("\n".join(out) + "\n", encoding="utf-8")


def first_capture(d: Path) -> list[Path]:
    """The text dump of each rank's first capture in a stacks folder (``rank<k>.txt``, or ``rank<k>-proof.txt`` when
    the ledger proof took it); a file stands for itself."""
    if not d.is_dir():
        return [d]
    out = []
    for k in sorted({int(m.group(1)) for f in d.glob("rank*.txt") if (m := re.match(r"rank(\d+)", f.name))}):
        f = next((d / n for n in (f"rank{k}.txt", f"rank{k}-proof.txt") if (d / n).is_file()), None)
        if f is not None:
            out.append(f)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dumps", nargs="+", type=Path, help="stacks folders (rank<k>.txt or rank<k>-proof.txt) or files of a hung run")
    ap.add_argument("--only", action="append", default=[])
    ap.add_argument("--out", type=Path, default=Path("/tmp/reproduce-bench"))
    a = ap.parse_args()
    clean = a.out / "dumps"
    clean.mkdir(parents=True, exist_ok=True)
    for d in a.dumps:
        for f in first_capture(d):
            strip_injector(f, clean / (f.name.split("-", 1)[0].removesuffix(".txt") + ".txt"))
    base = [sys.executable, "-m", "repro", "reproduce", str(clean), "--out", str(a.out / "result")]
    only = [x for o in a.only for x in ("--only", o)]
    t0 = time.monotonic()
    subprocess.run(base + ["--no-run"], cwd=ROOT, capture_output=True)
    t_write = time.monotonic() - t0
    t0 = time.monotonic()
    p = subprocess.run(base + only + ["--json"], cwd=ROOT, capture_output=True, text=True)
    t_all = time.monotonic() - t0
    try:
        res = json.loads(p.stdout)
    except ValueError:
        res = {"stderr": p.stderr[-2000:]}
    print(json.dumps({"write_s": round(t_write, 1), "to_reproduction_md_s": round(t_all, 1), "exit": p.returncode,
                      "tried": [(t["candidate"], t["verdict"], t["outcome"]) for t in res.get("tried", [])],
                      "error": res.get("stderr", "")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
