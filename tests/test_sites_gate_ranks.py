"""`repro sites` refuses a gate naming a rank outside the TP group, as `run` does before launch (round 4 of issue 29,
N6): it said "all 2 injection(s) resolve" (exit 0) for `ranks = [5]` at TP 2 while `run` refused the same file. Both
now share ``repro.scenario.gate_rank_problem``; `sites` says it before starting the target interpreter."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from repro.cli import app
from tests.test_cli_errors import _fake_python  # an interpreter that must never be started

REPO = Path(__file__).resolve().parent.parent
SCENARIO = REPO / "scenarios" / "sglang" / "natural_hicache_io_aux_fault.toml"


def _scenario(tmp_path: Path, ranks: str) -> Path:
    text = SCENARIO.read_text()
    assert "ranks = [0]" in text
    p = tmp_path / "s.toml"
    p.write_text(text.replace("ranks = [0]", f"ranks = {ranks}", 1))
    return p


@pytest.mark.parametrize("ranks", ["[5]", "[-1]"])
def test_sites_refuses_a_gate_rank_outside_the_tp_group_like_run(tmp_path: Path, ranks: str) -> None:
    f, py = _scenario(tmp_path, ranks), _fake_python(tmp_path)
    sites = CliRunner().invoke(app, ["sites", str(f), "--python", str(py)])
    run = CliRunner().invoke(app, ["run", str(f), "--python", str(py), "--evidence-dir", str(tmp_path / "ev")])
    want = f"gate.ranks lists rank(s) {ranks}, outside the TP group of size 2 (expected 0..1)"
    assert sites.exit_code == 2 and want in " ".join(sites.output.split()), sites.output
    assert run.exit_code == 2 and want in " ".join(run.output.split()), run.output
    assert "resolve" not in sites.output
