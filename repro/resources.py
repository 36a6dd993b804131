"""Where the harness finds its data files: the injector, the scenarios (with the hunt catalogue and the patches) and
the CPU testbed files, in a checkout and in an installed wheel alike.

Two layouts, one answer:

- **checkout** (``pip install -e .``, ``python -m repro`` in a clone): the folders at the top of the clone —
  ``injectors/``, ``scenarios/``, ``scripts/cpu_testbed/``. Recognised by ``<clone>/pyproject.toml`` next to
  ``<clone>/injectors/repro_injector/`` and ``<clone>/scenarios/``; the checkout always wins, so an editable install
  sees edits at once.
- **installed** (``pip install .`` or the wheel from ``python -m build``): the same three folders copied into the
  package at build time by ``setup.py`` (``build_py``) as ``repro/_data/injectors``, ``repro/_data/scenarios`` and
  ``repro/_data/cpu_testbed`` (plain copies: no symlinks, which setuptools does not follow reliably).

Paths a user types keep working in both: ``scenarios/sglang/smoke_extra_allreduce.toml`` from any folder, or the
bare name ``smoke_extra_allreduce`` (:func:`find_scenario`); ``patch:scenarios/sglang/patches/<file>.patch`` and
``--catalogue`` likewise (:func:`find_data_file`). Nothing here writes anywhere: commands write evidence under
``--evidence-dir`` (default ``evidence/`` in the current folder).

This module imports nothing outside the standard library but the default engine's name (``repro.targets``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from repro.targets import DEFAULT_ADAPTER

_PKG_DIR = Path(__file__).resolve().parent
_CLONE = _PKG_DIR.parent
_DATA = _PKG_DIR / "_data"

# name inside repro/_data  ->  folder of the checkout it is copied from (setup.py reads this table)
DATA_FOLDERS = {"injectors": "injectors", "scenarios": "scenarios", "cpu_testbed": "scripts/cpu_testbed",
                "vllm_testbed": "scripts/vllm_testbed"}
SCENARIO_SUFFIX = ".toml"
EXAMPLES_DIR = f"scenarios/{DEFAULT_ADAPTER}"  # the default engine's scenarios, catalogue and rules (help-text examples)
NOT_SCENARIOS = ("hunt_catalogue.toml", "natural_nemeses.toml", "hunt_workloads.toml", "discover_rules.toml",
                 "reproduce_rules.toml")  # catalogues, workloads and rules beside the scenarios: not runnable


class ResourceError(RuntimeError):
    """The installation has none of its data files (neither a checkout nor ``repro/_data``); the message says how
    to reinstall."""


def checkout_root() -> Optional[Path]:
    """The clone this ``repro`` package was imported from, or None when it runs from an installed wheel."""
    if (_CLONE / "pyproject.toml").is_file() and (_CLONE / "injectors" / "repro_injector").is_dir() \
            and (_CLONE / "scenarios").is_dir():
        return _CLONE
    return None


def is_checkout() -> bool:
    """True iff the data files come from a clone (see :func:`checkout_root`)."""
    return checkout_root() is not None


def _folder(name: str) -> Path:
    root = checkout_root()
    if root is not None:
        return root / DATA_FOLDERS[name]
    d = _DATA / name
    if not d.is_dir():
        raise ResourceError(
            f"{d} is missing: this installation of repro ({_PKG_DIR}) has no data files. Reinstall it from a clone "
            "with `pip install .` (or a wheel built by `python -m build`), or run it from the clone (`python -m repro`)")
    return d


def injectors_dir() -> Path:
    """Folder put first on every server process's PYTHONPATH: holds ``sitecustomize.py``, ``usercustomize.py``,
    ``_repro_entry.py`` and the ``repro_injector`` package (stdlib + torch only).

    Raises:
        ResourceError: no checkout and no ``repro/_data`` (a broken install).
    """
    return _folder("injectors")


def scenarios_dir() -> Path:
    """The scenario folder: ``sglang/*.toml``, ``sglang/hunt_catalogue.toml``, ``sglang/patches/*.patch``.

    Raises:
        ResourceError: as :func:`injectors_dir`.
    """
    return _folder("scenarios")


def testbed_files_dir() -> Path:
    """The CPU testbed's files: ``setup.sh``, ``stub/`` (the ``sgl_kernel`` stand-in), ``tiny_llama/`` (config-only
    model), ``compat/`` (HiCache CPU compatibility layer), ``README.md``.

    Raises:
        ResourceError: as :func:`injectors_dir`.
    """
    return _folder("cpu_testbed")


def engine_file(engine: str, name: str) -> Path:
    """``scenarios/<engine>/<name>`` of a clone, or the installed wheel's copy: an adapter's data file (its hunt
    catalogue, its demo scenario). Never raises: in a broken install the path does not exist and the caller's own
    "not found" error names it.

    Args:
        engine: the adapter's scenario folder (its registry name, e.g. the SGLang adapter's).
        name: file name inside it.
    """
    try:
        root = scenarios_dir()
    except ResourceError:
        root = _DATA / "scenarios"
    return root / engine / name


def setup_script() -> Path:
    """``setup.sh`` of the CPU testbed (run it with bash)."""
    return testbed_files_dir() / "setup.sh"


def scenario_names() -> list[str]:
    """Bare names of the bundled scenarios (file stems, sorted), e.g. ``smoke_extra_allreduce``."""
    try:
        root = scenarios_dir()
    except ResourceError:
        return []
    return sorted({p.stem for p in root.rglob("*" + SCENARIO_SUFFIX) if p.name not in NOT_SCENARIOS})


def _under_data(rel: Path) -> Optional[Path]:
    """``rel`` (relative, as typed in a clone: ``scenarios/...``, ``injectors/...``, ``scripts/cpu_testbed/...``)
    in this installation's data, or None."""
    parts = rel.parts
    if not parts:
        return None
    for name, src in DATA_FOLDERS.items():
        src_parts = Path(src).parts
        if parts[:len(src_parts)] == src_parts:
            try:
                cand = _folder(name).joinpath(*parts[len(src_parts):])
            except ResourceError:
                return None
            return cand if cand.exists() else None
    return None


def find_data_file(path: Union[str, Path]) -> Path:
    """Resolve a data file a user named (a patch, a catalogue, a scenario path) from any folder.

    Order: the path as given (relative to the current folder) if it exists; else, for a relative path written as in
    a clone (``scenarios/sglang/patches/x.patch``), the same file in this installation's data; else, for a bare
    file name, the one file of that name under the scenarios folder. Returns ``path`` unchanged when none exists,
    so the caller's own "not found" error names what the user typed.
    """
    p = Path(path).expanduser()
    if p.exists() or p.is_absolute():
        return p
    hit = _under_data(p)
    if hit is not None:
        return hit
    if len(p.parts) == 1:
        try:
            found = sorted(q for q in scenarios_dir().rglob(p.name) if q.is_file())
        except ResourceError:
            found = []
        if len(found) == 1:
            return found[0]
    return p


def find_scenario(text: Union[str, Path]) -> Path:
    """A scenario file from what a user typed: a path (as :func:`find_data_file` resolves it) or a bare name such as
    ``smoke_extra_allreduce`` (``.toml`` optional) of a bundled scenario.

    Returns:
        The file; or ``Path(text)`` unchanged when nothing matches (the scenario loader then says "not found").
    Raises:
        ResourceError: a bare name matches several bundled scenarios, none of them the default engine's
            (``scenarios/<repro.targets.DEFAULT_ADAPTER>/``, preferred) (the message lists them).
    """
    p = find_data_file(text)
    if p.exists() or p.is_absolute() or len(p.parts) != 1:
        return p
    name = p.name[:-len(SCENARIO_SUFFIX)] if p.name.endswith(SCENARIO_SUFFIX) else p.name
    try:
        found = sorted(q for q in scenarios_dir().rglob(name + SCENARIO_SUFFIX) if q.name not in NOT_SCENARIOS)
    except ResourceError:
        found = []
    if len(found) > 1:
        # the default engine's scenario keeps its bare name (``smoke_extra_allreduce`` is SGLang's; vLLM's twin is
        # scenarios/vllm/smoke_extra_allreduce.toml, named by path)
        default = [q for q in found if q.parent.name == DEFAULT_ADAPTER]
        if len(default) == 1:
            return default[0]
        raise ResourceError(f"scenario name {name!r} is ambiguous: " + ", ".join(str(q) for q in found) + "; pass a path")
    return found[0] if found else p


def describe() -> str:
    """One line for messages: where the data files come from."""
    root = checkout_root()
    return f"checkout {root}" if root is not None else f"installed package {_DATA}"
