"""Hints that name the right knob: an interpreter without the engine package (sites, compare python:REF)."""

from __future__ import annotations

import sys
from pathlib import Path

from typer.testing import CliRunner

from repro.cli import app

REPO = Path(__file__).resolve().parent.parent
SMOKE = REPO / "scenarios" / "sglang" / "smoke_extra_allreduce.toml"


def _python_without_sglang(tmp_path: Path) -> Path:
    """A real Python whose site-packages are off (``-S``): the stdlib works, sglang cannot be imported."""
    py = tmp_path / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    py.chmod(0o755)
    return py


def test_sites_with_an_interpreter_without_sglang_is_one_line(tmp_path: Path):
    r = CliRunner().invoke(app, ["sites", str(SMOKE), "--python", str(_python_without_sglang(tmp_path))])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "no importable sglang" in lines[0] and "--python" in lines[0], r.output


def test_compare_python_ref_without_sglang_names_the_ref_not_only_python(tmp_path: Path):
    py = _python_without_sglang(tmp_path)
    r = CliRunner().invoke(app, ["compare", str(SMOKE), "--before", f"python:{py}", "--after", f"python:{py}",
                                 "--evidence-dir", str(tmp_path / "ev")])
    assert r.exit_code == 2, r.output
    assert f"python:{py}" in r.output and "pass python:PATH" in r.output and "no importable sglang" in r.output


def test_analyze_never_prints_the_raw_bytes_of_a_binary_file(tmp_path: Path):
    (tmp_path / "rank0.txt").write_bytes(b"\x00\x01\x02ELF\xff\xfe\x1b[31mred\x07 garbage")
    r = CliRunner().invoke(app, ["analyze", str(tmp_path / "rank0.txt")])
    assert r.exit_code == 2, r.output
    assert not any(c in r.output for c in "\x00\x01\x02\x07\x1b\ufffd"), repr(r.output)
    assert "binary" in r.output
