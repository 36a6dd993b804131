"""`repro arm` and `repro disarm` follow one rule (issue 29 item 4): a folder whose server is gone is refused, exit 2,
with the same "no live server belongs to …" line, and its ARM file is left byte for byte as it was.

The folder is a finished served run as the store and the runner lay it out (repro.evidence.EvidenceDir, plan.json,
ARM via repro.runner.write_arm_file, processes.json via repro.runner.save_server_procs of a tree the real launcher
started, serve.json as `repro serve` writes it, run.json "complete"), with /bin/sleep standing in for the server.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from repro import evidence as ev
from repro.cli import app
from repro.launcher import start_server
from repro.procs import alive, proc_info
from repro.runner import save_server_procs, write_arm_file
from repro.targets.base import LaunchSpec
from repro.targets.sglang import SGLangAdapter

SLEEP = shutil.which("sleep") or "/bin/sleep"
runner = CliRunner()


class _SleepAdapter(SGLangAdapter):
    def launch_command(self, spec: LaunchSpec) -> list[str]:
        return [SLEEP, "120"]


def _served_folder(root: Path, with_serve_json: bool):
    """A served (or run) folder with its server running: (EvidenceDir, Server)."""
    evd = ev.EvidenceDir(root, "smoke_extra_allreduce", "serve-extra")
    evd.plan.write({"arm_file": str(evd.arm.path), "out_dir": str(evd.path / ev.Layout.INJECTOR.name),
                    "injections": [{"id": "extra_allreduce", "site": "m:f"}]})
    server = start_server(_SleepAdapter(), LaunchSpec(python=sys.executable, model="/nonexistent/model", tp_size=2),
                          evd.server_log.path)
    save_server_procs(evd, server)
    if with_serve_json:
        evd.serve.write({"url": f"http://127.0.0.1:{server.spec.port}", "pid": server.pid, "rank_pids": {},
                         "injections": ["extra_allreduce"], "arm_file": str(evd.arm.path)})
    write_arm_file(evd.arm.path, ["extra_allreduce"])  # armed while it ran
    return evd, server


@pytest.mark.parametrize("with_serve_json", [True, False], ids=["repro serve folder", "repro run folder"])
def test_arm_and_disarm_refuse_a_finished_run_alike_and_leave_its_arm_file(tmp_path: Path, with_serve_json):
    evd, server = _served_folder(tmp_path / "evidence", with_serve_json)
    try:
        info = proc_info(server.pid)
        server.stop()
        deadline = time.monotonic() + 10
        while alive(info) and time.monotonic() < deadline:
            time.sleep(0.05)
        evd.set_status("complete")
        before = evd.arm.path.read_bytes()
        outs = {}
        for verb in ("arm", "disarm"):
            r = runner.invoke(app, [verb, str(evd.path)])
            outs[verb] = r.output
            assert r.exit_code == 2 and f"no live server belongs to {evd.path}" in r.output, (verb, r.output)
            assert "disarmed" not in r.output and "armed:" not in r.output
            assert evd.arm.path.read_bytes() == before, f"{verb} rewrote a finished run's ARM file"
        assert outs["arm"] == outs["disarm"]  # one rule, one line
    finally:
        try:
            os.killpg(server.pid, signal.SIGKILL)
        except OSError:
            pass
        server.popen.wait(10)


def test_disarm_of_a_live_server_still_writes_an_empty_arm_file(tmp_path: Path):
    evd, server = _served_folder(tmp_path / "evidence", with_serve_json=True)
    try:
        r = runner.invoke(app, ["disarm", str(evd.path)])
        assert r.exit_code == 0 and "disarmed" in r.output, r.output
        assert [x for x in evd.arm.path.read_text().splitlines() if x and not x.startswith("#")] == []
    finally:
        server.stop()
