"""Capture of real multi-process gloo jobs that hang on purpose (tests/gloo_programs/desync.py).

Every job runs under the ``torch_python`` fixture and is ended by process group in a ``finally`` (GlooJob's
context manager), on success, failure and Ctrl-C.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gloo_programs.job import GlooJob
from repro.analysis import analyze, analyze_paths
from repro.analysis import frames_unchanged
from repro.capture import capture_notice, capture_pids, capture_ranks, find_py_spy, py_spy_version


@pytest.fixture(scope="module")
def desync3(torch_python, tmp_path_factory):
    """3 ranks on one gloo group; rank 0 makes one extra all_reduce; faulthandler registered on SIGUSR2."""
    out = tmp_path_factory.mktemp("desync3")
    job = GlooJob(torch_python, 3, out, mode="extra-allreduce", extra_rank=0, fault_signal="SIGUSR2")
    with job:
        job.wait_ready()
        yield job


def test_three_rank_job_with_one_extra_all_reduce_is_diverged_with_rank0_odd(desync3, tmp_path):
    caps = capture_ranks(desync3.pids, tmp_path / "stacks", timeout_s=10)
    assert [c.rank for c in caps] == [0, 1, 2]
    for c in caps:
        assert c.ok and c.method == "py-spy" and c.error == "", c.error
        assert c.tool_version.startswith("py-spy ")
        assert (tmp_path / "stacks" / f"rank{c.rank}.txt").read_text().startswith(f"Process {c.pid}:")
        json.loads((tmp_path / "stacks" / f"rank{c.rank}.json").read_text())
        assert c.cpu_percent is not None and c.cpu_percent < 10.0  # blocked in gloo: ~0 % of a core
    a = analyze(caps)
    assert a.diverged and a.odd_ranks == [0] and a.reason == "different collective"
    assert (a.ranks[0].op, a.ranks[0].caller_chain[0]) == ("all_reduce", "check_prefetch_progress")
    assert [(r.op, r.caller_chain[0]) for r in a.ranks[1:]] == [("broadcast", "recv_requests")] * 2
    meta = json.loads((tmp_path / "stacks" / "capture.json").read_text())
    assert meta["py_spy"] == py_spy_version() and len(meta["processes"]) == 3

    # a second capture shows the same frames; the files on disk (py-spy JSON and text) analyse the same way
    again = capture_ranks(desync3.pids, tmp_path / "stacks", timeout_s=10, tag="-2")
    assert frames_unchanged(caps, again)
    from_json = analyze_paths([tmp_path / "stacks" / f"rank{k}-2.json" for k in range(3)])
    from_dir = analyze_paths([tmp_path], tag="")
    for b in (from_json, from_dir):
        assert b.diverged and b.odd_ranks == [0]
        assert [r.location_key for r in b.ranks] == [r.location_key for r in a.ranks]


def test_without_py_spy_the_injector_faulthandler_dump_is_used(desync3, tmp_path):
    caps = capture_ranks(desync3.pids, tmp_path / "stacks", timeout_s=10, py_spy=None,
                         injector_dir=desync3.out_dir, fallback_signal="SIGUSR2")
    for c in caps:
        assert c.ok and c.method == "faulthandler", c.error
        assert "py-spy not found" in c.notice and "faulthandler" in c.notice
    assert "pip install py-spy" in capture_notice(caps)
    a = analyze(caps)
    assert a.diverged and a.odd_ranks == [0]
    assert a.ranks[0].caller_chain[0] == "check_prefetch_progress"
    # the saved text carries the process header and analyses the same from disk
    text = (tmp_path / "stacks" / "rank0.txt").read_text()
    assert text.startswith(f"Process {desync3.pids[0]}:") and "most recent call first" in text
    assert analyze_paths([tmp_path / "stacks"]).odd_ranks == [0]
    # the processes survived the signal
    assert all(p.poll() is None for p in desync3.procs.values())


def test_ptrace_refused_names_the_fix_and_falls_back(desync3, tmp_path):
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.fail("this test drops privileges with setpriv to get a real ptrace refusal: run as root")
    exe = find_py_spy()
    assert exe, "py-spy is a project dependency"
    d = tempfile.mkdtemp(prefix="pyspy-nobody-")
    try:
        os.chmod(d, 0o755)
        local = Path(d) / "py-spy"
        shutil.copy(exe[0], local)
        os.chmod(local, stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(local)]
        refused = capture_ranks({0: desync3.pids[0]}, tmp_path / "a", timeout_s=10, py_spy=as_nobody)
        assert not refused[0].ok and "ptrace" in refused[0].error and "CAP_SYS_PTRACE" in refused[0].error
        assert "injector_dir not given" in refused[0].error
        fell = capture_ranks({0: desync3.pids[0]}, tmp_path / "b", timeout_s=10, py_spy=as_nobody,
                             injector_dir=desync3.out_dir)
        assert fell[0].ok and fell[0].method == "faulthandler"
        assert "ptrace" in fell[0].notice and "CAP_SYS_PTRACE" in fell[0].notice
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_native_capture_shows_the_gloo_wait(desync3, tmp_path):
    caps = capture_ranks({0: desync3.pids[0]}, tmp_path, timeout_s=20, native=True)
    c = caps[0]
    assert c.ok, c.error
    if c.native:  # py-spy may fail to unwind natively; then it retried without --native, which must be said
        r = analyze(caps).ranks[0]
        assert r.state == "collective" and r.op == "all_reduce" and "native-wait" in r.layers
        assert any(f.native for f in c.threads[0].frames)
    else:
        assert any("--native" in w for w in c.warnings) or "--native" in c.error


def test_gone_and_non_python_processes_are_reported_not_raised(tmp_path):
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        caps = capture_pids({"sleep": sleeper.pid, "dead": dead.pid}, tmp_path, timeout_s=10)
        by = {c.label: c for c in caps}
        assert not by["sleep"].ok and "Python" in by["sleep"].error
        assert not by["dead"].ok and by["dead"].error
        assert analyze([c.model_copy(update={"rank": i}) for i, c in enumerate(caps)]).unknown_ranks == [0, 1]
    finally:
        os.killpg(sleeper.pid, signal.SIGKILL)
        sleeper.wait()


def test_fallback_never_sends_an_uncaught_signal(tmp_path):
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        (tmp_path / f"faulthandler-{sleeper.pid}.txt").write_text("")
        caps = capture_ranks({0: sleeper.pid}, tmp_path / "s", py_spy=None, injector_dir=tmp_path)
        assert not caps[0].ok and "has no handler for SIGUSR2" in caps[0].error
        assert sleeper.poll() is None  # still alive: the signal was not sent
        caps = capture_ranks({0: sleeper.pid}, tmp_path / "s", py_spy=None, injector_dir=tmp_path / "nowhere")
        assert "signal not sent" in caps[0].error
    finally:
        os.killpg(sleeper.pid, signal.SIGKILL)
        sleeper.wait()


def test_collective_held_by_a_forward_thread(torch_python, tmp_path):
    with GlooJob(torch_python, 2, tmp_path / "job", mode="thread-allreduce", extra_rank=0) as job:
        job.wait_ready()
        caps = capture_ranks(job.pids, tmp_path / "stacks", timeout_s=10)
    a = analyze(caps)
    r0 = a.ranks[0]
    assert (r0.state, r0.op, r0.thread, r0.main_thread) == ("collective", "all_reduce", "forward-thread", False)
    assert a.diverged and a.even_split


def test_busy_rank_is_busy_and_on_cpu(torch_python, tmp_path):
    with GlooJob(torch_python, 2, tmp_path / "job", mode="busy", extra_rank=1) as job:
        job.wait_ready()
        caps = capture_ranks(job.pids, tmp_path / "stacks", timeout_s=10, cpu_window_s=0.5)
    a = analyze(caps)
    assert a.ranks[1].state == "busy" and a.ranks[1].blocked_frame.startswith("busy_forward")
    assert a.busy_ranks == [1] and not a.diverged
    # on CPU vs blocked (no threshold: other servers on this 2-core machine decide how much CPU the spinner gets)
    assert caps[1].cpu_percent > caps[0].cpu_percent


def test_idle_job_ranks_agree_or_wait(torch_python, tmp_path):
    with GlooJob(torch_python, 3, tmp_path / "job", mode="idle") as job:
        job.wait_ready()
        caps = capture_ranks(job.pids, tmp_path / "stacks", timeout_s=10)
    a = analyze(caps)
    # rank 0 waits for work in queue.get (idle), ranks 1,2 wait for its broadcast
    assert a.ranks[0].state == "idle-wait" and a.ranks[0].wait == "queue get"
    assert [(r.state, r.op) for r in a.ranks[1:]] == [("collective", "broadcast")] * 2
    assert a.odd_ranks == [0]


@pytest.mark.sglang
def test_idle_sglang_ranks_are_captured_and_not_diverged(sglang_server, tmp_path):
    """Real SGLang TP=2 on CPU, healthy and idle: every rank captured by py-spy, the ranks agree."""
    pids = sglang_server.rank_pids()
    assert sorted(pids) == [0, 1]
    caps = capture_ranks(pids, tmp_path, timeout_s=10)
    for c in caps:
        assert c.ok and c.method == "py-spy", c.error
        assert c.title.startswith(f"sglang::scheduler_TP{c.rank}")
        assert any(t.name == "MainThread" for t in c.threads)
    a = analyze(caps)
    assert not a.diverged, a.summary
    # and the files analyse the same way, rank read from the process title
    assert not analyze_paths([tmp_path / "rank0.json", tmp_path / "rank1.txt"]).diverged
    others = {f"{p.name}-{p.pid}": p.pid for p in sglang_server.procs()
              if p.pid not in pids.values() and "scheduler" not in p.title}
    if others:
        more = capture_pids(others, tmp_path / "others", timeout_s=10)
        assert any(c.ok for c in more), [c.error for c in more]


HOLDER = Path(__file__).resolve().parent / "helpers" / "ptrace_holder.py"


def _held(hold_s: float):
    """(holder process, the pid it holds under ptrace); the caller ends the holder's process group."""
    p = subprocess.Popen([sys.executable, str(HOLDER), str(hold_s)], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    line = p.stdout.readline().strip()
    if not line.startswith("held "):
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        pytest.fail(f"ptrace_holder.py could not hold its child: {line!r}")
    return p, int(line.split()[1])


def _end_holder(p: subprocess.Popen, child: int) -> None:
    try:  # the child outlives an exited holder (reparented), so end it by pid as well
        os.kill(child, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def test_a_rank_held_for_a_moment_by_another_tracer_is_dumped_once_it_detaches(tmp_path):
    holder, child = _held(1.5)
    try:
        caps = capture_pids({"rank0": child}, tmp_path, timeout_s=8)
        c = caps[0]
        assert c.ok and c.method == "py-spy" and c.threads, c.error
        assert any("another tracer to detach" in w for w in c.warnings), c.warnings
        assert (tmp_path / "rank0.txt").is_file() and (tmp_path / "rank0.json").is_file()
        meta = json.loads((tmp_path / "capture.json").read_text())["processes"][0]
        assert meta["ok"] and any("tried again" in w for w in meta["warnings"])
    finally:
        _end_holder(holder, child)


def test_a_rank_held_by_another_tracer_past_the_timeout_names_the_tracer_not_a_permission_fix(tmp_path):
    holder, child = _held(60)
    try:
        c = capture_pids({"rank0": child}, tmp_path, timeout_s=1.5)[0]
        assert not c.ok
        assert f"is held by tracer pid {holder.pid}" in c.error and "ptrace_holder.py" in c.error, c.error
        assert "CAP_SYS_PTRACE" not in c.error, c.error
        assert holder.poll() is None  # the capture left the holder (and its tracee) as they were
    finally:
        _end_holder(holder, child)


def test_a_py_spy_run_that_fails_once_is_tried_again_and_the_retry_is_a_warning(tmp_path):
    """py-spy failing for a moment (a thread exiting mid-dump) is stood in for by a wrapper that fails its first run
    with a py-spy-shaped error, then runs the real py-spy."""
    real = find_py_spy("py-spy")
    assert real, "py-spy is a project dependency"
    flag = tmp_path / "failed-once"
    wrapper = tmp_path / "flaky-py-spy"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = dump ] && [ ! -e {flag} ]; then : > {flag}; '
        'echo "Error: Failed to get stack traces" >&2; echo "Caused by:" >&2; '
        'echo "    0: Failed to copy PyCodeObject" >&2; exit 1; fi\n'
        f'exec {real[0]} "$@"\n')
    wrapper.chmod(0o755)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        c = capture_pids({"rank0": sleeper.pid}, tmp_path / "s", timeout_s=8, py_spy=str(wrapper))[0]
        assert c.ok and c.threads, c.error
        assert any("failed once (Error: Failed to get stack traces (caused by: Failed to copy PyCodeObject))" in w
                   for w in c.warnings), c.warnings
    finally:
        os.killpg(sleeper.pid, signal.SIGKILL)
        sleeper.wait()
