"""Where the CPU testbed lives: a separate venv with real sglang + torch, plus in-repo helpers for it.

Layout (set up by ``scripts/cpu_testbed/setup.sh``):

- testbed dir: ``$REPRO_TESTBED_DIR`` or ``~/.cache/tp-deadlock-repro/testbed/sglang-<SGLANG_VERSION>/``
  (``$XDG_CACHE_HOME`` replaces ``~/.cache`` when set), outside the clone so fresh clones and CI reuse it;
- ``<dir>/venv/bin/python``: the server's interpreter;
- ``<dir>/.setup-stamp``: written by setup.sh after an import check passed (versions inside).

In the repository, under ``scripts/cpu_testbed/``: ``stub/`` (the pure-torch ``sgl_kernel`` stand-in, prepended to
the server's PYTHONPATH), ``tiny_llama/`` (config-only model for ``--load-format dummy``) and ``compat/`` (the
HiCache CPU compatibility layer, loaded by a .pth file inside the venv when ``REPRO_TESTBED_COMPAT=1``).
This module never imports sglang or torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

SGLANG_VERSION = "0.5.23"
TORCH_VERSION = "2.14.1"
TESTBED_DIR_ENV = "REPRO_TESTBED_DIR"
COMPAT_ENV = "REPRO_TESTBED_COMPAT"
COMPAT_DIR_ENV = "REPRO_TESTBED_COMPAT_DIR"
STAMP_NAME = ".setup-stamp"

_REPO = Path(__file__).resolve().parent.parent
_CPU_TESTBED = _REPO / "scripts" / "cpu_testbed"


def testbed_dir() -> Path:
    """The testbed folder (may not exist yet): ``$REPRO_TESTBED_DIR`` or the per-user cache folder."""
    env = os.environ.get(TESTBED_DIR_ENV)
    if env:
        return Path(env).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "tp-deadlock-repro" / "testbed" / f"sglang-{SGLANG_VERSION}"


def testbed_python() -> Optional[Path]:
    """``<testbed dir>/venv/bin/python`` if that file exists, else None (existence only; see :func:`is_set_up`)."""
    py = testbed_dir() / "venv" / "bin" / "python"
    return py if py.exists() else None


def is_set_up() -> bool:
    """True iff the testbed's python exists and setup.sh wrote its stamp (the import check passed)."""
    return testbed_python() is not None and (testbed_dir() / STAMP_NAME).is_file()


def cpu_testbed_dir() -> Path:
    """``scripts/cpu_testbed`` in this checkout."""
    return _CPU_TESTBED


def tiny_model_dir() -> Path:
    """The config-only tiny Llama (hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 1024, float32)."""
    return _CPU_TESTBED / "tiny_llama"


def stub_dir() -> Path:
    """Folder holding the ``sgl_kernel`` stand-in package: prepend it to the server's PYTHONPATH."""
    return _CPU_TESTBED / "stub"


def compat_dir() -> Path:
    """Folder holding the HiCache CPU compatibility layer (``repro_testbed_compat``), loaded via a .pth file."""
    return _CPU_TESTBED / "compat"


def setup_command() -> str:
    """The command a user runs to create the testbed (for error messages)."""
    return "bash scripts/cpu_testbed/setup.sh"
