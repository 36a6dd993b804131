"""`repro cleanup` ends only what the harness launched (small local processes; no sglang).

A foreign server (a plain ``http.server`` this test starts, not repro's launcher) recorded the way ``repro watch``
records the server it watched must survive every form of cleanup; a tree recorded with the launcher's mark is
ended, also when found under an evidence root, and the folder gets a short verdict after a killed harness.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from repro.cli import app
from repro.procs import alive, launch_mark, proc_info, save_procs, snapshot_tree

from repro.procs import LAUNCH_TOKEN_ENV  # noqa: E402

# the launch token a tree repro.launcher started carries (repro.cleanup signals only processes that have it)
TOKEN = "test-launch-token"
TOKEN_ENV = {**os.environ, LAUNCH_TOKEN_ENV: TOKEN}

runner = CliRunner()


def _run(*args: str) -> tuple[int, str]:
    r = runner.invoke(app, list(args))
    return r.exit_code, r.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture
def foreign_server(tmp_path: Path):
    """An HTTP server someone else runs: started here, never by repro's launcher. Yields (Popen, port)."""
    port = _free_port()
    p = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while not _answers(port):
            assert time.monotonic() < deadline and p.poll() is None, "the foreign server did not start"
            time.sleep(0.05)
        yield p, port
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)


@pytest.fixture
def sleeper():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True, env=TOKEN_ENV)
    try:
        yield p
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)


def _watch_folder(root: Path, port: int, pid: int) -> Path:
    """The folder `repro watch` writes on a hang, with processes.json saved as watch.py saves it (no launch mark)."""
    hang = root / f"watch-127.0.0.1-{port}" / "20261201T000000Z-hang"
    hang.mkdir(parents=True)
    save_procs(hang / "processes.json", snapshot_tree(pid))
    (hang / "watch.json").write_text(json.dumps({"kind": "watch", "pid": 1}))
    (hang / "verdict.json").write_text(json.dumps({"verdict": "INCONCLUSIVE", "reason": "x"}))
    return hang


def test_a_foreign_server_recorded_by_watch_survives_every_cleanup_form(tmp_path: Path, foreign_server):
    server, port = foreign_server
    root = tmp_path / "evidence"
    hang = _watch_folder(root, port, server.pid)
    info = proc_info(server.pid)
    for target in (hang, hang.parent, root):
        for extra in ((), ("--force",)):
            code, out = _run("cleanup", str(target), *extra)
            assert code == 2, (target, extra, out)
            assert "not launched by repro" in out and f"pid {server.pid}" in out and "left alone" in out, out
            assert alive(info) and server.poll() is None and _answers(port), f"cleanup {target} {extra} touched the server"


def test_an_evidence_root_cleans_the_launched_run_and_leaves_the_watched_server_alone(tmp_path: Path, foreign_server, sleeper):
    server, port = foreign_server
    root = tmp_path / "evidence"
    _watch_folder(root, port, server.pid)
    run_dir = root / "smoke" / "20261201T000001Z-extra"  # evidence root / scenario / run
    run_dir.mkdir(parents=True)
    info = proc_info(sleeper.pid)
    save_procs(run_dir / "processes.json", [info], launch=launch_mark(info, tokens=[TOKEN]))
    (run_dir / "run.json").write_text(json.dumps({"status": "running", "pid": 999999999, "time": time.time()}))
    code, out = _run("cleanup", str(root))
    assert code == 0, out
    assert "stopped 1 of 1" in out and "not launched by repro" in out
    sleeper.wait(10)
    assert server.poll() is None and _answers(port)
    # the killed harness's folder now says what happened (item: a short verdict after SIGKILL + cleanup)
    v = json.loads((run_dir / "verdict.json").read_text())
    assert v["verdict"] == "INCONCLUSIVE" and "killed" in v["reason"] and "repro cleanup" in v["reason"]
    report = (run_dir / "REPORT.md").read_text()
    assert "harness killed" in report and "repro analyze" in report
    assert json.loads((run_dir / "run.json").read_text())["status"] == "cleaned-up"


def test_cleanup_refuses_a_marked_list_whose_harness_lives_and_force_ends_it(tmp_path: Path, sleeper):
    info = proc_info(sleeper.pid)
    save_procs(tmp_path / "processes.json", [info], launch=launch_mark(info, tokens=[TOKEN]))
    me = proc_info(os.getpid())
    (tmp_path / "run.json").write_text(json.dumps({"status": "running", "pid": me.pid, "harness_start_ticks": me.start_ticks}))
    code, out = _run("cleanup", str(tmp_path))
    assert code == 2 and "still in progress" in out and alive(info)
    code, out = _run("cleanup", str(tmp_path), "--force")
    assert code == 0 and "stopped 1 of 1" in out
    sleeper.wait(10)


def test_cleanup_library_reports_what_it_left_alone_and_why(tmp_path: Path, foreign_server):
    from repro.cleanup import cleanup

    server, port = foreign_server
    hang = _watch_folder(tmp_path, port, server.pid)
    (res,) = cleanup(hang, force=True)
    assert res.refused and res.exit_code == 2 and not res.stopped
    assert [p.pid for p, _ in res.left_alone] == [server.pid]
    assert "not launched by repro" in res.left_alone[0][1]


def _cleanup_after_a_killed_harness(run_dir: Path, p: subprocess.Popen) -> str:
    """Record ``p`` as the launched tree of a run whose harness died (launch-marked processes.json, run.json
    "running" with a gone harness pid), run `repro cleanup` on it, check it stopped ``p``; returns its output."""
    info = proc_info(p.pid)
    save_procs(run_dir / "processes.json", [info], launch=launch_mark(info, tokens=[TOKEN]))
    (run_dir / "run.json").write_text(json.dumps({"status": "running", "pid": 999999999, "time": time.time()}))
    rc, out = _run("cleanup", str(run_dir))
    assert rc == 0 and "stopped 1 of 1" in out, out
    p.wait(10)
    return out


def test_cleanup_removes_the_shm_files_the_killed_harness_s_tree_mapped(tmp_path: Path):
    """After the harness is SIGKILLed, `repro cleanup` ends the recorded tree and removes the /dev/shm files it had
    mapped (read before signalling), never one that existed before the tree started."""
    import uuid

    from repro.procs import SHM_DIR

    assert SHM_DIR.is_dir(), "this test needs /dev/shm (Linux)"
    tag = uuid.uuid4().hex[:8]
    old, new = SHM_DIR / f"repro-test-old-{tag}", SHM_DIR / f"repro-test-new-{tag}"
    old.write_bytes(b"\0" * 4096)
    time.sleep(0.05)
    code = ("import mmap, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600); os.ftruncate(fd, 4096)\n"
            "maps = [mmap.mmap(fd, 4096), mmap.mmap(os.open(sys.argv[2], os.O_RDWR), 4096)]\n"
            "open(sys.argv[3], 'w').close(); time.sleep(120)\n")
    ready = tmp_path / "ready"
    p = subprocess.Popen([sys.executable, "-c", code, str(new), str(old), str(ready)], start_new_session=True, env=TOKEN_ENV)
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.05)
        info = proc_info(p.pid)
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        save_procs(run_dir / "processes.json", [info], launch=launch_mark(info, tokens=[TOKEN]))
        (run_dir / "run.json").write_text(json.dumps({"status": "running", "pid": 999999999, "time": time.time()}))
        rc, out = _run("cleanup", str(run_dir))
        assert rc == 0 and "stopped 1 of 1" in out, out
        p.wait(10)
        assert not new.exists() and str(new) in out, out
        assert old.exists()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)
        for f in (old, new):
            f.unlink(missing_ok=True)


def test_cleanup_removes_the_semaphores_the_tree_registered_and_its_tracker_never_unlinked(tmp_path: Path):
    """A tree that SIGKILLs its resource tracker on SIGTERM (sglang 0.5.23's launcher) leaves its registered
    semaphore names in /dev/shm, mapped by no process; `repro cleanup` of a killed harness's run removes them from
    the injector's record of the names (``injector/mpnames-<pid>.txt``)."""
    from test_launcher_shm import SERVER

    from repro.procs import SHM_DIR

    run_dir = tmp_path / "run"
    (run_dir / "injector").mkdir(parents=True)
    plan = run_dir / "plan.json"
    plan.write_text(json.dumps({"version": 1, "scenario": "shm", "variant": "v", "out_dir": str(run_dir / "injector"),
                                "arm_file": str(tmp_path / "ARM"), "arm_poll_s": 0.5, "injections": []}))
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    env = {**TOKEN_ENV, "REPRO_PLAN": str(plan), "PYTHONPATH": str(Path(__file__).resolve().parent.parent / "injectors")}
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([sys.executable, str(script), str(port)], start_new_session=True, env=env)
    sem = SHM_DIR / f"sem.mp-reprotest{p.pid}"
    try:
        deadline = time.monotonic() + 20
        while not (sem.exists() and list((run_dir / "injector").glob("mpnames-*.txt"))):
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.05)
        out = _cleanup_after_a_killed_harness(run_dir, p)
        assert not sem.exists() and str(sem) in out, out
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)
        sem.unlink(missing_ok=True)


@pytest.mark.parametrize("tokens", [[], ["a-token-the-process-does-not-carry"]])
def test_a_forged_launch_marked_list_never_signals_an_unrelated_process(tmp_path: Path, tokens):
    # issue 29 item 6: a hand-written processes.json with launched_by_repro made cleanup kill an unrelated sleep
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        info = proc_info(other.pid)
        save_procs(tmp_path / "processes.json", [info], launch=launch_mark(info, tokens=tokens))
        code, out = _run("cleanup", str(tmp_path))
        assert code == 2 and "refused" in out and "launch token" in out and f"pid {other.pid}" in out, out
        time.sleep(0.3)
        assert other.poll() is None and alive(info), "cleanup signalled a process the forged list named"
    finally:
        os.killpg(other.pid, signal.SIGKILL)
        other.wait(10)


_CORRUPT = {"truncated": b'{"status": "running", "pid": 12', "binary": bytes(range(256)) * 2}


@pytest.mark.parametrize("how", list(_CORRUPT))
def test_an_unreadable_run_json_is_refused_naming_it_and_force_goes_on_leaving_it(tmp_path: Path, sleeper, how: str):
    """A truncated or binary run.json (whether the harness lives is written there) was a JSONDecodeError /
    UnicodeDecodeError traceback, exit 1. Now refused like a corrupt processes.json: one line naming the file, exit
    2, nothing signalled; --force ends the tree and leaves run.json as it was."""
    info = proc_info(sleeper.pid)
    save_procs(tmp_path / "processes.json", [info], launch=launch_mark(info, tokens=[TOKEN]))
    (tmp_path / "run.json").write_bytes(_CORRUPT[how])
    code, out = _run("cleanup", str(tmp_path))
    assert code == 2 and "run.json" in out and "not valid JSON" in out and "--force" in out, out
    assert "Traceback" not in out and alive(info)
    code, out = _run("cleanup", str(tmp_path), "--force")
    assert code == 0 and "stopped 1 of 1" in out, out
    sleeper.wait(10)
    assert (tmp_path / "run.json").read_bytes() == _CORRUPT[how] and not (tmp_path / "verdict.json").exists()


@pytest.mark.parametrize("how", list(_CORRUPT))
@pytest.mark.parametrize("name", ["env.json", "owned_dirs.json", "session.json"])
def test_an_unreadable_optional_file_is_read_as_absent_and_nothing_more_is_removed(tmp_path: Path, monkeypatch,
                                                                                   name: str, how: str):
    """env.json (which engine), owned_dirs.json (temp folders to remove) and a hunt trial's session.json are
    optional: truncated or binary, cleanup goes on as without them (was a traceback, exit 1) and removes no temp
    folder it would not have removed without the file."""
    import tempfile

    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", None)
    (tmp_path / "tmp").mkdir()
    keep = tmp_path / "tmp" / "repro-keep"
    keep.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    p = subprocess.Popen([sys.executable, "-c", "pass"], env=TOKEN_ENV)
    info = proc_info(p.pid)
    p.wait(10)
    save_procs(run / "processes.json", [info] if info else [], launch=launch_mark(info or proc_info(os.getpid()), tokens=[TOKEN]))
    (run / "run.json").write_text(json.dumps({"status": "finished", "pid": 1}))
    target = run
    if name == "session.json":  # a hunt trial's folder naming its session: unreadable, it names none
        target = tmp_path / "trial"
        target.mkdir()
    (target / name).write_bytes(_CORRUPT[how])
    code, out = _run("cleanup", str(target))
    assert "Traceback" not in out, out
    if name == "session.json":
        assert code == 2 and "processes.json not found" in out, out
    else:
        assert code == 0, out
    assert keep.is_dir()
