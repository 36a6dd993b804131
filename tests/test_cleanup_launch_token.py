"""`repro cleanup` signals only what repro itself launched for that run (issue 29 item 6): the mark in
processes.json is not enough, the live process must carry the launch's token in /proc/<pid>/environ.

Real processes, no sglang: the "server" is /bin/sleep started by the real launcher (repro.launcher.start_server,
which puts the token in the tree's environment) or as a multi-host node on the local host
(repro.multihost.MultiHostSession.start_node), recorded as the runner records it (repro.runner.save_server_procs,
MultiHostSession.save_processes) — or in a processes.json written by hand, as the breaker did. Every process
started here is ended by its pid / process group in a finally.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from repro import evidence as ev
from repro.cli import app
from repro.hosts import HostSpec
from repro.launcher import start_server
from repro.procs import LAUNCH_TOKEN_ENV, alive, proc_info
from repro.multihost import LAUNCH_TOKEN_FILE, cleanup_hosts
from repro.runner import save_server_procs
from repro.targets.base import LaunchSpec
from repro.targets.sglang import SGLangAdapter

SLEEP = shutil.which("sleep") or "/bin/sleep"
runner = CliRunner()


class _SleepAdapter(SGLangAdapter):
    """The SGLang adapter whose server command is `sleep 120` (the launcher's own env and session handling kept)."""

    def launch_command(self, spec: LaunchSpec) -> list[str]:
        return [SLEEP, "120"]


def _run(*args: str) -> tuple[int, str]:
    r = runner.invoke(app, list(args))
    return r.exit_code, r.output


def _end(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


@pytest.fixture
def unrelated_sleep():
    """A `sleep` this test starts itself, not through repro: no launch token in its environment."""
    env = {k: v for k, v in os.environ.items() if k != LAUNCH_TOKEN_ENV}
    p = subprocess.Popen([SLEEP, "120"], start_new_session=True, env=env)
    try:
        yield p
    finally:
        _end(p.pid)
        p.wait(10)


def _hand_written(folder: Path, pid: int, **extra) -> None:
    """processes.json as a person writes it: launched_by_repro true, the pid and its real start ticks."""
    info = proc_info(pid)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "processes.json").write_text(json.dumps({
        "launched_by_repro": True, "root": {"pid": pid, "start_ticks": info.start_ticks},
        "harness": {"pid": 999999999}, **extra,
        "processes": [{"pid": pid, "create_time": info.create_time, "name": info.name, "start_ticks": info.start_ticks}]}))


@pytest.mark.parametrize("extra", [{}, {"tokens": ["0123456789abcdef0123456789abcdef"]}], ids=["no token", "made-up token"])
def test_a_hand_written_process_list_never_signals_an_unrelated_sleep(tmp_path: Path, unrelated_sleep, extra):
    _hand_written(tmp_path / "run", unrelated_sleep.pid, **extra)
    for force in ((), ("--force",)):
        code, out = _run("cleanup", str(tmp_path / "run"), *force)
        assert code == 2 and "refused" in out and "launch token" in out and f"pid {unrelated_sleep.pid}" in out, out
    time.sleep(0.3)
    assert unrelated_sleep.poll() is None, "cleanup signalled a process the hand-written list named"


def test_a_tree_the_launcher_started_carries_the_token_and_cleanup_stops_it(tmp_path: Path):
    evd = ev.EvidenceDir(tmp_path / "evidence", "smoke_extra_allreduce", "extra")
    server = start_server(_SleepAdapter(), LaunchSpec(python=sys.executable, model="/nonexistent/model", tp_size=2),
                          evd.server_log.path)
    try:
        save_server_procs(evd, server)  # as the runner records every launched tree
        mark = json.loads(evd.processes.path.read_text())
        assert mark["launched_by_repro"] and mark["tokens"], mark
        raw = Path(f"/proc/{server.pid}/environ").read_bytes().split(b"\0")
        assert f"{LAUNCH_TOKEN_ENV}={mark['tokens'][0]}".encode() in raw
        info = proc_info(server.pid)
        code, out = _run("cleanup", str(evd.path))  # the harness (this process) is alive, but run.json is
        assert code == 2 and "still in progress" in out, out  # "running": refused unless --force
        code, out = _run("cleanup", str(evd.path), "--force")
        assert code == 0 and "stopped 1 of 1" in out, out
        deadline = time.monotonic() + 10
        while alive(info) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(info)
    finally:
        _end(server.pid)
        server.popen.wait(10)


# ---- a server spanning hosts: processes.json names host sessions, cleanup reaches them through a runner ----------

def _host(tmp_path: Path) -> dict:
    spec = HostSpec(name="h0", node_rank=0, python=sys.executable, workdir=str(tmp_path / "hostwd"))
    return {"host": {**spec.__dict__, "ssh_options": []}}


def test_hand_written_host_sessions_are_refused_and_their_workdir_kept(tmp_path: Path, unrelated_sleep):
    wd = tmp_path / "precious"
    wd.mkdir()
    (wd / "keep.txt").write_text("x")
    hosts = {"h0": {**_host(tmp_path), "root_pid": unrelated_sleep.pid, "root_start_ticks": None, "workdir": str(wd)}}
    rc, msg = cleanup_hosts(hosts, tokens=[])
    assert rc == 2 and "no launch token" in msg, msg
    rc, msg = cleanup_hosts(hosts, tokens=["0123456789abcdef0123456789abcdef"])
    assert rc == 2 and "left alone" in msg, msg
    time.sleep(0.3)
    assert unrelated_sleep.poll() is None and (wd / "keep.txt").exists()


def test_a_host_session_started_with_the_token_is_stopped_and_its_workdir_removed(tmp_path: Path):
    """A killed multi-host harness's node, started and recorded as MultiHostSession does (start_node, then
    save_processes), on the local host: `repro cleanup FOLDER` ends its session and removes its workdir."""
    from repro.multihost import MultiHostSession

    evd = ev.EvidenceDir(tmp_path / "evidence", "cleanup", "killed")

    class P:  # the members MultiHostSession's constructor and save_processes use
        evidence = evd

    s = MultiHostSession(P(), [HostSpec(name="h0", node_rank=0, python=sys.executable, workdir=str(tmp_path / "hostwd"))])
    n = s.nodes[0]
    n.root_pid = s.start_node(n, [SLEEP, "120"], {}, n.workdir + "/node.log")
    try:
        s.save_processes()
        rec = json.loads(evd.processes.path.read_text())
        assert rec["tokens"] == [s.launch_token] and Path(n.workdir, LAUNCH_TOKEN_FILE).read_text() == s.launch_token
        code, out = _run("cleanup", str(evd.path), "--force")  # --force: this process, its harness, is alive
        assert code == 0 and f"h0: stopped session {n.root_pid}" in out, out
        assert not n.runner.session_procs(n.root_pid) and not Path(n.workdir).exists()
    finally:
        _end(n.root_pid)


# ---- a PD stack: several roles, each its own session; an engine's scheduler rewrites its environ with its title ----

ROLE_TREE = r"""
import subprocess, sys, time
from pathlib import Path
# the child stands for an sglang scheduler after setproctitle: its /proc/PID/environ no longer holds the token
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env={})
Path(sys.argv[1]).write_text("ready")
time.sleep(120)
"""


class _TreeAdapter(SGLangAdapter):
    def __init__(self, script: Path, ready: Path):
        self.argv = [sys.executable, str(script), str(ready)]

    def launch_command(self, spec: LaunchSpec) -> list[str]:
        return self.argv


def test_every_role_of_a_stack_is_cleaned_up_its_schedulers_through_their_role_s_root(tmp_path: Path):
    """Each role's root carries its own token; its children (no token visible) are in that root's session. The
    stack's mark (repro.pd.Stack.launch_mark) names every role's root, so cleanup ends the whole union — before,
    only the first role's session counted and the second role's scheduler made cleanup refuse the folder."""
    from types import SimpleNamespace

    from repro.pd import Stack
    from repro.procs import save_procs

    script = tmp_path / "role.py"
    script.write_text(ROLE_TREE)
    servers = {}
    try:
        for role in ("prefill", "decode"):
            ready = tmp_path / f"{role}.ready"
            servers[role] = start_server(_TreeAdapter(script, ready), LaunchSpec(python=sys.executable,
                                         model="/nonexistent/model", tp_size=1), tmp_path / f"{role}.log")
            deadline = time.monotonic() + 20
            while not ready.exists():
                assert time.monotonic() < deadline, f"{role} tree did not start"
                time.sleep(0.05)
        procs = [p for s in servers.values() for p in s.procs()]
        assert len(procs) == 4, procs
        mark = Stack.launch_mark(SimpleNamespace(servers=servers))  # the real stack mark, of these two servers
        run = tmp_path / "run"
        run.mkdir()
        save_procs(run / "processes.json", procs, launch=mark)
        code, out = _run("cleanup", str(run))
        assert code == 0 and "stopped 4 of 4" in out, out
        deadline = time.monotonic() + 10
        while any(alive(p) for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(p) for p in procs)
    finally:
        for s in servers.values():
            _end(s.pid)
            s.popen.wait(10)
