"""PD disaggregation on the CPU testbed: repeated verdicts, stack start-up, and Ctrl-C mid-burst (issue: PD).

Runs ``scenarios/sglang/disagg_bootstrap_divergence.toml`` (prefill TP=4 + HiCache, decode TP=1, router):

- ``--repeats N``: N × ``control`` then N × ``mass_abort`` on ONE stack (re-armed between them), then N (or
  ``--divergence M``) × ``divergence`` (each hangs its stack, so the session restarts it before the next one); per
  run the verdict, the per-rank abort counts (mass_abort),
  the server that diverged, requests ok/aborted, and the stack's start-up (every role's health, the router's
  ``/workers``);
- ``--interrupt``: one ``python -m repro run … --variant divergence`` in a child, SIGINT once the burst has been
  sent, then checks that no process of that run is left (``repro.procs.processes_mentioning`` on its evidence
  folder) and that the folder says ``interrupted``.

Prints a markdown table for benchmarks/RESULTS.md and writes the raw numbers as JSON. Start it under the shared
lock: ``flock /tmp/repro-e2e.lock python benchmarks/pd_repeat.py --repeats 5``.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from repro.evidence import read_json  # noqa: E402
from repro.procs import processes_mentioning  # noqa: E402
from repro.runner import RunOptions, run_many  # noqa: E402

DISAGG = REPO / "scenarios" / "sglang" / "disagg_bootstrap_divergence.toml"


def _row(res) -> dict:
    v = read_json(res.evidence / "verdict.json") or {}
    session = (read_json(res.evidence / "session.json") or {}).get("session")
    stack = (read_json(Path(session) / "stack.json") or {}) if session else {}
    events = [json.loads(x) for x in (res.evidence / "requests.jsonl").read_text().splitlines() if x.strip()]
    aborted = sum(len(e.get("requests", [])) for e in events if e.get("event") == "abort")
    return {"variant": res.evidence.name.split("-", 1)[1], "verdict": res.verdict.verdict,
            "diverged": v.get("diverged_server"), "ok": res.requests_ok, "total": res.requests_total,
            "aborted": aborted, "abort_counts": _abort_counts(res.evidence), "to_verdict_s": round(res.timings.get("to_verdict_s", 0.0), 1),
            "evidence": str(res.evidence), "stack": stack}


def _abort_counts(run: Path) -> str:
    """The run REPORT's per-rank counts of the mass abort's counted sites, one short string ("" for other variants)."""
    try:
        text = (run / "REPORT.md").read_text(encoding="utf-8")
    except OSError:
        return ""
    if "## After the mass abort" not in text:
        return ""
    tail = text.split("## After the mass abort", 1)[1]
    out = []
    for ln in tail.splitlines():
        if not (ln.startswith("- ") and "`" in ln and "collective(s)" not in ln):
            continue
        rank, rest = ln[2:].split(":", 1)
        nums = [part.rsplit(" ", 1)[1] for part in rest.split(",") if "abort" in part]  # aborts handled / AbortReqs
        out.append(f"{rank} {'/'.join(nums)}")
    return ", ".join(out)


def repeats(n: int, root: Path, n_divergence: int | None = None) -> list[dict]:
    n_div = n if n_divergence is None else n_divergence
    names = ["control"] * n + ["mass_abort"] * n + ["divergence"] * n_div
    rows = []
    t0 = time.time()
    for res in run_many(RunOptions(DISAGG, evidence_root=root), names):
        rows.append(_row(res))
    rows.append({"wall_s": round(time.time() - t0, 1)})
    return rows


def interrupt(root: Path) -> dict:
    t0 = time.time()
    child = subprocess.Popen([sys.executable, "-m", "repro", "run", str(DISAGG), "--variant", "divergence",
                              "--evidence-dir", str(root), "--label", "interrupted"], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    folder = None
    try:
        deadline = time.time() + 600
        while time.time() < deadline and child.poll() is None:
            runs = sorted((root / "disagg_bootstrap_divergence").glob("*-interrupted"))
            if runs:
                folder = runs[-1]
                req = folder / "requests.jsonl"
                if req.exists() and '"sent"' in req.read_text():
                    time.sleep(1.0)  # mid-burst
                    child.send_signal(signal.SIGINT)
                    break
            time.sleep(0.5)
        out, _ = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    time.sleep(1.0)
    left = processes_mentioning(folder) if folder else ["no run folder"]
    run = read_json(folder / "run.json") if folder else None
    return {"exit_code": child.returncode, "left_running": left, "status": (run or {}).get("status"),
            "wall_s": round(time.time() - t0, 1), "evidence": str(folder), "tail": out[-600:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=0, help="control and mass_abort runs (and divergence runs unless "
                    "--divergence says otherwise)")
    ap.add_argument("--divergence", type=int, default=None, help="divergence runs (each restarts the stack, ~2 min)")
    ap.add_argument("--interrupt", action="store_true")
    ap.add_argument("--evidence-dir", type=Path, default=Path("/tmp/repro-pd-repeat"))
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args()
    out: dict = {}
    if args.repeats:
        out["repeats"] = repeats(args.repeats, args.evidence_dir, args.divergence)
        print("| variant | verdict | diverged server | requests ok / aborted / total | to verdict (s) | per rank: FINISH_ABORT / abort_request |")
        print("|---|---|---|---|---|---|")
        for r in out["repeats"]:
            if "variant" in r:
                print(f"| {r['variant']} | {r['verdict']} | {r['diverged'] or '—'} | {r['ok']} / {r['aborted']} / "
                      f"{r['total']} | {r['to_verdict_s']} | {r['abort_counts'] or '—'} |")
        print(f"wall: {out['repeats'][-1]['wall_s']} s")
    if args.interrupt:
        out["interrupt"] = interrupt(args.evidence_dir)
        i = out["interrupt"]
        print(f"Ctrl-C mid-burst: exit {i['exit_code']}, status {i['status']}, left running: {i['left_running'] or 'nothing'}"
              f", {i['wall_s']} s")
    if args.json_out:
        args.json_out.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
