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


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Name every process this test session started that is still running (with its CPU): a leaked server or a
    spinning rank slows every later stage of CI (`scripts/test.sh` runs them one after another on the same box)."""
    left = left_running(_SESSION_T0)
    if left:
        terminalreporter.section("processes started by this session and still running")
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
