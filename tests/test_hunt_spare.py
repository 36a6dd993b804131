"""The hunt's spare trial server (repro.hunt.SparedSession, Session.launch): after a hang the hunt swaps to a server
that was launched in the background instead of restarting the hung one.

Two levels: the hunt loop with the scripted stand-in runner of tests/test_hunt.py (which server each trial ran on,
when spares are launched, that every server ends stopped, also on an interrupt), and real process trees with a
small stand-in server program (not SGLang) under repro.runner.Session and the launcher: ``launch`` returns before
health, ``start`` then waits for that same process, a swap leaves the hung tree gone and a new spare starting,
``stop`` ends both; a hunt's teardown SIGKILLs a tree that lingers after SIGTERM (``STOP_GRACE_S``). The
real-server measurement (trials/hour before and after) is benchmarks/hunt_restarts.py.
"""

from __future__ import annotations

import _thread
import json
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from repro import evidence as ev
from repro import hunt as H
from repro.hunt import loop as HL
from repro.runner import Prepared, Session
from repro.scenario import load_scenario
from repro.targets.base import LaunchSpec
from repro.targets.sglang import SGLangAdapter
from repro.verdict import DEADLOCKED, SUCCEEDED, Verdict
from test_hunt import BASE, FakeRunner, _lines

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _no_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(HL, "SETTLE_S", 0.0)


def _opts(tmp_path: Path, **kw) -> H.HuntOptions:
    kw = {"only": ("get_num_allocatable_reqs",), "perturbations": ("zero_once", "delay_once"), "spare": True, **kw}
    return H.HuntOptions(scenario_path=BASE, evidence_root=tmp_path / "ev", **kw)


def _kind(name: str) -> str:
    return "spare" if "hunt-spare" in name else "session" if "hunt-session" in name else "baseline"


# ------------------------------------------------------------------------------------- the hunt loop, stand-in runner
def test_a_hang_swaps_to_the_spare_launched_in_the_background_and_never_restarts(tmp_path: Path) -> None:
    fr = FakeRunner({"-zero_once-r0": DEADLOCKED})  # 8 trials; t001 and t005 hang
    res = H.hunt(_opts(tmp_path, spare=True), runs=fr)
    assert [r.verdict for r in res.results].count(DEADLOCKED) == 2 and len(res.results) == 8
    base_s, trial_s, spare_s = fr.sessions
    # trials t001 on the trial server, t002-t005 on the spare (swap after t001), t006-t008 back on the trial plan
    assert [_kind(x) for x in fr.driven_on[1:]] == ["session"] + ["spare"] * 4 + ["session"] * 3
    # every (re)start after the first of each plan waited for a server launched in the background: no plain restart
    assert trial_s.starts == 2 and trial_s.starts_of_launched == 1 and trial_s.launches == 1
    assert spare_s.starts == 1 and spare_s.starts_of_launched == 1 and spare_s.launches == 2
    ev_trials = [(e, _kind(n)) for e, n in fr.events if _kind(n) != "baseline"]
    # the spare is launched only once the active server is healthy; a new spare only after the swap
    assert ev_trials[:2] == [("start", "session"), ("launch", "spare")]
    assert ev_trials[2:5] == [("start", "spare"), ("stop", "session"), ("launch", "session")] or \
        ev_trials[2:5] == [("stop", "session"), ("start", "spare"), ("launch", "session")]  # teardown runs in a thread
    assert all(not s.running for s in fr.sessions)
    restarts = next(x for x in _lines(res.folder) if x["event"] == "restarts")
    assert len(restarts["swaps"]) == 2 and all(s["ok"] for s in restarts["swaps"]) and restarts["plain_restarts"] == 0
    assert [x["action"] for x in _lines(res.folder) if x["event"] == "spare"] == ["swap", "swap"]
    assert "**restarts**: 2 swap(s) to the spare server" in (res.folder / "HUNT.md").read_text()
    # each trial's evidence names the server it ran on (rank pids of that session)
    t2 = json.loads((res.results[1].evidence / "session.json").read_text())
    assert _kind(Path(t2["session"]).name) == "spare" and t2["rank_pids"] == {"0": 120, "1": 121}


def test_no_spare_is_launched_when_no_trial_would_be_left_for_it(tmp_path: Path) -> None:
    fr = FakeRunner({"-zero_once-r0": DEADLOCKED})
    res = H.hunt(_opts(tmp_path, spare=True, perturbations=("zero_once",), ranks=(0,)), runs=fr)  # 2 trials, both hang
    assert [r.verdict for r in res.results] == [DEADLOCKED, DEADLOCKED]
    _, trial_s, spare_s = fr.sessions
    assert trial_s.launches == 0 and spare_s.launches == 1  # after the swap to run t002 no trial is left for a spare
    assert all(not s.running for s in fr.sessions)


def test_no_spare_restarts_the_hung_server_as_before(tmp_path: Path) -> None:
    fr = FakeRunner({"-zero_once-r0": DEADLOCKED})
    res = H.hunt(_opts(tmp_path, spare=False), runs=fr)
    assert len(fr.sessions) == 2 and fr.sessions[1].starts == 3 and fr.sessions[1].launches == 0
    assert not any(x["event"] in ("spare", "restarts", "spare_session") for x in _lines(res.folder))


def test_an_interrupt_after_a_swap_stops_both_servers_and_keeps_the_trials(tmp_path: Path) -> None:
    fr = FakeRunner({"-zero_once-r0": DEADLOCKED}, interrupt_at="t003")
    with pytest.raises(KeyboardInterrupt):
        H.hunt(_opts(tmp_path, spare=True), runs=fr)
    assert len(fr.sessions) == 3 and all(not s.running for s in fr.sessions)  # the active one and the spare starting
    (folder,) = [p for p in (tmp_path / "ev" / "hicache_prefetch_30760").iterdir() if p.name.endswith("-hunt")]
    assert [t["verdict"] for t in _lines(folder) if t["event"] == "trial"] == [DEADLOCKED, SUCCEEDED]
    assert _lines(folder)[-1]["status"] == "interrupted"


def test_a_spare_that_does_not_come_up_is_restarted_and_the_hunt_goes_on(tmp_path: Path) -> None:
    fr = FakeRunner({"-zero_once-r0": DEADLOCKED})
    orig_session = fr.Session

    class Failing(orig_session):  # type: ignore[misc, valid-type]
        failed_once = False

        def start(self):  # the spare's first start-up fails (e.g. it died during start-up)
            super().start()
            if "hunt-spare" in self.p.evidence.path.name and not Failing.failed_once:
                Failing.failed_once = True
                return Verdict("INCONCLUSIVE", "server failed to start: exited with code 1")
            return None

    fr.Session = Failing
    res = H.hunt(_opts(tmp_path, spare=True), runs=fr)
    assert len([r for r in res.results if r.verdict != H.NOT_RUN]) == 8
    restarts = next(x for x in _lines(res.folder) if x["event"] == "restarts")
    assert restarts["swaps"][0]["ok"] is False and restarts["plain_restarts"] >= 1
    assert all(not s.running for s in fr.sessions)


# -------------------------------------------------------------------------- real process trees, stand-in server program
SERVER = textwrap.dedent('''
    import pathlib, sys, time
    port, counter, mode = int(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
    n = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(n))
    if mode == "race" and n == 1:
        print("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. "
              "port: 40177, code: -98, name: EADDRINUSE", flush=True)
        time.sleep(0.5)
        sys.exit(1)
    if mode == "slow_exit":  # like sglang's parent after a child died: 5 s before it exits on SIGTERM
        import signal
        signal.signal(signal.SIGTERM, lambda *a: (time.sleep(5.0), sys.exit(0)))
    time.sleep(3600 if mode == "never" else 1.0)  # start-up ("never": never becomes healthy)
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


def _prepared(tmp_path: Path, label: str, mode: str = "ok") -> tuple[Prepared, Path]:
    script, counter = tmp_path / "server.py", tmp_path / f"attempts-{label}"
    script.write_text(SERVER)
    scen = load_scenario(REPO / "scenarios" / "sglang" / "checker_selftest.toml")
    evd = ev.EvidenceDir(tmp_path / "evidence", scen.name, label)
    spec = LaunchSpec(python=sys.executable, model="unused", tp_size=1)
    p = Prepared(scen, scen.variants[0], evd, {"faulthandler_signal": "SIGUSR2"}, spec, _StandIn(script, counter, mode),
                 sys.executable, False, evd.path / "ARM")
    return p, counter


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_launch_returns_before_health_and_start_waits_for_that_same_process(tmp_path: Path) -> None:
    p, counter = _prepared(tmp_path, "a")
    s = Session(p)
    try:
        t0 = time.time()
        assert s.launch() is None
        assert time.time() - t0 < 0.9 and not s.server.health_ok(timeout_s=0.2)  # not waited for
        pid = s.server.pid
        assert s.start() is None
        assert s.server.pid == pid and s.rank_pids == {0: pid} and counter.read_text() == "1"
        assert p.evidence.file("server.log").read_text().count("# repro launch:") == 1
        assert s.healthy_s >= 1.0  # counted from the launch
    finally:
        s.stop()
    assert not _alive(pid)


def test_a_launched_server_that_lost_its_port_is_started_again_on_new_ports(tmp_path: Path) -> None:
    p, counter = _prepared(tmp_path, "a", mode="race")
    s = Session(p)
    try:
        assert s.launch() is None
        assert s.start() is None and counter.read_text() == "2"
    finally:
        s.stop()


def test_a_swap_makes_the_spare_active_ends_the_old_tree_and_launches_a_new_spare(tmp_path: Path) -> None:
    pa, _ = _prepared(tmp_path, "hunt-session")
    pb, _ = _prepared(tmp_path, "hunt-spare")
    a, b = Session(pa), Session(pb)
    ss = H.SparedSession(a, b, want_spare=lambda: True)
    try:
        assert ss.start() is None and ss.p is pa
        first, spare = a.server.pid, b.server.pid
        assert _alive(spare) and ss.spare_launched
        time.sleep(1.5)  # trials run meanwhile; the spare becomes healthy in the background
        t0 = time.time()
        assert ss.restart() is None
        assert time.time() - t0 < 1.0  # a healthy spare: no start-up waited for
        assert ss.p is pb and ss.rank_pids == {0: spare} and ss.server.pid == spare
        ss._join_stopper()
        assert not _alive(first)  # the "hung" tree is gone
        assert ss.spare_launched and a.server is not None and a.server.pid != first  # a new spare on the freed plan
        new_spare = a.server.pid
        assert ss.swaps[0]["ok"] and ss.swaps[0]["waited_s"] < 1.0
    finally:
        left = ss.stop()
    assert left == [] and not any(_alive(x) for x in (first, spare, new_spare))


def test_stop_while_the_spare_is_still_starting_ends_every_process(tmp_path: Path) -> None:
    pa, _ = _prepared(tmp_path, "hunt-session")
    pb, _ = _prepared(tmp_path, "hunt-spare")
    ss = H.SparedSession(Session(pa), Session(pb), want_spare=lambda: True)
    try:
        assert ss.start() is None
        pids = [ss.active.server.pid, ss.other.server.pid]
        assert ss.restart() is None  # swap to a spare that is still starting: waits for it
        pids.append(ss.other.server.pid)  # the next spare, just launched
    finally:
        ss.stop()
    assert not any(_alive(x) for x in pids)


def test_an_interrupt_while_waiting_for_the_spare_ends_the_hung_tree_and_the_spare(tmp_path: Path) -> None:
    pa, _ = _prepared(tmp_path, "hunt-session")
    pb, _ = _prepared(tmp_path, "hunt-spare", mode="never")  # the spare never becomes healthy
    ss = H.SparedSession(Session(pa), Session(pb), want_spare=lambda: True)
    pids: list[int] = []
    try:
        assert ss.start() is None
        pids = [ss.active.server.pid, ss.other.server.pid]
        threading.Timer(1.5, _thread.interrupt_main).start()  # Ctrl-C while the swap waits for the spare's health
        with pytest.raises(KeyboardInterrupt):
            ss.restart()
    finally:
        left = ss.stop()
    assert left == [] and len(pids) == 2 and not any(_alive(x) for x in pids)


def test_a_hunts_teardown_does_not_wait_for_a_server_that_lingers_after_sigterm(tmp_path: Path) -> None:
    p, _ = _prepared(tmp_path, "hunt-session", mode="slow_exit")
    s = Session(p)
    s.stop_grace_s = H.STOP_GRACE_S
    assert s.start() is None
    pid = s.server.pid
    t0 = time.time()
    assert s.stop() == []
    assert time.time() - t0 < H.STOP_GRACE_S + 2.0 and not _alive(pid)  # not the 5 s it would take to exit
    # every session a hunt makes gets that grace (baseline, trial server, spare)
    fr = FakeRunner({"-zero_once-r0": DEADLOCKED})
    H.hunt(_opts(tmp_path / "h"), runs=fr)
    assert len(fr.sessions) == 3 and all(x.stop_grace_s == H.STOP_GRACE_S for x in fr.sessions)
