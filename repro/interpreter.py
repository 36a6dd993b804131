"""Which Python interpreter runs the server (see docs/pipeline.md). The harness itself never imports the engine.

Order: ``--python`` if given; else this interpreter if it can import the engine's package (the scenario's adapter's
``ref_location.package``; checked in a subprocess); else that adapter's CPU testbed's if it has one and it is set up;
else :class:`InterpreterError` naming both fixes. The adapter is the run's (resolved once from the scenario and passed
down); nothing here picks an engine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

IMPORT_CHECK_TIMEOUT_S = 120.0


class InterpreterError(Exception):
    """No usable server interpreter; ``str()`` is one line naming ``--python`` and the testbed setup command."""


_IMPORTS_OK: set = set()  # (interpreter, package, PYTHONPATH) that imported once in this process


def can_import(python: str, package: str, timeout_s: float = IMPORT_CHECK_TIMEOUT_S) -> bool:
    """True iff ``python -c "import <package>"`` exits 0 within ``timeout_s`` seconds (run in a subprocess).

    A success is remembered for this process (importing sglang takes ~5 s on 2 cores, and a verb that launches
    several times — compare's sides, a hunt's servers — checks the same interpreter each time); a failure is not."""
    # not realpath (a venv's python is a link); the inherited PYTHONPATH decides what imports, so it is in the key
    key = (os.path.abspath(python) if os.path.sep in python else python, package, os.environ.get("PYTHONPATH", ""))
    if key in _IMPORTS_OK:
        return True
    try:
        r = subprocess.run([python, "-c", f"import {package}"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return False
    if r.returncode == 0:
        _IMPORTS_OK.add(key)
    return r.returncode == 0


def choose_python(explicit: Optional[str], adapter: Any, require_package: bool = True) -> str:
    """Pick the interpreter that runs the server.

    Args:
        explicit: the ``--python`` value, or None.
        adapter: the run's engine adapter: its ``ref_location.package`` is what the interpreter must import, its
            ``testbed_python()`` / ``testbed_setup_command()`` name the CPU testbed to fall back on (none for an
            engine without one).
        require_package: an explicit interpreter must be able to import the engine (checked in a subprocess, a few
            seconds); ``repro sites`` passes False so it can report missing modules itself.
    Returns:
        Path (or command name found on PATH) of the interpreter.
    Raises:
        InterpreterError: ``explicit`` does not exist, is not an executable file, or cannot import the engine; or
            no interpreter with it was found and the engine's CPU testbed is not set up (the message names
            ``--python`` and the testbed's setup command).
    """
    pkg = adapter.ref_location.package or adapter.name
    setup_cmd = adapter.testbed_setup_command()
    if explicit:
        path = Path(explicit)
        found = str(path) if path.exists() else shutil.which(explicit)
        if not found:
            raise InterpreterError(f"--python {explicit}: no such interpreter; pass the path of a python that has {pkg} installed")
        if not (Path(found).is_file() and os.access(found, os.X_OK)):
            raise InterpreterError(f"--python {explicit}: not an executable file; pass the path of a python interpreter (e.g. venv/bin/python)")
        if require_package and not can_import(found, pkg):
            raise InterpreterError(
                f"--python {explicit}: cannot import {pkg}; pass a python that has {pkg} installed"
                + (f", or run `{setup_cmd}` and omit --python" if setup_cmd else ""))
        return found
    if can_import(sys.executable, pkg):
        return sys.executable
    found_tb = adapter.testbed_python()
    if found_tb is not None:
        return str(found_tb)
    if setup_cmd:
        raise InterpreterError(
            f"no Python with {pkg} found: this interpreter ({sys.executable}) cannot import {pkg} and the {adapter.name} "
            f"CPU testbed is not set up; pass --python PATH or run `{setup_cmd}`")
    raise InterpreterError(
        f"no Python with {pkg} found: this interpreter ({sys.executable}) cannot import {pkg} and the {adapter.name} "
        "adapter has no CPU testbed; pass --python PATH")
