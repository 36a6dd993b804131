"""`repro cleanup` also ends what a launched tree started after its processes.json was written and that carries
the run's launch token — the `stop` nemesis's SIGCONT helper (`sh -c '…; sleep S; kill -CONT <rank>'`, its own
session). Breaking pass round 4, natural nemeses: after `kill -9` of the harness while rank 1 was SIGSTOPped, cleanup
ended the 5 recorded processes but the helper (sh + `sleep 300`) lived on, to SIGCONT a pid that no longer was the
rank's. Real processes, no sglang; every process started here is ended by its pid in a finally."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from repro import evidence as ev
from repro.cli import app
from repro.launcher import start_server
from repro.procs import LAUNCH_TOKEN_ENV
from repro.runner import save_server_procs
from repro.targets.base import LaunchSpec
from tests.test_cleanup_launch_token import _SleepAdapter

SLEEP = shutil.which("sleep") or "/bin/sleep"


def test_cleanup_ends_an_unrecorded_process_carrying_the_runs_launch_token(tmp_path: Path):
    evd = ev.EvidenceDir(tmp_path / "ev", "s", "v")
    server = start_server(_SleepAdapter(), LaunchSpec(python=sys.executable, model="/nonexistent/model", tp_size=2),
                          evd.server_log.path)
    helper = other = None
    try:
        save_server_procs(evd, server)  # the record, before the helper exists
        token = server.env[LAUNCH_TOKEN_ENV]
        helper = subprocess.Popen(["/bin/sh", "-c", f"sleep 120; kill -CONT {server.pid}"], start_new_session=True,
                                  env={**os.environ, LAUNCH_TOKEN_ENV: token})
        other = subprocess.Popen([SLEEP, "120"], start_new_session=True,  # another run's token: left alone
                                 env={**os.environ, LAUNCH_TOKEN_ENV: "0" * 32})
        r = CliRunner().invoke(app, ["cleanup", str(evd.path), "--force"])
        assert r.exit_code == 0 and "stopped 1 of 1" in r.output, r.output
        assert f"also stopped pid {helper.pid} (/bin/sh -c sleep 120" in r.output, r.output
        assert helper.wait(15) is not None
        assert other.poll() is None
    finally:
        for p in (helper, other):
            if p is not None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
                p.wait(10)
        try:
            os.killpg(server.pid, signal.SIGKILL)
        except OSError:
            pass
        server.popen.wait(10)
