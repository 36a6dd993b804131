"""Session start-up: a port picked as free but taken before the server bound it is retried on new ports.

Uses a small stand-in server program (not SGLang): the first launch dies with the EADDRINUSE error torch prints (or
prints uvicorn's bind error and stays alive), the second serves /health; the session must come up healthy on the second attempt, and a start-up failure of any
other kind must not be retried.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from repro import evidence as ev
from repro.runner import Prepared, Session
from repro.scenario import load_scenario
from repro.targets.base import LaunchSpec
from repro.targets.sglang import SGLangAdapter

REPO = Path(__file__).resolve().parent.parent

SERVER = textwrap.dedent('''
    import pathlib, sys
    port, counter, mode = int(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
    n = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(n))
    if n == 1 and mode == "race_alive":  # uvicorn's bind error; the process stays alive, never serving
        print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): address already in use",
              flush=True)
        import time
        while True:
            time.sleep(1)
    if n == 1:
        print("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. "
              "port: 40177, code: -98, name: EADDRINUSE" if mode == "race" else "ValueError: bad model config", flush=True)
        sys.exit(1)
    sys.path.insert(0, FAKE_SERVERS)
    from health_ok import serve
    serve(port)
''').replace("FAKE_SERVERS", repr(str(Path(__file__).resolve().parent / "fake_servers")))


class _StandIn(SGLangAdapter):
    def __init__(self, script: Path, counter: Path, mode: str):
        self.argv = [sys.executable, str(script), "{port}", str(counter), mode]

    def launch_command(self, spec: LaunchSpec) -> list[str]:
        return [a.format(port=spec.port) for a in self.argv]

    def rank_pids(self, procs):
        return {0: procs[0].pid}


def _prepared(tmp_path: Path, mode: str) -> tuple[Prepared, Path]:
    script, counter = tmp_path / "server.py", tmp_path / "attempts"
    script.write_text(SERVER)
    scen = load_scenario(REPO / "scenarios" / "sglang" / "checker_selftest.toml")
    evd = ev.EvidenceDir(tmp_path / "evidence", scen.name, "session")
    spec = LaunchSpec(python=sys.executable, model="unused", tp_size=1)
    p = Prepared(scen, scen.variants[0], evd, {"faulthandler_signal": "SIGUSR2"}, spec, _StandIn(script, counter, mode),
                 sys.executable, False, evd.path / "ARM")
    return p, counter


def test_port_race_at_start_up_is_retried_on_new_ports(tmp_path):
    p, counter = _prepared(tmp_path, "race")
    session = Session(p)
    try:
        assert session.start() is None
        assert counter.read_text() == "2" and session.rank_pids == {0: session.server.pid}
        assert p.evidence.file("server.log").read_text().count("# repro launch:") == 2  # both attempts kept
    finally:
        session.stop()


def test_a_lost_port_that_leaves_the_server_alive_is_retried_at_once(tmp_path):
    """sglang's HTTP server lost its port and stayed alive: the session sees the bind error in the log and starts
    again on new ports, instead of waiting out the scenario's start-up time-out (300 s here)."""
    p, counter = _prepared(tmp_path, "race_alive")
    seen: list = []
    session = Session(p, lambda e, d: seen.append((e, d)))
    try:
        assert session.start() is None
        assert counter.read_text() == "2"
        why = [d["why"] for e, d in seen if e == "relaunch"]
        assert len(why) == 1 and "address already in use" in why[0], why
    finally:
        session.stop()


def test_other_start_up_failures_are_not_retried(tmp_path):
    p, counter = _prepared(tmp_path, "other")
    session = Session(p)
    try:
        failed = session.start()
        assert failed is not None and failed.verdict == "INCONCLUSIVE" and "server failed to start" in failed.reason
        assert counter.read_text() == "1"
    finally:
        session.stop()


class _DrivenSession:
    """The parts of repro.runner.Session that run_one uses: healthy at once, the drive ends DEADLOCKED."""

    def __init__(self) -> None:
        self.rank_pids, self.healthy_s, self.interrupted_in_teardown, self.stopped = {0: 11, 1: 12}, 1.0, False, 0

    def start(self):
        return None

    def drive(self, variant, evd, requests, native):
        from repro.run.finish import Outcome
        from repro.verdict import Verdict

        return Outcome(Verdict("DEADLOCKED", "Ledger proof of a deadlock: rank 0 waits in all_reduce #26"))

    def stop(self) -> list:
        self.stopped += 1
        return []

    def close_drivers(self) -> None:
        pass


def _cut_finish(after_verdict: bool):
    """finish_evidence's stand-in: writes analysis.json (and verdict.json when ``after_verdict``), then a SIGTERM
    arrives (repro.cli's Interrupted: a KeyboardInterrupt carrying exit code 143)."""

    def finish(p, opts, variant, evd, outcome, rank_pids, interrupted):
        evd.analysis.write({"diverged": True})
        if after_verdict:
            evd.verdict.write(ev.verdict_record(outcome.verdict, exit_code=3, evidence=evd.path))
        e = KeyboardInterrupt()
        e.exit_code = 143
        raise e

    return finish


@pytest.mark.parametrize("after_verdict", [False, True])
def test_a_signal_while_the_evidence_is_written_leaves_an_interrupted_folder_with_the_verdict_reached(tmp_path, after_verdict):
    """Ctrl-C / SIGTERM inside finish_evidence: the folder is marked interrupted (not complete), the server stopped,
    and verdict.json says the verdict the drive reached, partial, with the signal's exit code and what is missing."""
    from repro.run.loop import run_one
    from repro.run.options import RunOptions

    p, _ = _prepared(tmp_path, "race")
    session = _DrivenSession()
    with pytest.raises(KeyboardInterrupt):
        run_one(p, RunOptions(REPO / "scenarios" / "sglang" / "checker_selftest.toml"), session=session,
                finish=_cut_finish(after_verdict))
    assert session.stopped == 1
    assert json.loads(p.evidence.path.joinpath("run.json").read_text())["status"] == "interrupted"
    v = json.loads(p.evidence.path.joinpath("verdict.json").read_text())
    assert v["verdict"] == "DEADLOCKED" and v["exit_code"] == 143 and v["partial"] is True, v
    note = v["notes"][-1]
    assert note.startswith("interrupted (Ctrl-C/SIGTERM) while the evidence was written"), v["notes"]
    assert ("REPORT.md" in note) and ("analysis.json" not in note), note


def test_a_signal_while_one_of_several_variants_is_written_marks_that_folder_interrupted(tmp_path):
    """run_variants (several variants on one server): the cut variant's folder is interrupted with its verdict,
    on_interrupt names it, and the interrupt goes on to the caller (who tears down)."""
    from repro.run.loop import VariantItem, run_variants
    from repro.run.options import RunOptions

    p, _ = _prepared(tmp_path, "race")
    session = _DrivenSession()
    session.p = p
    seen: list = []
    with pytest.raises(KeyboardInterrupt):
        run_variants(session, RunOptions(REPO / "scenarios" / "sglang" / "checker_selftest.toml"),
                     [VariantItem(p.variant.name)], lambda d: seen.append(("result", d)),
                     on_interrupt=lambda item, run_dir: seen.append(("interrupted", run_dir.path)),
                     finish=_cut_finish(False), snapshot=lambda p, run_dir: None)
    ((what, folder),) = seen
    assert what == "interrupted"
    assert json.loads((folder / "run.json").read_text())["status"] == "interrupted"
    v = json.loads((folder / "verdict.json").read_text())
    assert v["verdict"] == "DEADLOCKED" and v["exit_code"] == 143 and v["partial"] is True, v
