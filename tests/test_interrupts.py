"""Interrupts: Ctrl-C exits 130 and SIGTERM 143 (every verb but watch), the tree is torn down, run.json says so.

No SGLang: ``--python`` is a small stand-in whose ``-c`` checks succeed and whose "server" prints a loading line
and never becomes healthy, so the interrupt always lands during start-up (what a user does after 30 s of nothing).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SMOKE = REPO / "scenarios" / "sglang" / "smoke_extra_allreduce.toml"


def _slow_python(tmp_path: Path) -> Path:
    py = tmp_path / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text('#!/bin/sh\ncase "$1" in -c) exit 0;; esac\necho "loading weights (stand-in)"\nexec sleep 3600\n')
    py.chmod(0o755)
    return py


def _interrupt(tmp_path: Path, verb: str, sig: int) -> tuple[int, str, Path]:
    ev = tmp_path / "ev"
    cmd = [sys.executable, "-m", "repro.cli", verb, str(SMOKE), "--python", str(_slow_python(tmp_path)),
           "--model", str(tmp_path), "--evidence-dir", str(ev)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        log = None
        while time.monotonic() < deadline and proc.poll() is None:
            logs = list(ev.glob("*/*/server.log"))
            if logs and "loading weights" in logs[0].read_text(errors="replace"):
                log = logs[0]
                break
            time.sleep(0.1)
        assert log is not None, "the stand-in server never started"
        time.sleep(0.5)
        os.kill(proc.pid, sig)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            print(proc.communicate(timeout=10)[0])  # what the stuck command said, for the failure report
        from repro.procs import load_procs, stop_procs

        for f in ev.glob("*/*/processes.json"):  # the server runs in its own session: end it by its record
            stop_procs(load_procs(f), grace_s=1.0)
    return proc.returncode, out, log.parent


def _nothing_left(run_dir: Path) -> None:
    from repro.procs import alive, load_procs

    assert not any(alive(p) for p in load_procs(run_dir / "processes.json")), "a server process was left running"


@pytest.mark.parametrize("verb, sig, code", [("serve", signal.SIGINT, 130), ("serve", signal.SIGTERM, 143),
                                             ("run", signal.SIGTERM, 143)])
def test_an_interrupt_during_start_up_exits_130_or_143_and_marks_the_run_interrupted(tmp_path: Path, verb, sig, code):
    rc, out, run_dir = _interrupt(tmp_path, verb, sig)
    assert rc == code, out
    assert json.loads((run_dir / "run.json").read_text())["status"] == "interrupted"
    if verb == "serve":
        assert "starting the server" in out and "waiting for" in out, "serve said nothing during start-up"
    _nothing_left(run_dir)


def test_after_an_interrupt_further_signals_are_ignored_but_servers_started_later_still_obey_sigterm():
    """The first SIGTERM interrupts; later ones are ignored in the harness, with a Python-level no-op rather than
    SIG_IGN: an ignored disposition is inherited across exec, so a server started afterwards (the next server of a
    hunt, every later test's) ignored SIGTERM and each stop waited its whole grace before SIGKILL."""
    from repro import cli

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    child = None
    try:
        cli._sigterm_to_interrupt()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.0)
            raise AssertionError("the first SIGTERM did not interrupt")
        except KeyboardInterrupt:
            pass
        os.kill(os.getpid(), signal.SIGTERM)  # a second one: ignored in the harness (no KeyboardInterrupt)
        time.sleep(0.1)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        time.sleep(0.2)
        with open(f"/proc/{child.pid}/status") as f:
            ign = int(next(ln for ln in f if ln.startswith("SigIgn:")).split()[1], 16)
        assert not ign & (1 << (signal.SIGTERM - 1)), "a server started after the interrupt inherits SIGTERM ignored"
        assert not ign & (1 << (signal.SIGINT - 1)), "a server started after the interrupt inherits SIGINT ignored"
        child.terminate()
        assert child.wait(timeout=5) == -signal.SIGTERM
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait(5)
        for s, h in saved.items():
            signal.signal(s, h)
        cli._INTERRUPT_SIGNAL = None
