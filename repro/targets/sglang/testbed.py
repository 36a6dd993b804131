"""Where SGLang's CPU testbed lives: a separate venv with real sglang + torch, plus in-repo helpers for it.

``repro.testbed`` is this module under its old name (a shim kept for the tests, scripts and benchmarks that import it).

Layout (set up by ``scripts/cpu_testbed/setup.sh``):

- testbed dir: ``$REPRO_TESTBED_DIR`` or ``~/.cache/tp-deadlock-repro/testbed/sglang-<SGLANG_VERSION>/``
  (``$XDG_CACHE_HOME`` replaces ``~/.cache`` when set), outside the clone so fresh clones and CI reuse it;
- ``<dir>/venv/bin/python``: the server's interpreter;
- ``<dir>/.setup-stamp``: written by setup.sh after an import check passed (versions inside).

The testbed's files (``repro.resources.testbed_files_dir()``: ``scripts/cpu_testbed/`` in a clone,
``repro/_data/cpu_testbed/`` in an installed wheel): ``setup.sh``, ``stub/`` (the pure-torch ``sgl_kernel``
stand-in, prepended to the server's PYTHONPATH), ``tiny_llama/`` (config-only model for ``--load-format dummy``)
and ``compat/`` (the HiCache CPU compatibility layer, loaded by a .pth file inside the venv when
``REPRO_TESTBED_COMPAT=1``). This module never imports sglang or torch.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Optional

from repro import resources
from repro.targets.release_data import load_releases

# The release the testbed sets up and its torch pin: SGLang's release data (``repro/targets/sglang/releases/``:
# ``index.toml`` ``testbed_default``, that release's ``[cpu] torch``); setup.sh pins the same (a fast test checks it).
RELEASES_DIR = Path(__file__).resolve().parent / "releases"
_DATA = load_releases(RELEASES_DIR)
SGLANG_VERSION = _DATA.testbed_default
TORCH_VERSION = _DATA.releases[SGLANG_VERSION].cpu.torch  # type: ignore[union-attr]
TESTBED_DIR_ENV = "REPRO_TESTBED_DIR"
COMPAT_ENV = "REPRO_TESTBED_COMPAT"
COMPAT_DIR_ENV = "REPRO_TESTBED_COMPAT_DIR"
STAMP_NAME = ".setup-stamp"


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
    """The testbed's files: ``scripts/cpu_testbed`` in a clone, ``repro/_data/cpu_testbed`` when installed."""
    return resources.testbed_files_dir()


def tiny_model_dir() -> Path:
    """The config-only tiny Llama (hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 1024, float32)."""
    return cpu_testbed_dir() / "tiny_llama"


def stub_dir() -> Path:
    """Folder holding the ``sgl_kernel`` stand-in package: prepend it to the server's PYTHONPATH."""
    return cpu_testbed_dir() / "stub"


def compat_dir() -> Path:
    """Folder holding the HiCache CPU compatibility layer (``repro_testbed_compat``), loaded via a .pth file."""
    return cpu_testbed_dir() / "compat"


def setup_command() -> str:
    """The command a user runs to create the testbed (for error messages): ``bash scripts/cpu_testbed/setup.sh`` in a
    clone, the bundled ``setup.sh`` by its full path when installed."""
    if resources.is_checkout():
        return "bash scripts/cpu_testbed/setup.sh"
    return "bash " + shlex.quote(str(resources.setup_script()))
