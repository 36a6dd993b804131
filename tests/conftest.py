"""Shared fixtures. Real-SGLang fixtures live in tests/sglang_fixtures.py (registered below)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest_plugins = ["sglang_fixtures"]  # tests/ is on sys.path (pytest's rootdir-conftest import); see that module

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _sigterm_as_interrupt(signum, frame):  # pragma: no cover - exercised by killing a test run
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one teardown, however often the group is signalled
    raise KeyboardInterrupt("SIGTERM")


def pytest_configure(config):
    """A SIGTERM (CI's time limit, `kill -TERM -<pgid>`) tears down like Ctrl-C: the running test's ``finally`` and
    every fixture's finaliser stop the servers it started (a `repro serve` in its own session outlived a killed run)."""
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)


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
