"""Shared fixtures. Real-SGLang fixtures live in tests/sglang_fixtures.py (registered below)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest_plugins = ["sglang_fixtures"]  # tests/ is on sys.path (pytest's rootdir-conftest import); see that module

import state_check  # noqa: E402  (tests/state_check.py: the lockstep state check of clean real runs, issue 32)

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _sigterm_as_interrupt(signum, frame):  # pragma: no cover - exercised by killing a test run
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one teardown, however often the group is signalled
    raise KeyboardInterrupt("SIGTERM")


_SESSION_T0 = time.time()
_LEFT_WORDS = ("python", "sglang", "vllm", "py-spy", "repro", "router")  # what a test here starts (report only)


def pytest_configure(config):
    """A SIGTERM (CI's time limit, `kill -TERM -<pgid>`) tears down like Ctrl-C: the running test's ``finally`` and
    every fixture's finaliser stop the servers it started (a `repro serve` in its own session outlived a killed run)."""
    global _SESSION_T0
    _SESSION_T0 = time.time()
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)


def left_running(since: float) -> list[tuple[int, float, str]]:
    """Processes started at or after ``since`` (time.time(); start times are read to about a second) that still
    run, other than this one and its ancestors: (pid, % of a core over 0.5 s, command line). Zombies and kernel
    threads are left out; only command lines naming what a test here starts (python, sglang, vllm, py-spy, repro,
    router) are listed."""
    import psutil

    me = os.getpid()
    mine = {me} | {a.pid for a in psutil.Process(me).parents()}  # this run and what started it
    found = []
    for p in psutil.process_iter(["pid", "create_time", "cmdline", "status"]):
        try:
            info = p.info
            cmd = " ".join(info["cmdline"] or [])
            if info["pid"] in mine or info["create_time"] < since - 1.0 or info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if not cmd or not any(w in cmd for w in _LEFT_WORDS):
                continue
            p.cpu_percent(None)
            found.append((p, cmd))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    time.sleep(0.5)
    out = []
    for p, cmd in found:
        try:
            out.append((p.pid, p.cpu_percent(None), cmd[:200]))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


_STATE_SEEN: set = set()  # run folders the state check has read (each once per session)
_STATE_CHECKS: list = []  # every state_check.RunCheck of this session, for the summary


def _evidence_roots(config) -> list[Path]:
    """Where a test's runs put their evidence: the session's temp folder (tmp_path, mktemp, --evidence-dir under
    them) and ``evidence/`` under the repository and the current folder (the CLI's default)."""
    roots = [REPO / "evidence", Path.cwd() / "evidence"]
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is not None:
        try:
            roots.insert(0, Path(factory.getbasetemp()))
        except OSError:
            pass
    return list(dict.fromkeys(r.resolve() for r in roots))


def _state_check_new_runs(config) -> list:
    checks = [state_check.check_run(d) for d in state_check.run_folders(_evidence_roots(config), _SESSION_T0, _STATE_SEEN)]
    _STATE_CHECKS.extend(checks)
    return checks


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """After a real-server test (marks in ``state_check.REAL_SERVER_MARKS``) passed: every run folder that appeared
    since the last check is held to the lockstep state rules (tests/state_check.py); a clean run that breaks one
    fails this test, naming the folder, the probe and the rank. What was skipped and why goes into the test's report
    (a "lockstep state check" section, ``user_properties``) and the session's summary."""
    real = any(item.get_closest_marker(m) for m in state_check.REAL_SERVER_MARKS)
    try:
        result = yield
    except BaseException:
        if real:  # the test failed on its own: its runs are not held to the state rules (nor blamed on the next test)
            state_check.run_folders(_evidence_roots(item.config), _SESSION_T0, _STATE_SEEN)
        raise
    if not real:
        return result
    checks = _state_check_new_runs(item.config)
    if checks:
        item.add_report_section("call", "lockstep state check", "\n".join(c.line() for c in checks))
        item.user_properties += [("state_check", c.line()) for c in checks]
    bad = [p for c in checks if c.outcome == state_check.Outcome.FAILED for p in c.problems]
    if bad:
        pytest.fail("clean run(s) broke the lockstep state rules (issue 32; tests/state_check.py):\n" + "\n".join(bad),
                    pytrace=False)
    return result


def pytest_sessionfinish(session, exitstatus):
    """Runs no test's check read (made in a fixture's teardown) are checked once more at the end; a broken rule
    fails the session (exit 1) and is named in the summary."""
    if not any(i.get_closest_marker(m) for i in session.items for m in state_check.REAL_SERVER_MARKS):
        return  # no real-server test in this session: nothing to sweep
    late = _state_check_new_runs(session.config)
    if any(c.outcome == state_check.Outcome.FAILED for c in late) and session.exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Name every process started while this test session ran that is still running (with its CPU; start time is what
    ties it to the session, so on a box shared with other jobs their processes are listed too): a leaked server or a
    spinning rank slows every later stage of CI (`scripts/test.sh` runs them one after another on the same box).
    Then the lockstep state check's word on every run folder it read (clean runs held to it, skipped ones and why)."""
    if _STATE_CHECKS:
        terminalreporter.section("lockstep state check of clean runs (tests/state_check.py)")
        for c in _STATE_CHECKS:
            terminalreporter.write_line(c.line())
            for p in c.problems:
                terminalreporter.write_line(f"    {p}")
    left = left_running(_SESSION_T0)
    if left:
        terminalreporter.section("processes started while this session ran and still running (this session's, or another "
                                 "job's on a shared box)")
        for pid, cpu, cmd in left:
            terminalreporter.write_line(f"pid {pid}  {cpu:5.1f} % CPU  {cmd}")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def dumps_dir() -> Path:
    return FIXTURES / "dumps"


def _imports_torch(python: str) -> bool:
    try:
        return subprocess.run([python, "-c", "import torch.distributed"], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def torch_python() -> str:
    """An interpreter that can import torch (for small gloo programs): this one, else the CPU testbed's.

    Fails (does not skip) when neither exists: the README's setup installs the testbed.
    """
    if _imports_torch(sys.executable):
        return sys.executable
    from repro import testbed

    py = testbed.testbed_python()
    if py and _imports_torch(str(py)):
        return str(py)
    pytest.fail("no interpreter with torch: run `bash scripts/cpu_testbed/setup.sh` (README, Set up)")
