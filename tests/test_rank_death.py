"""A rank that dies mid-run is named — rank, pid, why — and never described as waiting (no SGLang here).

A small stand-in server (not SGLang) starts two "rank" processes, grandchildren of the harness as sglang's
schedulers are, with the real injector loaded; its generate never answers. The test kills rank 1 with SIGKILL
during the burst: the verdict must say "rank 1 (pid …) died", not "requests errored" or a stall.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from repro import evidence as ev
from repro import resources
from repro.checker import RankWatch, death_reason
from repro.runner import Prepared, RunOptions, run_prepared
from repro.scenario import PLAN_ENV, compile_plan, load_scenario
from repro.targets.base import LaunchSpec
from repro.targets.sglang import SGLangAdapter

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
SMOKE = REPO / "scenarios" / "sglang" / "smoke_extra_allreduce.toml"

SERVER = textwrap.dedent('''
    import http.server, json, subprocess, sys, time
    RANK = "import json, time\\nwhile True:\\n    json.loads('[1]'); time.sleep(0.05)"
    ranks = [subprocess.Popen([sys.executable, "-c", RANK]) for _ in range(2)]
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def do_POST(self):
            time.sleep(60)
        def log_message(self, *a): pass
    http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
''')


class _StandIn(SGLangAdapter):
    def __init__(self, script: Path):
        self.argv = [sys.executable, str(script), "{port}"]

    def launch_command(self, spec: LaunchSpec) -> list[str]:
        return [a.format(port=spec.port) for a in self.argv]

    def rank_pids(self, procs):
        kids = sorted(p.pid for p in procs[1:])
        return {k: pid for k, pid in enumerate(kids)}


def test_death_reason_reads_the_exit_code_the_engine_logged_else_says_killed_from_outside():
    log = ("[2026-12-01 10:00:00 TP0] Scheduler hit an exception: RuntimeError: Connection closed by peer\n"
           "[2026-12-01 10:00:01] Subprocess scheduler_1 (pid=4242) crashed with exit code -9. Triggering SIGQUIT\n")
    assert death_reason(log, 1, 4242) == "exit code -9 (SIGKILL) per the server log"
    assert "Connection closed by peer" in death_reason(log, 0, 4141)
    assert "ended from outside" in death_reason("", 1, 4242)
    # gloo's size check throws in C++ and aborts the rank: no tagged error, but the abort's own untagged lines
    abort = (log.splitlines()[0] + "\nterminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
             "  what():  [enforce fail at pair.cc:464] op.preamble.length <= op.nbytes. 256 vs 224. Received data "
             "size doesn't match expected size.\n")
    why = death_reason(abort, 1, 4343)
    assert "untagged C++ abort" in why and "gloo::EnforceNotMet" in why and "256 vs 224" in why
    assert "ended from outside" not in why


def test_a_killed_grandchild_is_seen_dead_by_pid_and_start_ticks(tmp_path: Path):
    root = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import subprocess, sys, time
        kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
        print(" ".join(str(k.pid) for k in kids), flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pids = [int(x) for x in root.stdout.readline().split()]
        watch = RankWatch({0: pids[0], 1: pids[1]})
        assert watch.poll() == []
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 10
        new = []
        while not new and time.monotonic() < deadline:  # a zombie of its parent counts as dead
            new = watch.poll()
            time.sleep(0.05)
        assert [d.rank for d in new] == [1] and new[0].pid == pids[1]
        assert "rank 1 (pid" in watch.verdict_reason() and "rank(s) 0 still running" in watch.verdict_reason()
    finally:
        os.killpg(root.pid, signal.SIGKILL)
        root.wait(10)


def test_a_reason_comes_from_what_this_server_logged_not_from_the_previous_server_in_the_same_log(tmp_path: Path):
    # a hunt's session appends every restarted server to one server.log: the previous server's TP0 crash must not
    # be quoted as the reason the new server's rank 0 died
    log = tmp_path / "server.log"
    log.write_text("[2026-12-01 21:08:29 TP0] Scheduler hit an exception: ValueError: pool memory leak detected!\n")
    root = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        watch = RankWatch({0: root.pid}, log)
        with log.open("a") as f:
            f.write("[2026-12-01 21:09:08 TP0] Scheduler hit an exception: RuntimeError: gloo size mismatch\n")
        os.killpg(root.pid, signal.SIGKILL)
        root.wait(10)
        deadline = time.monotonic() + 10
        new = []
        while not new and time.monotonic() < deadline:
            new = watch.poll()
            time.sleep(0.05)
        assert new and "gloo size mismatch" in new[0].reason and "21:08:29" not in watch.verdict_reason()
    finally:
        if root.poll() is None:
            os.killpg(root.pid, signal.SIGKILL)
            root.wait(10)


def test_a_rank_killed_during_the_burst_is_named_not_blamed_on_the_requests(tmp_path: Path):
    scen_file = tmp_path / "s.toml"
    scen_file.write_text(SMOKE.read_text().replace('"sglang.srt.managers.scheduler:Scheduler.run_batch"',
                                                   '"json.decoder:JSONDecoder.decode"'))
    scen = load_scenario(scen_file)
    variant = scen.variant("control")
    evd = ev.EvidenceDir(tmp_path / "evidence", scen.name, "control")
    plan = compile_plan(scen, variant, evd.injector_dir, evd.path / "ARM")
    evd.write_json("plan.json", plan)
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    spec = LaunchSpec(python=sys.executable, model="unused", tp_size=2, env={PLAN_ENV: str(evd.file("plan.json"))},
                      pythonpath_prepend=[str(resources.injectors_dir())])
    p = Prepared(scen, variant, evd, plan, spec, _StandIn(script), sys.executable, False, evd.path / "ARM")
    killed: list[int] = []

    def observe(event: str, data: dict) -> None:
        if event == "armed" and not killed:
            pid = data["ranks"][1]
            killed.append(pid)
            threading_kill(pid)

    res = run_prepared(p, RunOptions(scenario_path=scen_file, variant="control", requests=2), observe)
    assert killed
    assert res.verdict.verdict == "INCONCLUSIVE"
    assert f"rank 1 (pid {killed[0]}) died" in res.verdict.reason, res.verdict.reason
    assert "requests errored" not in res.verdict.reason and "waits" not in res.verdict.reason
    deaths = json.loads((evd.path / "rank_deaths.json").read_text())
    assert [d["rank"] for d in deaths] == [1]
    assert f"rank 1 (pid {killed[0]}) died" in evd.file("REPORT.md").read_text()


def threading_kill(pid: int, after_s: float = 0.5) -> None:
    """SIGKILL ``pid`` from another thread ``after_s`` seconds from now (once the burst is in flight)."""
    import threading

    threading.Timer(after_s, lambda: os.kill(pid, signal.SIGKILL)).start()


def test_death_reason_names_the_exception_a_ranks_traceback_ends_with():
    """A real prefill server log (sglang 0.5.23, PD on the CPU testbed, the natural hunt's control leak on rank 0):
    rank 0's idle invariant check raised, rank 1 then lost its gloo peer. Each rank's tagged line only opens a
    traceback ("Scheduler hit an exception: Traceback (most recent call last):"); the reason names what it ended with."""
    log = (FIXTURES / "server_logs" / "pd_prefill_rank0_idle_leak_check.log").read_text()
    r0, r1 = death_reason(log, 0, 17993), death_reason(log, 1, 17996)
    assert "TP0] Scheduler hit an exception: ValueError: req_to_token_pool memory leak detected!" in r0, r0
    assert "TP1] Scheduler hit an exception: RuntimeError: [" in r1 and "Connection closed by peer" in r1, r1
    assert "Traceback" not in r0 + r1


def test_requests_that_errored_with_every_rank_alive_name_the_ranks_own_error(tmp_path: Path):
    """A real vLLM 0.32 log (CPU testbed, TP=2: rank 0's worker raised once in ``execute_model``, a ``fault`` nemesis):
    the worker caught it, reported it to the engine core and lived, so no rank died and the run ended "requests
    errored". The reason now says what rank 0 logged (its tag is ``(Worker_TP0 pid=…)``, which the old ``\\bTP0\\b``
    did not match) and nothing for rank 1, which logged no error."""
    from repro.checker import RankDeathDetector
    from repro.verdict import INCONCLUSIVE, Verdict

    log = tmp_path / "server.log"
    log.write_text("(APIServer pid=1) INFO earlier server, before the burst: (Worker_TP1 pid=2) RuntimeError: old\n")
    det = RankDeathDetector()
    det.start(type("Ctx", (), {"rank_pids": {0: os.getpid(), 1: os.getpid()}, "server_log": log})())
    with log.open("a") as f:  # what the server wrote during the burst
        f.write((FIXTURES / "server_logs" / "vllm_worker_tp0_raised.log").read_text())
    errored = Verdict(INCONCLUSIVE, "requests errored: 4 of 4 did not succeed (request 0: ok, answered with 0/8 output ids)")
    got = det.final_verdict(errored)
    assert got.verdict == INCONCLUSIVE and got.reason.startswith(errored.reason), got
    assert "rank 0's last error in the server log: (Worker_TP0 pid=13464) ERROR" in got.reason, got.reason
    assert got.reason.endswith("RuntimeError: repro: injected worker fault"), got.reason
    assert "rank 1's" not in got.reason  # its only error line was written before the burst
    other = Verdict(INCONCLUSIVE, "injector not loaded on rank(s) 1")
    assert det.final_verdict(other) == other  # only a requests-errored verdict gains it
