"""What REPORT.md's "Versions" and "Timings" say is what they mean: py-spy's version (its path after it, in
parentheses), and the count of stack captures said as a count, never as "captures 0.0" seconds next to the ledger
proof's own capture time (a newcomer's reading of a demo run, 2026-12-06)."""

from __future__ import annotations

import os
from pathlib import Path

from repro.report import ReportInput, render_report
from repro.run.records import collect_versions
from repro.targets.registry import get_adapter
from repro.verdict import DEADLOCKED, Verdict


def test_env_py_spy_is_its_version_then_its_path(tmp_path: Path, monkeypatch):
    """env.json's py_spy was shutil.which's path alone (`/root/.pyenv/shims/py-spy`): the version comes first now."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "py-spy"
    tool.write_text("#!/bin/sh\necho 'py-spy 9.8.7'\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    (tmp_path / "injector").mkdir()
    info = collect_versions(tmp_path / "injector", "/usr/bin/python3", get_adapter())
    assert info["py_spy"] == f"py-spy 9.8.7 ({tool})"


def _report(tmp_path: Path, timings: dict) -> str:
    stacks = tmp_path / "stacks"
    stacks.mkdir(exist_ok=True)
    return render_report(ReportInput(scenario="s", variant="v", variant_expects="deadlock",
                                     verdict=Verdict(DEADLOCKED, "proof"), stacks_dir=stacks, command="repro run s",
                                     timings=timings))


def test_report_says_stack_captures_as_a_count_not_seconds(tmp_path: Path):
    text = _report(tmp_path, {"burst_s": 1.697, "captures": 1.0, "proof_capture_s": 1.486})
    line = text.split("## Timings (seconds)\n\n", 1)[1].splitlines()[0]
    assert line == "burst_s 1.7, proof_capture_s 1.5; stack captures taken: 1"
    assert "captures 1.0" not in text and "captures 0.0" not in text
