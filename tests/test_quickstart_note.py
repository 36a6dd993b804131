"""scripts/quickstart.sh says so, in one NOTE line, before it re-points an interpreter's `repro` from another
checkout to this clone (the default python3 on a shared box imports whichever checkout installed itself editable
last), and how to avoid it (PYTHON=/path/to/venv/bin/python). No install happens here: the stand-in interpreter
refuses `-m pip`, so the script stops at step 1 (exit 1) and never reaches the testbed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "quickstart.sh"


def _python(tmp_path: Path, pythonpath: Path, *flags: str) -> Path:
    py = tmp_path / "bin" / "python"
    py.parent.mkdir(parents=True, exist_ok=True)
    py.write_text("#!/bin/sh\n"
                  'case "$*" in *"-m pip"*) echo "pip refused by the test" >&2; exit 1;; esac\n'
                  f'PYTHONPATH="{pythonpath}" exec "{sys.executable}" {" ".join(flags)} "$@"\n')
    py.chmod(0o755)
    return py


def _quickstart(py: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "demo"], env={"PATH": "/usr/bin:/bin", "PYTHON": str(py),
                                                             "HOME": str(py.parent)},
                          capture_output=True, text=True, timeout=120)


def test_quickstart_says_it_re_points_another_checkouts_repro(tmp_path: Path):
    other = tmp_path / "other-checkout"
    (other / "repro").mkdir(parents=True)
    (other / "repro" / "__init__.py").write_text("")
    r = _quickstart(_python(tmp_path, other))
    notes = [line for line in r.stdout.splitlines() if "NOTE:" in line]
    assert r.returncode == 1 and "pip could not install the harness" in r.stderr, r.stdout + r.stderr
    assert len(notes) == 1, r.stdout
    assert f"imports repro from another checkout ({other})" in notes[0] and str(REPO) in notes[0]
    assert "PYTHON=.venv/bin/python" in notes[0]


def test_quickstart_says_nothing_when_no_other_checkout_is_imported(tmp_path: Path):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _quickstart(_python(tmp_path, empty, "-S"))  # no site-packages: no installed repro anywhere
    assert r.returncode == 1 and "NOTE:" not in r.stdout, r.stdout + r.stderr
