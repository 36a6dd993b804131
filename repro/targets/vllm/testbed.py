"""Where the vLLM CPU testbed lives (set up by ``scripts/vllm_testbed/setup.sh``), and the files a vLLM server
leaves behind.

Layout: ``$REPRO_VLLM_TESTBED_DIR`` or ``~/.cache/tp-deadlock-repro/testbed/vllm-<VLLM_VERSION>/`` (``$XDG_CACHE_HOME``
replaces ``~/.cache``), holding ``venv/bin/python`` and ``.setup-stamp`` (written after the import check passed).
The tiny model (``config.json`` only, dummy weights) is ``scripts/vllm_testbed/tiny_llama`` in a clone
(``repro/_data/vllm_testbed/tiny_llama`` in a wheel). Never imports vllm or torch. See docs/vllm.md.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Iterable, Optional

from repro import resources
from repro.targets.release_data import load_releases

# the release the testbed sets up: vLLM's release data (releases/index.toml testbed_default; setup.sh pins the same)
VLLM_VERSION = load_releases(Path(__file__).resolve().parent / "releases").testbed_default
TESTBED_DIR_ENV = "REPRO_VLLM_TESTBED_DIR"
STAMP_NAME = ".setup-stamp"

# vLLM 0.32.0 (vllm/distributed/parallel_state.py, the CPU platform's multiproc executor): the workers rendezvous
# through a file store; the log line carries it: ``distributed_init_method=file:///tmp/vllm_dist_<id>``. The CPU
# communicator's shared-memory segments are named after the same id: ``/dev/shm/vllm_dist_<id>-…-cpushm_*``.
_INIT_RE = re.compile(r"file://(/[\w./-]*?/vllm_dist_([0-9a-f]{8,64}))(?![0-9a-f])")
_SHM_DIR = Path("/dev/shm")


def testbed_dir() -> Path:
    """The vLLM testbed folder (may not exist yet): ``$REPRO_VLLM_TESTBED_DIR`` or the per-user cache folder."""
    env = os.environ.get(TESTBED_DIR_ENV)
    if env:
        return Path(env).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "tp-deadlock-repro" / "testbed" / f"vllm-{VLLM_VERSION}"


def testbed_python() -> Optional[Path]:
    """``<testbed dir>/venv/bin/python`` if that file exists, else None (existence only; see :func:`is_set_up`)."""
    py = testbed_dir() / "venv" / "bin" / "python"
    return py if py.exists() else None


def is_set_up() -> bool:
    """True iff the testbed's python exists and setup.sh wrote its stamp (the import check passed)."""
    return testbed_python() is not None and (testbed_dir() / STAMP_NAME).is_file()


def files_dir() -> Path:
    """``scripts/vllm_testbed`` in a clone, ``repro/_data/vllm_testbed`` when installed."""
    return resources._folder("vllm_testbed")


def tiny_model_dir() -> Path:
    """The config-only tiny Llama vLLM's CPU attention accepts (hidden 128, head_dim 32, 4 heads, 2 KV heads, 2
    layers, vocab 1024, float32): CPU attention takes head sizes 32, 64, 80, … only."""
    return files_dir() / "tiny_llama"


def setup_command() -> str:
    """The command that creates the testbed (for error messages)."""
    if resources.is_checkout():
        return "bash scripts/vllm_testbed/setup.sh"
    return "bash " + shlex.quote(str(files_dir() / "setup.sh"))


def dist_ids(log_text: str) -> list[str]:
    """The ``vllm_dist_<id>`` ids a server's log names (its ``distributed_init_method=file://…`` lines), in order."""
    out: list[str] = []
    for m in _INIT_RE.finditer(log_text or ""):
        if m.group(2) not in out:
            out.append(m.group(2))
    return out


_SHM_OFF_RE = re.compile(r"CPU SHM communicator disabled for group (\S+):")


def shm_disabled_groups(log_text: str) -> list[str]:
    """The groups (``tp:0``, ``pp:0``, …) whose CPU shared-memory communicator vLLM turned off, in log order.

    Mirrors vllm 0.32.0 ``vllm/distributed/device_communicators/cpu_communicator.py`` (``CpuCommunicator.__init__``):
    it logs "CPU SHM communicator disabled for group <name>: …" and falls back to ``torch.distributed`` (gloo) when
    the loaded kernel library lacks ``torch.ops._C.init_shm_manager`` — the AVX2 build (``vllm/_C_AVX2``) on a CPU
    without AVX-512 has none — or when the group's ranks disagree on the shm group name. In such a group a rank
    waiting for a peer's all_reduce sits idle in gloo instead of spinning hot in ``shm_allreduce``.
    """
    out: list[str] = []
    for m in _SHM_OFF_RE.finditer(log_text or ""):
        if m.group(1) not in out:
            out.append(m.group(1))
    return out


def dist_files(log_text: str, shm_dir: Path = _SHM_DIR, tmp_dirs: Iterable[Path] = ()) -> list[Path]:
    """The file store and shared-memory segments of the servers whose log is ``log_text`` (that exist now).

    Only files named after an id the log names: ``<dir of the file store>/vllm_dist_<id>`` (the path in the log
    line, plus the same name in ``tmp_dirs``) and ``<shm_dir>/vllm_dist_<id>-*``; never another server's.
    """
    found: list[Path] = []
    for m in _INIT_RE.finditer(log_text or ""):
        store, ident = Path(m.group(1)), m.group(2)
        cands = [store, *(Path(d) / store.name for d in tmp_dirs)]
        if shm_dir.is_dir():
            cands += sorted(shm_dir.glob(f"vllm_dist_{ident}-*"))
            cands += [shm_dir / f"vllm_dist_{ident}"]
        for p in cands:
            if (p.is_file() or p.is_symlink()) and p not in found:
                found.append(p)
    return found


def remove_dist_files(log_path: Path, shm_dir: Path = _SHM_DIR) -> list[str]:
    """Remove :func:`dist_files` of the server that wrote ``log_path``; returns the removed paths (missing log: [])."""
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return []
    removed = []
    for p in dist_files(text, shm_dir):
        try:
            p.unlink()
            removed.append(str(p))
        except OSError:
            pass
    return removed
