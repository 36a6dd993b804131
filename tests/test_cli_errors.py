"""Bad input gets one clear line naming the fix, exit 2, and never starts a server (cases a breaker found).

No SGLang here: `--python` is a small stand-in script whose `-c "import sglang"` succeeds, so the checks that
come after the interpreter choice run too; none of these inputs gets as far as a launch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from repro.cli import app
from repro.procs import alive, launch_mark, proc_info, save_procs

from repro.procs import LAUNCH_TOKEN_ENV  # noqa: E402

# the launch token a tree repro.launcher started carries (repro.cleanup signals only processes that have it)
TOKEN = "test-launch-token"
TOKEN_ENV = {**os.environ, LAUNCH_TOKEN_ENV: TOKEN}

REPO = Path(__file__).resolve().parent.parent
SMOKE = REPO / "scenarios" / "sglang" / "smoke_extra_allreduce.toml"
runner = CliRunner()


def _fake_python(tmp_path: Path) -> Path:
    py = tmp_path / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/sh\nexit 0\n")
    py.chmod(0o755)
    return py


def _scenario(tmp_path: Path, ranks: str = "[0]", tp: int = 2) -> Path:
    text = SMOKE.read_text().replace("ranks = [0]", f"ranks = {ranks}", 1).replace("tp_size = 2", f"tp_size = {tp}")
    p = tmp_path / "s.toml"
    p.write_text(text)
    return p


def _run(*args: str) -> tuple[int, str]:
    r = runner.invoke(app, list(args))
    return r.exit_code, r.output


def _no_run_folder(ev: Path) -> bool:
    return not any(ev.glob("*/*/run.json"))


@pytest.mark.parametrize("ranks", ["[5]", "[-1]"])
def test_gate_rank_outside_the_tp_group_is_refused(tmp_path, ranks):
    code, out = _run("run", str(_scenario(tmp_path, ranks)), "--evidence-dir", str(tmp_path / "ev"))
    assert code == 2 and "gate.ranks" in out and "outside the TP group of size 2" in out
    assert _no_run_folder(tmp_path / "ev")


def test_deadlock_variant_on_one_rank_is_refused(tmp_path):
    code, out = _run("run", str(SMOKE), "--tp", "1", "--evidence-dir", str(tmp_path / "ev"))
    assert code == 2 and "at least 2 ranks" in out and "--tp 2" in out


def test_missing_model_folder_is_refused_before_launch(tmp_path):
    py = _fake_python(tmp_path)
    code, out = _run("run", str(SMOKE), "--python", str(py), "--model", str(tmp_path / "nope"), "--evidence-dir", str(tmp_path / "ev"))
    assert code == 2 and "--model" in out and "no such folder" in out
    assert _no_run_folder(tmp_path / "ev")


def test_python_that_is_a_directory_is_refused(tmp_path):
    code, out = _run("run", str(SMOKE), "--python", str(tmp_path), "--evidence-dir", str(tmp_path / "ev"))
    assert code == 2 and "not an executable file" in out and _no_run_folder(tmp_path / "ev")


@pytest.mark.parametrize("content", ["{not json", "{}", "[]"])
def test_arm_with_a_corrupt_plan_is_exit_2(tmp_path, content):
    (tmp_path / "plan.json").write_text(content)
    code, out = _run("arm", str(tmp_path))
    assert code == 2 and "plan.json" in out and "Traceback" not in out


def test_arm_without_a_live_server_is_refused(tmp_path):
    (tmp_path / "plan.json").write_text(json.dumps({"arm_file": str(tmp_path / "ARM"), "injections": [{"id": "x"}]}))
    code, out = _run("arm", str(tmp_path))
    assert code == 2 and "no live server" in out and not (tmp_path / "ARM").exists()


def test_cleanup_of_a_corrupt_process_list_is_exit_2(tmp_path):
    (tmp_path / "processes.json").write_text("[1, 2")
    code, out = _run("cleanup", str(tmp_path))
    assert code == 2 and "not a process list" in out


def test_cleanup_refuses_a_run_whose_harness_is_alive_unless_forced(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True, env=TOKEN_ENV)
    try:
        info = proc_info(sleeper.pid)
        save_procs(tmp_path / "processes.json", [info], launch=launch_mark(info, tokens=[TOKEN]))
        me = proc_info(os.getpid())
        (tmp_path / "run.json").write_text(json.dumps({"status": "running", "pid": me.pid, "harness_create_time": me.create_time}))
        code, out = _run("cleanup", str(tmp_path))
        assert code == 2 and "still in progress" in out and "--force" in out and alive(info)
        code, out = _run("cleanup", str(tmp_path), "--force")
        assert code == 0 and "stopped 1 of 1" in out
        sleeper.wait(10)
        assert json.loads((tmp_path / "run.json").read_text())["status"] == "cleaned-up"
    finally:
        if sleeper.poll() is None:
            os.killpg(sleeper.pid, signal.SIGKILL)
            sleeper.wait(10)


def test_cleanup_of_a_hunt_folder_stops_its_session_server_and_removes_its_temp_folder(tmp_path):
    import tempfile

    # the folders a SIGKILLed `repro hunt` leaves: the hunt folder (hunt.jsonl), its session run folder, a trial's
    # folder (session.json); plus the HiCache temp folder the server owned
    session, hunt, trial = tmp_path / "x-hunt-session", tmp_path / "x-hunt", tmp_path / "x-t001"
    for d in (session, hunt, trial):
        d.mkdir()
    owned = Path(tempfile.mkdtemp(prefix="repro-hicache-"))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True, env=TOKEN_ENV)
    try:
        info = proc_info(sleeper.pid)
        save_procs(session / "processes.json", [info], launch=launch_mark(info, tokens=[TOKEN]))
        (session / "owned_dirs.json").write_text(json.dumps([str(owned)]))
        (hunt / "hunt.jsonl").write_text(json.dumps({"event": "session", "evidence": str(session)}) + "\n")
        (trial / "session.json").write_text(json.dumps({"session": str(session)}))
        code, out = _run("cleanup", str(trial))  # a trial's folder names its session
        assert code == 0 and "stopped 1 of 1" in out and f"removed {owned}" in out
        sleeper.wait(10)
        assert not owned.exists()
        code, out = _run("cleanup", str(hunt))  # and the hunt folder finds it too: nothing left to do
        assert code == 0 and "nothing to clean" in out
        code, out = _run("cleanup", str(tmp_path / "x-t001" / "stacks"))  # not a run folder of any kind
        assert code == 2 and "a hunt folder" in out
    finally:
        if sleeper.poll() is None:
            os.killpg(sleeper.pid, signal.SIGKILL)
            sleeper.wait(10)
        if owned.exists():
            owned.rmdir()


def test_cleanup_treats_a_killed_harness_not_yet_reaped_as_gone(tmp_path):
    # measured: right after `kill -9` of a hunt, its pid is a zombie of the shell that started it for a moment;
    # cleanup refused ("still in progress") although nothing could ever tear the server down
    harness = subprocess.Popen([sys.executable, "-c", "pass"])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True, env=TOKEN_ENV)
    try:
        h = proc_info(harness.pid)
        deadline = time.monotonic() + 10
        while psutil.Process(harness.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.05)  # not waited for: it stays a zombie
        save_procs(tmp_path / "processes.json", [proc_info(sleeper.pid)], launch=launch_mark(proc_info(sleeper.pid), tokens=[TOKEN]))
        (tmp_path / "run.json").write_text(json.dumps({"status": "running", "pid": h.pid, "harness_create_time": h.create_time}))
        code, out = _run("cleanup", str(tmp_path))
        assert code == 0 and "stopped 1 of 1" in out, out
    finally:
        harness.wait(10)
        if sleeper.poll() is None:
            os.killpg(sleeper.pid, signal.SIGKILL)
        sleeper.wait(10)


def test_analyze_markdown_into_a_missing_folder_is_exit_2(tmp_path, dumps_dir):
    code, out = _run("analyze", str(dumps_dir / "gloo3_extra_allreduce"), "--markdown", str(tmp_path / "no" / "x.md"))
    assert code == 2 and "does not exist" in out


def test_analyze_of_files_with_no_readable_stack_is_exit_2(tmp_path):
    (tmp_path / "rank0.txt").write_text("this is not a stack dump\n")
    (tmp_path / "rank1.txt").write_bytes(b"\x00\x01\x02binary")
    code, out = _run("analyze", str(tmp_path / "rank0.txt"), str(tmp_path / "rank1.txt"))
    assert code == 2 and "no rank's stack could be read" in out
    code, _ = _run("analyze", str(REPO / "tests" / "fixtures" / "dumps" / "sglang_tp2_cpu_idle"))
    assert code == 0  # a readable dump is still an analysis


def test_analyze_of_a_document_names_the_inputs_it_reads():
    """`repro analyze README.md` said only 'no rank dump found in README.md': it names what it reads now, as the
    missing-path message does."""
    code, out = _run("analyze", str(REPO / "README.md"))
    line = " ".join(out.split())
    assert code == 2 and "no rank dump found in" in line
    for accepted in ("evidence folder", "py-spy text or --json", "faulthandler", "one file per rank"):
        assert accepted in line, accepted


def test_disarm_without_a_live_server_is_refused(tmp_path):
    # issue 29 item 4: disarm printed "disarmed" (exit 0) and rewrote a finished run's ARM file
    (tmp_path / "plan.json").write_text(json.dumps({"arm_file": str(tmp_path / "ARM"), "injections": [{"id": "x"}]}))
    (tmp_path / "ARM").write_text("x\n")
    code, out = _run("disarm", str(tmp_path))
    assert code == 2 and "no live server" in out and "disarmed" not in out
    assert (tmp_path / "ARM").read_text() == "x\n"


def test_analyze_on_a_fifo_is_one_line_exit_2(tmp_path):
    # issue 29 item 2: a FIFO gave a NotADirectoryError traceback (exit 1)
    fifo = tmp_path / "dump.fifo"
    os.mkfifo(fifo)
    code, out = _run("analyze", str(fifo))
    assert code == 2 and "Traceback" not in out and "FIFO" in out and "save the dump" in out


# ---- issue 29 items 2 and 5: the rest of the bad-input cases, each one line naming the fix -----------------------

def test_reproduce_no_run_on_a_fifo_is_one_line_exit_2(tmp_path):
    fifo = tmp_path / "dump.fifo"
    os.mkfifo(fifo)
    code, out = _run("reproduce", str(fifo), "--no-run", "--out", str(tmp_path / "out"))
    assert code == 2 and "Traceback" not in out and "FIFO" in out, out


def test_discover_out_under_a_file_is_one_line_exit_2_before_any_scan(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    code, out = _run("discover", str(SMOKE), "--out", str(f / "x.toml"))
    assert code == 2 and "Traceback" not in out and "is a file, not a folder" in out, out
    assert f.read_text() == "x"


def test_discover_binary_rules_is_exit_2_not_internal(tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_bytes(b"\x00\xff\xfe\x89PNG\r\n")
    code, out = _run("discover", str(SMOKE), "--rules", str(rules))
    assert code == 2 and "not a UTF-8 text file" in out, out


def test_cleanup_on_a_file_says_it_is_a_file(tmp_path):
    f = tmp_path / "processes.txt"
    f.write_text("x")
    code, out = _run("cleanup", str(f))
    assert code == 2 and "is a file, not a folder" in out, out


def test_reproduce_on_a_binary_file_does_not_claim_a_rank_was_read(tmp_path):
    b = tmp_path / "bin.dat"
    b.write_bytes(bytes(range(256)) * 8)
    code, out = _run("reproduce", str(b), "--no-run", "--out", str(tmp_path / "out"))
    assert code == 2 and "one rank read" not in out and "(1)" not in out, out


def test_analyze_markdown_under_a_file_says_it_is_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    dumps = sorted(str(p) for p in (REPO / "tests" / "fixtures" / "stacks").glob("gloo3_faulthandler_rank*.txt"))
    code, out = _run("analyze", *dumps, "--markdown", str(f / "x.md"))
    assert code == 2 and "is a file, not a folder" in out and "does not exist" not in out, out


@pytest.mark.parametrize("value,msg", [("yes", "REPRO_FORK_RANKS='yes': expected 1"),
                                       ("1", "REPRO_FORK_RANKS=1 is for CPU servers only")])
def test_fork_ranks_opt_in_off_a_cpu_server_or_malformed_is_refused_before_launch(tmp_path, monkeypatch, value, msg):
    """REPRO_FORK_RANKS (fork sglang's ranks, CPU testbed only): a bad value, or 1 for a server without --device cpu
    (here: not the testbed's interpreter, so no CPU profile), is bad input: exit 2, no launch."""
    py = _fake_python(tmp_path)
    monkeypatch.setenv("REPRO_FORK_RANKS", value)
    code, out = _run("run", str(SMOKE), "--python", str(py), "--model", str(tmp_path), "--evidence-dir", str(tmp_path / "ev"))
    assert code == 2 and msg in out, out
    assert _no_run_folder(tmp_path / "ev")
