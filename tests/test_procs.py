"""Process-tree helpers on real process trees this test spawns (no sglang)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from repro.procs import ProcInfo, alive, load_procs, proc_info, save_procs, snapshot_tree, stop_procs

# Root -> child -> grandchild. The grandchild starts its own session (so a process-group signal to the root's
# group does not reach it) and ignores SIGTERM (so only SIGKILL ends it). The child exits once the grandchild is
# up: the grandchild outlives its parent and is re-parented away from the tree.
TREE = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    out = sys.argv[1]
    if len(sys.argv) == 2:          # root
        child = subprocess.Popen([sys.executable, __file__, out, "child"])
        time.sleep(3600)
    elif sys.argv[2] == "child":
        gc = subprocess.Popen([sys.executable, __file__, out, "grandchild"], start_new_session=True)
        with open(out, "w") as f:
            f.write(f"{os.getpid()} {gc.pid}")
        time.sleep(3600)
    else:                           # grandchild
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(3600)
    """
)


def _wait_for(cond, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def tree(tmp_path: Path):
    """Spawn the 3-level tree; yield (root Popen, child pid, grandchild pid); always end it by snapshot."""
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    pids_file = tmp_path / "pids"
    root = subprocess.Popen([sys.executable, str(script), str(pids_file)], start_new_session=True)
    started: list[ProcInfo] = []
    try:
        _wait_for(lambda: pids_file.exists() and len(pids_file.read_text().split()) == 2, what="tree start")
        child, grandchild = (int(x) for x in pids_file.read_text().split())
        _wait_for(lambda: len(snapshot_tree(root.pid)) == 3, what="3 processes in the tree")
        started = snapshot_tree(root.pid)
        yield root, child, grandchild
    finally:
        stop_procs(started, grace_s=0.5)
        root.wait(timeout=10)


def test_snapshot_tree_lists_root_and_all_descendants(tree):
    root, child, grandchild = tree
    snap = snapshot_tree(root.pid)
    assert [p.pid for p in snap][0] == root.pid
    assert {p.pid for p in snap} == {root.pid, child, grandchild}
    assert all(p.create_time > 0 for p in snap)
    assert any("tree.py" in p.title for p in snap)


def test_stop_ends_grandchild_that_outlived_its_parent_and_ignores_sigterm(tree):
    root, child, grandchild = tree
    snap = snapshot_tree(root.pid)
    # The middle process exits: the grandchild is orphaned and no longer a descendant of root.
    os.kill(child, 9)
    _wait_for(lambda: child not in {p.pid for p in snapshot_tree(root.pid)}, what="child gone from tree")
    gc = next(p for p in snap if p.pid == grandchild)
    assert alive(gc)
    assert grandchild not in {p.pid for p in snapshot_tree(root.pid)}
    left = stop_procs(snap, grace_s=0.5)
    assert left == []
    assert not any(alive(p) for p in snap)
    root.wait(timeout=10)


def test_reused_pid_with_other_create_time_is_never_signalled(tmp_path: Path):
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
    try:
        real = proc_info(victim.pid)
        assert real is not None and alive(real)
        impostor = ProcInfo(pid=victim.pid, create_time=real.create_time - 1000.0, name=real.name, cmdline=real.cmdline)
        assert not alive(impostor)
        assert stop_procs([impostor], grace_s=0.2) == []
        time.sleep(0.2)
        assert victim.poll() is None, "a process with a different create time was signalled"
        assert alive(real)
    finally:
        victim.kill()
        victim.wait(timeout=10)


def test_stop_is_a_no_op_on_processes_already_gone():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    info = proc_info(p.pid)
    p.wait(timeout=10)
    assert info is None or not alive(info)
    assert stop_procs([info] if info else [], grace_s=0.1) == []


def test_save_and_load_round_trip(tmp_path: Path):
    procs = [ProcInfo(pid=123, create_time=1700000000.25, name="python", cmdline=["sglang::scheduler_TP0"])]
    path = tmp_path / "sub" / "processes.json"
    save_procs(path, procs)
    loaded = load_procs(path)
    assert loaded == procs
    assert loaded[0].cmdline == ["sglang::scheduler_TP0"]
    assert loaded[0].title == "sglang::scheduler_TP0"


def test_load_procs_bad_file_names_file_and_expected_shape(tmp_path: Path):
    bad = tmp_path / "processes.json"
    bad.write_text(json.dumps({"pid": 1}))
    with pytest.raises(ValueError) as e:
        load_procs(bad)
    msg = str(e.value)
    assert str(bad) in msg and "pid, create_time" in msg


def test_stop_reaps_ended_children_so_no_zombie_is_left():
    import psutil

    kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    info = proc_info(kid.pid)
    os.kill(kid.pid, 9)
    _wait_for(lambda: psutil.Process(kid.pid).status() == psutil.STATUS_ZOMBIE, what="zombie")
    assert not alive(info)
    assert stop_procs([info], grace_s=0.1) == []
    # Reaped by stop_procs itself: the pid no longer exists (no zombie waiting for its parent).
    assert not psutil.pid_exists(kid.pid)


def test_identity_survives_a_wall_clock_step_and_the_tree_is_still_stopped(tree, monkeypatch):
    import psutil

    from repro.procs import start_ticks

    root, child, grandchild = tree
    snap = snapshot_tree(root.pid)
    assert all(p.start_ticks is not None for p in snap)
    real_ct = psutil.Process.create_time
    monkeypatch.setattr(psutil.Process, "create_time", lambda self: real_ct(self) + 33.0)  # the clock stepped 33 s
    assert all(alive(p) for p in snap)
    assert stop_procs(snap, grace_s=0.5) == []
    assert not any(start_ticks(p.pid) == p.start_ticks for p in snap)
    root.wait(timeout=10)


def test_reused_pid_with_other_start_ticks_is_never_signalled():
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
    try:
        real = proc_info(victim.pid)
        impostor = ProcInfo(pid=real.pid, create_time=real.create_time, name=real.name, start_ticks=real.start_ticks - 5)
        assert not alive(impostor)
        assert stop_procs([impostor], grace_s=0.2) == []
        time.sleep(0.2)
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait(timeout=10)


def test_old_snapshot_without_start_ticks_is_read_and_checked_by_create_time(tmp_path: Path):
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
    try:
        real = proc_info(victim.pid)
        old = tmp_path / "processes.json"  # the format written before start ticks were recorded
        old.write_text(json.dumps([{"pid": real.pid, "create_time": real.create_time, "name": real.name, "cmdline": []}]))
        (p,) = load_procs(old)
        assert p.start_ticks is None and alive(p)
    finally:
        victim.kill()
        victim.wait(timeout=10)


def test_stop_with_no_grace_sends_no_sigterm_and_kills_the_tree_at_once(tree, monkeypatch):
    """grace_s=0 (a wedged tree, repro.runner.WEDGED_STOP_GRACE_S): SIGKILL at once, no SIGTERM first — a rank blocked
    in a collective never runs its SIGTERM handler, so sending one only gives a healthy child time to react."""
    import signal

    from repro import procs as _procs

    root, child, grandchild = tree
    snap = snapshot_tree(root.pid)
    sent: list[int] = []
    real = _procs._signal
    monkeypatch.setattr(_procs, "_signal", lambda p, sig: (sent.append(sig), real(p, sig))[1])
    assert stop_procs(snap, grace_s=0) == []
    assert not any(alive(p) for p in snap)
    assert signal.SIGTERM not in sent and signal.SIGKILL in sent, sent
    root.wait(timeout=10)
