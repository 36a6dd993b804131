"""A refused `repro compare` (or `run`) prints its error as the first line of stderr (round 4 of issue 29: compare's
errors started with an empty line, left by the progress display that was entered before the first check and never
showed anything). Bad REFs are refused before any server starts, so no SGLang is needed here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
S = REPO / "scenarios" / "sglang" / "hicache_prefetch_30760.toml"


@pytest.mark.parametrize("args", [
    ["compare", str(S), "--before", "relase:0.5.23", "--after", "installed"],
    ["compare", str(S), "--before", "installed", "--after", "patch:/nonexistent.patch"],
    ["compare", str(S), "--before", "installed", "--after", "installed", "--only", "sideways"],
])
def test_compare_error_is_the_first_line_of_stderr(tmp_path: Path, args: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    r = subprocess.run([sys.executable, "-m", "repro", *args, "--evidence-dir", str(tmp_path / "ev")],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.startswith("error:"), repr(r.stderr[:200])
