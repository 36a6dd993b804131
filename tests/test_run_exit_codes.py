"""verdict.json's ``exit_code`` is always the exit code ``repro run`` ends with (issue 29 item 3: a refused run's
verdict.json said INCONCLUSIVE / ``"exit_code": 4`` while the process exited 2).

``repro run`` is invoked as a user does (the CLI, its SIGTERM handler installed); only the session is a stand-in
that ends its start the way a real one can — refused (a site that resolves nowhere in the healthy server), Ctrl-C,
SIGTERM, an internal error — so no server is launched.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from repro import cli
from repro import evidence as ev
from repro import runner
from repro.scenario import compile_plan, load_scenario
from repro.targets.base import LaunchSpec
from repro.targets.sglang import SGLangAdapter

REPO = Path(__file__).resolve().parent.parent
SMOKE = REPO / "scenarios" / "sglang" / "smoke_extra_allreduce.toml"


class _EndsAtStart(runner.Session):
    """A session whose start ends as ``how`` says (never launches anything)."""

    def __init__(self, p: runner.Prepared, how: object) -> None:
        super().__init__(p)
        self.how = how

    def start(self):
        if self.how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)  # the CLI's handler turns it into an interrupt
            time.sleep(10)
            raise AssertionError("SIGTERM did not interrupt")
        raise self.how


@pytest.fixture()
def restore_signals():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)
    cli._INTERRUPT_SIGNAL = None


def _run_cli(tmp_path: Path, monkeypatch, how: object) -> tuple[int, dict]:
    scen = load_scenario(SMOKE)
    variant = scen.variant("control")
    evd = ev.EvidenceDir(tmp_path / "evidence", scen.name, "control")
    arm = evd.path / "ARM"
    plan = compile_plan(scen, variant, evd.injector_dir, arm)
    evd.plan.write(plan)
    spec = LaunchSpec(python=sys.executable, model="unused", tp_size=1)
    p = runner.Prepared(scen, variant, evd, plan, spec, SGLangAdapter(), sys.executable, False, arm)
    monkeypatch.setattr(runner, "run", lambda opts, observe=runner._noop:
                        runner.run_prepared(p, opts, observe, session=_EndsAtStart(p, how)))
    r = CliRunner().invoke(cli.app, ["run", str(SMOKE), "--variant", "control", "--evidence-dir", str(tmp_path / "evidence")])
    return r.exit_code, ev.read_json(evd.verdict.path)


@pytest.mark.parametrize("how, code", [
    (runner.UnresolvedSitesError("variants.control.injections.x.site: m:C.f is absent (nearest: C.g)"), 2),
    (KeyboardInterrupt(), 130),
    ("sigterm", 143),
    (RuntimeError("a bug before the verdict"), 1),
], ids=["refused", "ctrl-c", "sigterm", "internal-error"])
def test_verdict_json_exit_code_is_the_process_exit_code(tmp_path, monkeypatch, restore_signals, how, code):
    exit_code, verdict = _run_cli(tmp_path, monkeypatch, how)
    assert exit_code == code
    assert verdict is not None and verdict["verdict"] == "INCONCLUSIVE"  # the evidence written is kept
    assert verdict["exit_code"] == exit_code, verdict
