"""Real-SGLang fixtures: one shared healthy TP=2 server on the CPU testbed, and the end-of-session leak check.

Registered from tests/conftest.py (``pytest_plugins``). Tests marked ``sglang`` that do not hang the server share
``sglang_server`` (start-up costs ~40–70 s on 2 cores); tests marked ``hang`` start their own.

Leak check: at session start the pytest process becomes a *child subreaper* (Linux ``PR_SET_CHILD_SUBREAPER``), so
every process a test starts stays its descendant even when its parent dies first (an orphaned scheduler is
re-parented to pytest, not to init). At session end no descendant may be titled ``sglang::…`` or run
``sglang.launch_server``. Processes are also tagged through the environment (``REPRO_TEST_SESSION=<uuid>``) and
matched by that tag where ``/proc/PID/environ`` is readable (``setproctitle`` overwrites it in titled children,
hence the subreaper). Scoping the check to this session keeps it exact on a shared machine where other people's
servers run; in CI it is equivalent to "no such process at all".
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from repro import procs as _procs
from repro import testbed
from repro.launcher import Server, start_server
from repro.targets.base import LaunchSpec
from repro.targets.sglang import SGLangAdapter

SESSION_ENV = "REPRO_TEST_SESSION"
STARTUP_TIMEOUT_S = 300.0


def make_testbed_spec(tp_size: int = 2, extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> LaunchSpec:
    """A LaunchSpec for the CPU testbed's tiny model with the adapter's testbed profile applied.

    Fails the test (does not skip) when the testbed is not set up: the README's setup command installs it.
    """
    py = testbed.testbed_python()
    if py is None or not testbed.is_set_up():
        pytest.fail(f"CPU testbed not set up at {testbed.testbed_dir()}: run `{testbed.setup_command()}`")
    adapter = SGLangAdapter()
    base = LaunchSpec(python=str(py), model=str(testbed.tiny_model_dir()), tp_size=tp_size, args=list(extra_args),
                      env=dict(env or {}))
    args, prof_env, prepend = adapter.testbed_profile(base, list(extra_args))
    return LaunchSpec(python=base.python, model=base.model, tp_size=tp_size, args=[*extra_args, *args],
                      env={**prof_env, **base.env}, pythonpath_prepend=prepend)


def _become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux); False where unsupported."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _is_server_process(title: str) -> bool:
    return title.startswith("sglang::") or "sglang.launch_server" in title


def session_leftovers(tag: str) -> list[str]:
    """``pid title`` of live sglang server processes of this session: descendants of this process, or carrying
    ``REPRO_TEST_SESSION=tag`` in their environment."""
    found: dict[int, str] = {}
    try:
        for p in psutil.Process().children(recursive=True):
            try:
                title = " ".join(p.cmdline())
                if _is_server_process(title) and p.status() != psutil.STATUS_ZOMBIE:
                    found[p.pid] = title
            except psutil.Error:
                continue
    except psutil.Error:
        pass
    needle = f"{SESSION_ENV}={tag}".encode()
    for p in psutil.process_iter(["pid"]):
        try:
            title = " ".join(p.cmdline())
            if p.pid in found or not _is_server_process(title) or p.status() == psutil.STATUS_ZOMBIE:
                continue
            with open(f"/proc/{p.pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found[p.pid] = title
        except (psutil.Error, OSError):
            continue
    return [f"{pid} {title[:120]}" for pid, title in sorted(found.items())]


@pytest.fixture(scope="session", autouse=True)
def no_sglang_process_left() -> Iterator[str]:
    """Tag this session's processes; after the last test assert none titled ``sglang::`` (or launch_server) is left."""
    tag = os.environ.get(SESSION_ENV) or uuid.uuid4().hex
    os.environ[SESSION_ENV] = tag
    _become_subreaper()
    yield tag
    left = session_leftovers(tag)
    assert not left, f"sglang processes started by this test session are still running: {left}"


@pytest.fixture(scope="session")
def sglang_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One healthy real SGLang TP=2 server on the CPU testbed, shared by the tests marked ``sglang``.

    Do not hang it (tests that hang a server are marked ``hang`` and start their own). At teardown the whole tree
    is stopped and every process ever snapshotted from it must be gone.
    """
    log = tmp_path_factory.mktemp("sglang_server") / "server.log"
    server = start_server(SGLangAdapter(), make_testbed_spec(), log)
    snap: list[_procs.ProcInfo] = []
    try:
        server.wait_healthy(STARTUP_TIMEOUT_S)
        snap = server.procs()
        yield server
    finally:
        snap = snap + server.procs()
        left = server.stop()
        still = [p for p in snap if _procs.alive(p)]
        assert not left and not still, f"shared server processes still alive after stop: {left or still} (log {log})"


@pytest.fixture
def server_log_dir(tmp_path: Path) -> Path:
    """Per-test folder for the logs of servers a test starts itself."""
    return tmp_path
