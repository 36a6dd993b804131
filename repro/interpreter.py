"""Which Python interpreter runs the server (see docs/pipeline.md). The harness itself never imports the engine.

Order: ``--python`` if given; else this interpreter if it can import the engine's package (the adapter's
``ref_location.package``, ``sglang``; checked in a subprocess); else the CPU testbed's if it is set up; else
:class:`InterpreterError` naming both fixes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

from repro import testbed

IMPORT_CHECK_TIMEOUT_S = 120.0


class InterpreterError(Exception):
    """No usable server interpreter; ``str()`` is one line naming ``--python`` and the testbed setup command."""


def _default_package() -> str:
    from repro.targets.registry import get_adapter

    return get_adapter().ref_location.package


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


def can_import_sglang(python: str, timeout_s: float = IMPORT_CHECK_TIMEOUT_S) -> bool:
    """:func:`can_import` of the default adapter's engine package (kept for callers of the old name)."""
    return can_import(python, _default_package(), timeout_s)


def choose_python(explicit: Optional[str], require_package: bool = True, package: Optional[str] = None,
                  adapter: Optional[object] = None) -> str:
    """Pick the interpreter that runs the server.

    Args:
        explicit: the ``--python`` value, or None.
        require_package: an explicit interpreter must be able to import the engine (checked in a subprocess, a few
            seconds); ``repro sites`` passes False so it can report missing modules itself.
        package: the engine's package (the scenario's adapter's ``ref_location.package``; default: the default
            adapter's, ``sglang``).
        adapter: the scenario's adapter: its ``testbed_python()`` / ``testbed_setup_command()`` name the CPU
            testbed to fall back on (default: the SGLang testbed of ``repro.testbed``).
    Returns:
        Path (or command name found on PATH) of the interpreter.
    Raises:
        InterpreterError: ``explicit`` does not exist, is not an executable file, or cannot import the engine; or
            no interpreter with it was found and the CPU testbed is not set up (message names ``--python`` and
            ``bash scripts/cpu_testbed/setup.sh``).
    """
    pkg = package or _default_package()
    tb_python = getattr(adapter, "testbed_python", None)
    setup_cmd = adapter.testbed_setup_command() if hasattr(adapter, "testbed_setup_command") else testbed.setup_command()
    if explicit:
        path = Path(explicit)
        found = str(path) if path.exists() else shutil.which(explicit)
        if not found:
            raise InterpreterError(f"--python {explicit}: no such interpreter; pass the path of a python that has {pkg} installed")
        if not (Path(found).is_file() and os.access(found, os.X_OK)):
            raise InterpreterError(f"--python {explicit}: not an executable file; pass the path of a python interpreter (e.g. venv/bin/python)")
        if require_package and not can_import(found, pkg):
            raise InterpreterError(
                f"--python {explicit}: cannot import {pkg}; pass a python that has {pkg} installed, or run `{setup_cmd}` "
                "and omit --python")
        return found
    if can_import(sys.executable, pkg):
        return sys.executable
    if tb_python is not None:
        found_tb = tb_python()
        if found_tb is not None:
            return str(found_tb)
        raise InterpreterError(
            f"no Python with {pkg} found: this interpreter ({sys.executable}) cannot import {pkg} and the {pkg} CPU "
            f"testbed is not set up; pass --python PATH or run `{setup_cmd}`")
    if testbed.is_set_up():
        return str(testbed.testbed_python())
    raise InterpreterError(
        f"no Python with {pkg} found: this interpreter ({sys.executable}) cannot import {pkg} and the CPU testbed "
        f"is not set up at {testbed.testbed_dir()}; pass --python PATH or run `{setup_cmd}`"
    )
