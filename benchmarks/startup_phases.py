"""Where a testbed server's start-up time goes, phase by phase (issue 36 item 1).

Launches the SGLang CPU testbed server (the smoke scenario's ``control`` variant: the injector and its ledger
loaded in every rank, as every CI run has them) ``--repeats`` times, one at a time, and stamps each phase when its
first sign appears: the arrival time of the first log line that matches the phase's pattern (the log is tailed every
50 ms, so a stamp is late by at most that), the moment the rank processes exist (their titles, via
``repro.launcher.Server.rank_pids``), and the first ``/health`` 200. Each server is ended by its process group
(``Server.stop``) before the next starts, also on Ctrl-C.

Phases (cumulative seconds from ``Popen``; the patterns are the log lines sglang 0.5.23 prints, checked against
``sglang/srt/managers/scheduler.py``, ``model_executor/model_runner.py`` and ``entrypoints/http_server.py`` of the
installed wheel; a pattern that never matched is reported as missing, never guessed):

- ``launcher_args``: the launcher process has imported sglang and printed its server args;
- ``ranks_spawned``: the scheduler processes (``sglang::scheduler_TPk``) exist;
- ``rank_first_line``: a rank printed its first line (its imports are done);
- ``dist_init_end``, ``load_weight_end``, ``kv_pool``: distributed init, weights, the memory pools;
- ``uvicorn``: the HTTP server listens;
- ``healthy``: ``GET /health`` answers 200;
- ``warmup_done``: the launcher's warm-up request came back ("The server is fired up").

``--fork-ranks on|off|alternate`` (default ``off``): launch with ``REPRO_FORK_RANKS=1`` (the injector makes
sglang fork its ranks from the launcher instead of spawning them, ``injectors/repro_injector/_fork.py``), without it,
or both in one run: ``alternate`` makes ``--repeats`` pairs, off/on in turn (on/off in the next pair), so both
settings see the same box. With the opt-in the launcher's ``fork_point`` events (Python and native threads alive
at each fork) are copied into the launch's row (``--json``).

Usage::

    python benchmarks/startup_phases.py --repeats 3 [--fork-ranks alternate] [--json out.json] [--extra-args "--skip-server-warmup"]

Prints one row per launch and the median / min / max per phase (one table per setting); the numbers go to
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SMOKE = REPO / "scenarios" / "sglang" / "smoke_extra_allreduce.toml"
PHASES = [  # (name, pattern on a log line); order = the order they are printed in
    ("launcher_args", re.compile(r"server_args=")),
    ("rank_first_line", re.compile(r"\bTP\d\]")),
    ("dist_init_end", re.compile(r"Init torch distributed ends|init_distributed_environment.*done", re.I)),
    ("load_weight_end", re.compile(r"Load weight end")),
    ("kv_pool", re.compile(r"KV Cache is allocated|Memory pool end|max_total_num_tokens=")),
    ("uvicorn", re.compile(r"Uvicorn running on")),
    ("warmup_done", re.compile(r"The server is fired up and ready to roll")),
]


def _fork_points(injector_dir: Path) -> list[dict]:
    """The ``fork_point`` events of the launch's injector folder (the launcher's threads at each fork)."""
    out = []
    for f in sorted(injector_dir.glob("fires-*.jsonl")):
        for ln in f.read_text().splitlines():
            if '"fork_point"' in ln:
                e = json.loads(ln)
                out.append({"n": e["n"], "python_threads": [t["name"] for t in e["python_threads"]],
                            "native_threads": e["native_threads"]})
    return out


def one_launch(tmp: Path, extra_args: list[str], timeout_s: float, fork_ranks: bool = False) -> dict:
    """Launch (with ``REPRO_FORK_RANKS=1`` when ``fork_ranks``), stamp the phases, stop. Returns ``{phase: seconds
    from Popen}`` plus ``stop_s`` and, with ``fork_ranks``, ``fork_points``."""
    from repro.launcher import start_server
    from repro.runner import RunOptions, prepare

    env = {"REPRO_FORK_RANKS": "1" if fork_ranks else "0"}
    p = prepare(RunOptions(scenario_path=SMOKE, variant="control", evidence_root=tmp, label="startup-bench",
                           extra_env=env))
    spec = p.spec
    if extra_args:
        from dataclasses import replace

        spec = replace(spec, args=list(spec.args) + list(extra_args))
    log = p.evidence.file("server.log")
    t0 = time.monotonic()
    server = start_server(p.adapter, spec, log)
    stamps: dict[str, float] = {}
    pos = 0
    buf = b""
    next_probe = 0.0
    try:
        deadline = t0 + timeout_s
        while time.monotonic() < deadline:
            now = time.monotonic() - t0
            with open(log, "rb") as f:
                f.seek(pos)
                chunk = f.read()
            pos += len(chunk)
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                for name, pat in PHASES:
                    if name not in stamps and pat.search(line):
                        stamps[name] = round(now, 2)
            if "ranks_spawned" not in stamps and server.rank_pids():
                stamps["ranks_spawned"] = round(now, 2)
            if "healthy" not in stamps and "uvicorn" in stamps and time.monotonic() >= next_probe:
                # one probe at a time, each allowed 5 s (sglang's /health runs a 1-token generate: on a loaded
                # 2-core box that takes more than a second), so a probe that times out is not a failed start
                probe_t = time.monotonic()
                if server.health_ok(timeout_s=5.0):
                    stamps["healthy"] = round(time.monotonic() - t0, 2)
                    stamps["health_probe_s"] = round(time.monotonic() - probe_t, 2)
                next_probe = time.monotonic() + 0.25
            if not server.is_running():
                raise RuntimeError(f"server exited during start-up; see {log}")
            if "healthy" in stamps and "warmup_done" in stamps:
                break
            if "healthy" in stamps and time.monotonic() - t0 > stamps["healthy"] + 30:
                break  # no warm-up line (e.g. --skip-server-warmup)
            time.sleep(0.05)
    finally:
        ts = time.monotonic()
        left = server.stop()
        stamps["stop_s"] = round(time.monotonic() - ts, 2)
        if left:
            print(f"WARNING: left running: {left}", file=sys.stderr)
    if fork_ranks:
        stamps["fork_points"] = _fork_points(p.evidence.injector_dir)
    return stamps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--extra-args", default="", help="server arguments appended to the scenario's (one string)")
    ap.add_argument("--json", type=Path, default=None, help="write every launch's stamps here")
    ap.add_argument("--fork-ranks", choices=("off", "on", "alternate"), default="off",
                    help="REPRO_FORK_RANKS=1 (fork sglang's ranks) off, on, or alternate off/on pairs in one run")
    a = ap.parse_args()
    if a.repeats < 1:
        print(f"--repeats {a.repeats}: expected 1 or more", file=sys.stderr)
        return 2
    extra = shlex.split(a.extra_args)
    if a.fork_ranks == "alternate":  # pairs, the order flipped each pair: off,on, on,off, off,on ...
        plan = [x for i in range(a.repeats) for x in ((False, True) if i % 2 == 0 else (True, False))]
    else:
        plan = [a.fork_ranks == "on"] * a.repeats
    runs = []
    with tempfile.TemporaryDirectory(prefix="startup-bench-") as d:
        for i, fork in enumerate(plan):
            s = one_launch(Path(d) / f"r{i}", extra, a.timeout_s, fork_ranks=fork)
            s["fork_ranks"] = fork
            runs.append(s)
            print(json.dumps({"launch": i + 1, **{k: v for k, v in s.items() if k != "fork_points"}}), flush=True)
    names = ["launcher_args", "ranks_spawned", "rank_first_line", "dist_init_end", "load_weight_end", "kv_pool",
             "uvicorn", "warmup_done", "healthy", "health_probe_s", "stop_s"]
    for fork in sorted({r["fork_ranks"] for r in runs}):
        sel = [r for r in runs if r["fork_ranks"] == fork]
        print(f"\nREPRO_FORK_RANKS={'1' if fork else '0'}")
        print(f"| phase (s from Popen) | median | min | max | n |\n|---|---|---|---|---|")
        for n in names:
            vals = [r[n] for r in sel if n in r]
            if not vals:
                print(f"| {n} | missing | | | 0 |")
                continue
            print(f"| {n} | {statistics.median(vals):.1f} | {min(vals):.1f} | {max(vals):.1f} | {len(vals)} |")
    if a.json:
        a.json.write_text(json.dumps({"extra_args": extra, "fork_ranks": a.fork_ranks, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
