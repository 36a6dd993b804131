"""Repeatability of the vLLM smoke (scenarios/vllm/smoke_extra_allreduce.toml) on the vLLM CPU testbed.

Each repeat starts one real vLLM TP=2 server (``repro.runner.run_many``) and runs the ``control`` variant (expects
ALL REQUESTS SUCCEEDED) then the ``extra_collective`` variant (expects DEADLOCKED; the deadlock ends the server), as
the vllm stage's e2e test does, so N repeats give N controls and N deadlocks on N fresh servers. Checked per run:

- deadlock: the verdict, a stack file of both workers (``stacks/rank0*``, ``stacks/rank1*``), and the ledger's first
  divergence (``ledger.json``) at the injected all_reduce on rank 0;
- control: the verdict, every request answered, the patched site entered on both ranks and never fired;
- after each repeat's server stopped: none of its recorded processes alive, none of the shared-memory segments
  (``/dev/shm/vllm_dist_<id>-…``) or file stores (``/tmp/vllm_dist_<id>``) its logs name left, and no new
  ``vllm_dist_*`` entry in /dev/shm or /tmp at all (compared with before the repeat).

Prints one JSON line per run and a markdown table for benchmarks/RESULTS.md. Starts real servers: run it under the
e2e lock (``flock /tmp/repro-e2e.lock python benchmarks/vllm_repeat.py``). Exit 0 iff every check passed.

    python benchmarks/vllm_repeat.py --repeats 5 [--evidence-dir /tmp/vllm-repeat] [--json-out rows.json]
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
from repro.procs import alive, load_procs  # noqa: E402
from repro.runner import RunOptions, run_many  # noqa: E402
from repro.targets.vllm import testbed as vtb  # noqa: E402

SMOKE = REPO / "scenarios" / "vllm" / "smoke_extra_allreduce.toml"
INJECTION = "extra_allreduce_before_execute_model"


def _dist_entries() -> set[str]:
    return {str(p) for d in (Path("/dev/shm"), Path("/tmp")) for p in d.glob("vllm_dist_*")}


def _deadlock_checks(res) -> list[str]:
    bad = []
    if res.verdict.verdict != "DEADLOCKED":
        bad.append(f"verdict {res.verdict.verdict}: {res.verdict.reason}")
    stacks = [p.name for p in (res.evidence / "stacks").glob("rank*.txt")]
    for k in (0, 1):
        if not any(n.startswith(f"rank{k}") for n in stacks):
            bad.append(f"no stack of rank {k}")
    div = (read_json(res.evidence / "ledger.json") or {}).get("divergence") or {}
    first = (div.get("entered") or {}).get("0") or {}
    if first.get("inj") != INJECTION:
        bad.append(f"ledger's first divergence is not the injected all_reduce on rank 0: {json.dumps(div)[:300]}")
    return bad


def _control_checks(res) -> list[str]:
    bad = []
    if res.verdict.verdict != "ALL REQUESTS SUCCEEDED":
        bad.append(f"verdict {res.verdict.verdict}: {res.verdict.reason}")
    if not (res.requests_total > 0 and res.requests_ok == res.requests_total):
        bad.append(f"requests {res.requests_ok}/{res.requests_total}")
    counts = res.injector.counts_by_rank("observe_execute_model")
    if not (counts["entered"].get(0, 0) > 0 and counts["entered"].get(1, 0) > 0) or any(counts["fired"].values()):
        bad.append(f"site counts {counts}")
    return bad


def _median(xs: list) -> str:
    xs = [x for x in xs if x is not None]
    return f"{statistics.median(xs):.1f}" if xs else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--evidence-dir", type=Path, default=Path("/tmp/vllm-repeat"))
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args()
    if not vtb.is_set_up():
        print(f"the vLLM testbed is not set up; run `{vtb.setup_command()}`", file=sys.stderr)
        return 2
    rows, ok = [], True
    names = ["control", "extra_collective"]
    for i in range(args.repeats):
        before = _dist_entries()
        t0 = time.time()
        results = dict(zip(names, run_many(RunOptions(scenario_path=SMOKE, evidence_root=args.evidence_dir,
                                                      label=f"rep{i}"), names)))
        wall = time.time() - t0
        session = Path(read_json(results["control"].evidence / "session.json")["session"])
        procs = load_procs(session / "processes.json")
        logs = sorted(session.glob("**/server.log")) + [r.evidence / "server.log" for r in results.values()]
        named = sorted({str(p) for log in logs if log.is_file() for p in vtb.dist_files(log.read_text(errors="replace"))})
        left = {"processes": [p.pid for p in procs if alive(p)], "named_files": named,
                "new_dist_entries": sorted(_dist_entries() - before)}
        ids = {x for log in logs if log.is_file() for x in vtb.dist_ids(log.read_text(errors="replace"))}
        for name, res in results.items():
            bad = (_control_checks if name == "control" else _deadlock_checks)(res)
            if not ids:
                bad.append("no vllm_dist_<id> in the server logs")
            bad += [f"left behind: {k} {v}" for k, v in left.items() if v]
            v = read_json(res.evidence / "verdict.json") or {}
            t = (read_json(res.evidence / "run.json") or {}).get("timings") or {}
            row = {"repeat": i, "variant": name, "verdict": res.verdict.verdict, "ok": not bad, "problems": bad,
                   "to_verdict_s": round(t["to_verdict_s"], 2) if "to_verdict_s" in t else None,
                   "last_progress_to_verdict_s": v.get("timings", {}).get("last_progress_to_verdict_s"),
                   "server_wall_s": round(wall, 1), "evidence": str(res.evidence)}
            ok = ok and not bad
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print("| variant | runs | as expected | verdicts | last progress → verdict (median / max, s) | run → verdict "
          "(median, s) | server wall: launch → stopped, both variants (median, s) | left behind |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        rs = [r for r in rows if r["variant"] == name]
        counts: dict[str, int] = {}
        for r in rs:
            counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
        lat = [r["last_progress_to_verdict_s"] for r in rs if r["last_progress_to_verdict_s"] is not None]
        lat_s = f"{statistics.median(lat):.1f} / {max(lat):.1f}" if lat else "-"
        left_n = sum(any(p.startswith("left behind") for p in r["problems"]) for r in rs)
        print(f"| {name} | {len(rs)} | {sum(r['ok'] for r in rs)}/{len(rs)} | "
              f"{', '.join(f'{n}/{len(rs)} {k}' for k, n in counts.items())} | {lat_s} | "
              f"{_median([r['to_verdict_s'] for r in rs])} | {statistics.median(r['server_wall_s'] for r in rs):.1f} | "
              f"{'nothing' if not left_n else f'{left_n} run(s)'} |")
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
