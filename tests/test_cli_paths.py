"""Every verb's path options are checked the same way before anything is read, written or launched (repro.paths,
issue 29 item 2): a FIFO, a folder, a binary file or a file on a folder's way is one line naming the option, the
path, what it is and the fix, exit 2 — never a traceback, never a read that blocks for ever on a FIFO.

No server can start here: launching verbs get ``--python`` of a path that does not exist and no testbed, so even a
check that came too late would stop at the interpreter choice (and fail these tests by its different message).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from repro import paths
from repro.cli import app

REPO = Path(__file__).resolve().parent.parent
SMOKE = REPO / "scenarios" / "sglang" / "smoke_extra_allreduce.toml"
HANG = REPO / "tests" / "fixtures" / "dumps" / "sglang_tp2_cpu_hang"
NO_PY = "/nonexistent/bin/python"
runner = CliRunner()


@pytest.fixture
def things(tmp_path: Path, monkeypatch) -> Path:
    """tmp_path holding afile (text), bin.dat (binary), adir/ and fifo; the testbed hidden (no server can start)."""
    monkeypatch.setenv("REPRO_TESTBED_DIR", str(tmp_path / "no-testbed"))
    (tmp_path / "afile").write_text("x\n")
    (tmp_path / "bin.dat").write_bytes(b"\xff\xfe\x00\x81PNG\r\n" * 32)
    (tmp_path / "adir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    return tmp_path


def _sub(tmp: Path, *args: str) -> tuple[int, str]:
    """The CLI in a child process with a bound: a FIFO read or write that blocks shows as a timeout, not a hang."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "REPRO_TESTBED_DIR": str(tmp / "no-testbed")}
    try:
        p = subprocess.run([sys.executable, "-m", "repro", *args], cwd=tmp, env=env, capture_output=True, text=True,
                           timeout=60)
    except subprocess.TimeoutExpired:
        return -1, "timed out (blocked on the FIFO)"
    return p.returncode, p.stdout + p.stderr


# (args with {t} for the temp folder, words the one error line must hold)
IN_PROCESS = [
    (["analyze", str(HANG), "--markdown", "{t}/adir"], "--markdown {t}/adir: is a folder"),
    (["analyze", str(HANG), "--markdown", "{t}/afile/x.md"], "{t}/afile is a file, not a folder"),
    (["reproduce", str(HANG), "--no-run", "--out", "{t}/afile"], "--out {t}/afile: is a file, not a folder"),
    (["reproduce", str(HANG), "--no-run", "--out", "{t}/afile/sub"], "{t}/afile is a file, not a folder"),
    (["reproduce", str(HANG), "--evidence-dir", "{t}/afile", "--python", NO_PY], "--evidence-dir {t}/afile: is a file"),
    (["reproduce", str(HANG), "--no-run", "--report", "{t}/nofile", "--out", "{t}/o"], "--report {t}/nofile: not found"),
    (["discover", str(SMOKE), "--rules", "{t}/bin.dat"], "--rules {t}/bin.dat: not a UTF-8 text file"),
    (["discover", str(SMOKE), "--out", "{t}/adir"], "--out {t}/adir: is a folder"),
    (["hunt", str(SMOKE), "--catalogue", "{t}/bin.dat", "--python", NO_PY], "--catalogue {t}/bin.dat: not a UTF-8 text file"),
    (["hunt", str(SMOKE), "--workload-file", "{t}/bin.dat", "--python", NO_PY], "--workload-file {t}/bin.dat: not a UTF-8"),
    (["hunt", str(SMOKE), "--discover-rules", "{t}/adir", "--python", NO_PY], "--discover-rules {t}/adir: is a folder"),
    (["run", str(SMOKE), "--evidence-dir", "{t}/afile", "--python", NO_PY], "--evidence-dir {t}/afile: is a file, not a folder"),
    (["serve", str(SMOKE), "--evidence-dir", "{t}/afile/x/y", "--python", NO_PY], "{t}/afile is a file, not a folder"),
    (["run", str(SMOKE), "--hosts", "{t}/bin.dat", "--python", NO_PY], "--hosts {t}/bin.dat: not a UTF-8 text file"),
    (["hunt-merge", "{t}/adir", "--out", "{t}/afile"], "--out {t}/afile: is a file, not a folder"),
    (["sites", "{t}/adir"], "{t}/adir: is a folder; pass a scenario .toml file"),
    (["run", "{t}/fifo", "--python", NO_PY], "{t}/fifo: is a FIFO (named pipe), not a regular file"),
    (["watch", "--url", "http://127.0.0.1:9", "--once", "--ledger-dir", "{t}/afile"], "--ledger-dir {t}/afile: is a file"),
]


@pytest.mark.parametrize("args,words", IN_PROCESS, ids=[f"{a[0]} {w}" for a, w in IN_PROCESS])
def test_a_bad_path_option_is_one_line_exit_2(things: Path, args, words):
    r = runner.invoke(app, [a.format(t=things) for a in args])
    out = r.output
    assert r.exit_code == 2 and "Traceback" not in out and words.format(t=things) in out, out
    assert len([x for x in out.splitlines() if x.strip()]) == 1, out  # one line
    assert (things / "afile").read_text() == "x\n" and not any((things / "adir").iterdir())  # nothing written


FIFO_CASES = [
    (["analyze", str(HANG), "--markdown", "fifo"], "--markdown fifo: is a FIFO"),
    (["reproduce", str(HANG), "--no-run", "--report", "fifo", "--out", "o"], "--report fifo: is a FIFO"),
    (["discover", str(SMOKE), "--rules", "fifo"], "--rules fifo: is a FIFO"),
    (["run", str(SMOKE), "--hosts", "fifo", "--python", NO_PY], "--hosts fifo: is a FIFO"),
    (["watch", "--url", "http://127.0.0.1:9", "--once", "--hosts", "fifo"], "--hosts fifo: is a FIFO"),
]


@pytest.mark.parametrize("args,words", FIFO_CASES, ids=[f"{a[0]} {w}" for a, w in FIFO_CASES])
def test_a_fifo_given_as_a_file_is_refused_not_blocked_on(things: Path, args, words):
    # measured before: `analyze --markdown FIFO`, `reproduce --report FIFO`, `run/watch --hosts FIFO` blocked for ever
    code, out = _sub(things, *args)
    assert code == 2 and "Traceback" not in out and words in out, out


def test_output_dir_accepts_a_missing_folder_and_creates_nothing(tmp_path: Path):
    assert paths.output_dir(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert not (tmp_path / "a").exists()
    assert paths.output_file(tmp_path / "x.md") == tmp_path / "x.md" and not (tmp_path / "x.md").exists()
    (tmp_path / "t.toml").write_bytes(b"\xef\xbb\xbfa = 1\n")  # a byte-order mark is dropped
    assert paths.read_text(tmp_path / "t.toml") == "a = 1\n"
