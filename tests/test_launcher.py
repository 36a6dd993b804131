"""Launcher: ports, start-up failures, health wait and whole-tree stop, on real processes (fast; no sglang server).

Engine-independent behaviour is exercised with small stand-in server programs (an ``http.server`` that answers
``/health``, a sleeper, a process tree); the start-up failure test uses the real SGLang adapter's command line.
"""

from __future__ import annotations

import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest

from repro.launcher import LaunchError, pick_free_port, port_free, start_server
from repro.procs import alive
from repro.targets.base import LaunchSpec
from repro.targets.sglang import SGLangAdapter


class _CommandAdapter(SGLangAdapter):
    """The SGLang adapter with the command replaced by a small program (``{port}`` is filled in)."""

    def __init__(self, argv: list[str]):
        self.argv = argv

    def launch_command(self, spec: LaunchSpec) -> list[str]:
        return [a.format(port=spec.port, nccl_port=spec.nccl_port) for a in self.argv]


def _spec(**kw) -> LaunchSpec:
    d = dict(python=sys.executable, model="/nonexistent/model", tp_size=2)
    d.update(kw)
    return LaunchSpec(**d)


def _one_line(e: BaseException) -> str:
    s = str(e)
    assert "\n" not in s, f"error is not one line: {s!r}"
    return s


def test_pick_free_port_returns_a_bindable_port():
    p = pick_free_port()
    assert 1024 <= p <= 65535
    assert port_free("127.0.0.1", p)
    q = pick_free_port(exclude=(p,))
    assert q != p


@pytest.mark.parametrize("field, flag", [("port", "--port"), ("nccl_port", "--nccl-port")])
def test_port_in_use_is_one_clear_line_naming_the_flag(tmp_path: Path, field: str, flag: str):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        with pytest.raises(LaunchError) as e:
            start_server(SGLangAdapter(), _spec(**{field: busy}), tmp_path / "server.log")
    msg = _one_line(e.value)
    assert str(busy) in msg and "already in use" in msg and flag in msg


def test_missing_interpreter_names_python_flag_and_setup(tmp_path: Path):
    with pytest.raises(LaunchError) as e:
        start_server(SGLangAdapter(), _spec(python=str(tmp_path / "no-python")), tmp_path / "server.log")
    msg = _one_line(e.value)
    assert "--python" in msg and "setup.sh" in msg


def test_server_dying_at_startup_is_one_line_with_cause_and_log(tmp_path: Path):
    # Real adapter command; it dies at once: this interpreter lacks sglang, or (if it has it) the flag is unknown.
    log = tmp_path / "server.log"
    with start_server(SGLangAdapter(), _spec(args=["--no-such-flag-for-repro-test"]), log) as server:
        with pytest.raises(LaunchError) as e:
            server.wait_healthy(60)
        assert not server.is_running()
    msg = _one_line(e.value)
    assert "exited with code" in msg and str(log) in msg
    assert ("sglang" in msg) or ("no-such-flag" in msg)
    assert "sglang.launch_server" in log.read_text()  # the launch line is recorded first
    assert e.value.log_tail


def test_healthy_server_gets_free_ports_and_answers(tmp_path: Path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "health").write_text("ok")
    adapter = _CommandAdapter([sys.executable, "-m", "http.server", "{port}", "--bind", "127.0.0.1", "--directory", str(site)])
    with start_server(adapter, _spec(), tmp_path / "server.log") as server:
        assert server.spec.port != 0 and server.spec.nccl_port != 0 and server.spec.port != server.spec.nccl_port
        assert server.url == f"http://127.0.0.1:{server.spec.port}"
        waited = server.wait_healthy(30)
        assert waited >= 0 and server.health_ok()
        snap = server.procs()
        assert [p.pid for p in snap] == [server.pid]
    assert not any(alive(p) for p in snap)


def test_health_deadline_is_one_line_with_url_and_log(tmp_path: Path):
    adapter = _CommandAdapter([sys.executable, "-c", "import time; print('loading weights', flush=True); time.sleep(3600)"])
    with start_server(adapter, _spec(), tmp_path / "server.log") as server:
        with pytest.raises(LaunchError) as e:
            server.wait_healthy(1.0, poll_s=0.1)
        assert server.is_running()
    msg = _one_line(e.value)
    assert "not healthy after" in msg and "/health" in msg and "loading weights" in msg
    assert not server.is_running()


# root -> child -> grandchild (own session). argv[1] == "ignore": the grandchild ignores SIGTERM (needs SIGKILL).
TREE = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    mode = sys.argv[1]
    role = sys.argv[2] if len(sys.argv) > 2 else "root"
    if role == "root":
        subprocess.Popen([sys.executable, __file__, mode, "child"])
    elif role == "child":
        subprocess.Popen([sys.executable, __file__, mode, "grandchild"], start_new_session=True)
    elif mode == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(3600)
    """
)


def _wait_tree(server, n: int) -> list:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        snap = server.procs()
        if len(snap) == n:
            return snap
        time.sleep(0.05)
    raise AssertionError(f"expected {n} processes, saw {server.procs()}")


def test_stop_ends_whole_tree_including_sigterm_ignoring_grandchild_and_is_idempotent(tmp_path: Path):
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    server = start_server(_CommandAdapter([sys.executable, str(script), "ignore"]), _spec(), tmp_path / "server.log")
    try:
        snap = _wait_tree(server, 3)
    finally:
        left = server.stop(grace_s=0.5)
    assert left == []
    assert not any(alive(p) for p in snap)
    assert server.stop() == []
    assert server.popen.poll() is not None


def test_context_manager_stops_tree_on_keyboard_interrupt(tmp_path: Path):
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    snap = []
    with pytest.raises(KeyboardInterrupt):
        with start_server(_CommandAdapter([sys.executable, str(script), "obey"]), _spec(), tmp_path / "server.log") as server:
            snap = _wait_tree(server, 3)
            raise KeyboardInterrupt
    assert len(snap) == 3 and not any(alive(p) for p in snap)


def test_stop_ends_children_seen_earlier_even_after_the_root_died(tmp_path: Path):
    import os
    import signal

    script = tmp_path / "tree.py"
    script.write_text(TREE)
    server = start_server(_CommandAdapter([sys.executable, str(script), "obey"]), _spec(), tmp_path / "server.log")
    try:
        snap = _wait_tree(server, 3)
        os.kill(server.pid, signal.SIGKILL)
        server.popen.wait(timeout=10)
        orphans = [p for p in snap if p.pid != server.pid]
        assert all(alive(p) for p in orphans)
    finally:
        left = server.stop(grace_s=2.0)
    assert left == [] and not any(alive(p) for p in snap)


FORK_THEN_DIE = textwrap.dedent("""
    import os, sys, time
    if os.fork() == 0:          # a child in the server's session, like a scheduler process
        with open(sys.argv[1], "w") as f:
            f.write(str(os.getpid()))
        while True:
            time.sleep(1)
    time.sleep(0.3)
    os._exit(3)                 # the root dies before the harness ever snapshots its tree
""")


def test_stop_ends_a_child_no_snapshot_saw_when_the_root_died_first(tmp_path: Path):
    """Seen in a loaded fast suite: a PD stand-in server's root died at 0.5 s, before the stack's first snapshot
    had seen its forked child; stop() ended nothing and the child lived on (re-parented to init) for an hour."""
    import psutil

    script, pidfile = tmp_path / "fork_then_die.py", tmp_path / "child.pid"
    script.write_text(FORK_THEN_DIE)
    server = start_server(_CommandAdapter([sys.executable, str(script), str(pidfile)]), _spec(), tmp_path / "server.log")
    server._known.clear()  # as if no snapshot had run yet (the root is recorded at start; its child is not)
    child = None
    try:
        server.popen.wait(timeout=30)
        deadline = time.time() + 30
        while time.time() < deadline and not (pidfile.exists() and pidfile.read_text()):
            time.sleep(0.05)
        child = psutil.Process(int(pidfile.read_text()))
        assert child.ppid() != server.pid and server.procs() == []  # outside the tree: snapshots cannot find it
    finally:
        left = server.stop(grace_s=2.0)
    assert left == []
    child.wait(timeout=10)  # raises psutil.TimeoutExpired if stop() left it running
    assert not child.is_running()


def _step_wall_clock(monkeypatch, step_s: float = 33.0) -> None:
    """Simulate a wall-clock step of ``step_s`` seconds as psutil sees it: its boot time (from /proc/stat's btime,
    which the kernel derives from the wall clock) moves, and with it every process's ``create_time()``."""
    import psutil

    real_ct, real_bt = psutil.Process.create_time, psutil.boot_time
    monkeypatch.setattr(psutil.Process, "create_time", lambda self: real_ct(self) + step_s)
    monkeypatch.setattr(psutil, "boot_time", lambda: real_bt() + step_s)


def test_a_wall_clock_step_neither_loses_nor_leaks_the_server_tree(tmp_path: Path, monkeypatch):
    import os

    from repro.procs import start_ticks

    script = tmp_path / "tree.py"
    script.write_text(TREE)
    server = start_server(_CommandAdapter([sys.executable, str(script), "ignore"]), _spec(), tmp_path / "server.log")
    try:
        snap = _wait_tree(server, 3)
        _step_wall_clock(monkeypatch)
        # Same processes, read after the step: still found (the run's rank lookup goes through procs()) ...
        assert {p.pid for p in server.procs()} == {p.pid for p in snap}
        assert all(alive(p) for p in snap)
    finally:
        left = server.stop(grace_s=0.5)
    # ... and all stopped: nothing of the tree is left running.
    assert left == []
    assert not any(start_ticks(p.pid) == p.start_ticks for p in snap), "a process of the tree is still running"
    assert server.popen.poll() is not None
    assert os.path.exists(tmp_path / "server.log")


def test_stop_never_skips_a_root_that_is_still_our_child(tmp_path: Path, monkeypatch):
    from repro import procs as procs_mod

    server = start_server(_CommandAdapter([sys.executable, "-c", "import time; time.sleep(3600)"]), _spec(),
                          tmp_path / "server.log")
    try:
        _wait_tree(server, 1)
        # Whatever goes wrong with identity checks (here: every check says "another process"), the root is our
        # unreaped child, so its pid is still ours.
        monkeypatch.setattr(procs_mod, "alive", lambda p: False)
        server.stop(grace_s=0.2)
        assert server.popen.poll() is not None, "the root was left running"
    finally:
        monkeypatch.undo()
        server.popen.kill()
        server.popen.wait(timeout=10)


# root -> child; the child creates a shared-memory file and maps it, maps one that existed before the launch, and
# ignores SIGTERM (a rank that must be SIGKILLed never unlinks what it made, like SGLang's sgl_shm_mq_* queues).
SHM_TREE = textwrap.dedent("""
    import mmap, os, signal, subprocess, sys, time
    role, new, old, ready = sys.argv[1:5]
    if role == "root":
        subprocess.Popen([sys.executable, __file__, "child", new, old, ready])
        time.sleep(3600)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fd = os.open(new, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    maps = [mmap.mmap(fd, 4096), mmap.mmap(os.open(old, os.O_RDWR), 4096)]
    open(ready, "w").close()
    time.sleep(3600)
""")


def test_stop_removes_the_shm_files_its_sigkilled_tree_made_and_keeps_older_and_foreign_ones(tmp_path: Path):
    import uuid

    from repro.procs import SHM_DIR

    assert SHM_DIR.is_dir(), "this test needs /dev/shm (Linux)"
    tag = uuid.uuid4().hex[:8]
    old, new, foreign = (SHM_DIR / f"repro-test-{k}-{tag}" for k in ("old", "new", "foreign"))
    old.write_bytes(b"\0" * 4096)  # exists before the launch: someone else's, although the tree maps it
    script, ready = tmp_path / "shm_tree.py", tmp_path / "ready"
    script.write_text(SHM_TREE)
    time.sleep(0.05)  # the launch is strictly later than old's creation
    server = start_server(_CommandAdapter([sys.executable, str(script), "root", str(new), str(old), str(ready)]),
                          _spec(), tmp_path / "server.log")
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < deadline and server.popen.poll() is None, "the stand-in tree did not start"
            time.sleep(0.05)
        _wait_tree(server, 2)
        foreign.write_bytes(b"x")  # made after the launch by a process outside the tree
        left = server.stop(grace_s=0.5)
        assert left == []
        assert not new.exists(), "the tree's own segment was left in /dev/shm"
        assert old.exists() and foreign.exists()
    finally:
        server.stop(grace_s=0.5)
        for f in (old, new, foreign):
            f.unlink(missing_ok=True)


def test_fork_ranks_opt_in_is_checked_before_a_launch():
    """REPRO_FORK_RANKS (the injector's fork-ranks opt-in): 0/1/unset only, and 1 only for a CPU server."""
    from repro.launcher import check_fork_ranks

    cpu = ["--device", "cpu"]
    for env in ({}, {"REPRO_FORK_RANKS": "0"}, {"REPRO_FORK_RANKS": "1"}):
        check_fork_ranks(env, cpu)
    check_fork_ranks({"REPRO_FORK_RANKS": "0"}, ["--device", "cuda"])
    with pytest.raises(LaunchError, match=r"REPRO_FORK_RANKS=1 is for CPU servers only .*'cuda'.*unset REPRO_FORK_RANKS"):
        check_fork_ranks({"REPRO_FORK_RANKS": "1"}, ["--device", "cuda"])
    with pytest.raises(LaunchError, match=r"REPRO_FORK_RANKS=1 is for CPU servers only .*None"):
        check_fork_ranks({"REPRO_FORK_RANKS": "1"}, [])
    with pytest.raises(LaunchError, match=r"REPRO_FORK_RANKS='yes': expected 1 .* or 0 / unset"):
        check_fork_ranks({"REPRO_FORK_RANKS": "yes"}, cpu)


def test_a_start_that_lost_a_port_is_stopped_and_started_again_and_another_failure_is_raised_at_once(tmp_path) -> None:
    """``start_retrying_port_races``: the session's and the PD stack's one loop (repro/run/session.py, repro/pd.py)."""
    from repro.launcher import PORT_RACE_ATTEMPTS, port_lost_error, start_retrying_port_races

    line = "ERROR: [Errno 98] error while attempting to bind on address ('127.0.0.1', 30001): address already in use"
    started, stopped, seen = [], [], []

    def start(attempt: int) -> int:
        started.append(attempt)
        return attempt

    def racing(it: int) -> float:  # the first two starts lose a port, the third is healthy
        if it < 3:
            raise port_lost_error("server", line, tmp_path / "log", "")
        return 1.5

    got = start_retrying_port_races(start, racing, stopped.append, observe=lambda ev, d: seen.append((ev, d["attempt"])))
    assert got == (3, 1.5) and started == [1, 2, 3] and stopped == [1, 2]
    assert seen == [("relaunch", 2), ("relaunch", 3)]

    def always(it: int) -> float:
        raise port_lost_error("server", line, tmp_path / "log", "")

    started.clear(), stopped.clear()
    with pytest.raises(LaunchError, match="lost a port"):
        start_retrying_port_races(start, always, stopped.append)
    assert len(started) == PORT_RACE_ATTEMPTS and len(stopped) == PORT_RACE_ATTEMPTS - 1  # the last one: the caller's

    def other(it: int) -> float:
        raise LaunchError("server exited with code 1 during start-up")

    started.clear(), stopped.clear()
    with pytest.raises(LaunchError, match="exited"):
        start_retrying_port_races(start, other, stopped.append)
    assert started == [1] and stopped == []
