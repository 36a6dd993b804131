"""Per-release engine data: one home, one schema (``repro/targets/<engine>/releases/``; docs/adapters.md).

An adapter's ``releases_dir`` holds

- ``index.toml`` (optional): the engine's release index — ``engine``, ``index`` (the JSON index built from the
  wheels, read by ``repro.releases``), ``version_patterns`` (how a report names its release) and ``testbed_default``
  (the release the CPU testbed sets up when none is named);
- ``<V>.toml``, one per release the harness knows more about than the index says: ``engine``, ``release`` (= the file
  name's ``V``), ``read_from`` (where the facts were read), ``[cpu]`` (CPU compatibility: what the CPU testbed of that
  release needs — its setup recipe, torch pin, other pins, the stand-in kernel, the compat-layer items, extra
  packages), ``[sites]`` (site alternatives: a decision point's name → the ``module:Class.method`` names that exist
  *and run* in this release) and ``[state]`` (the lockstep-state probes: ``tick_function`` + ``[[state.probe]]``,
  grammar in ``repro.state_probes``).

Every file is validated by a pydantic model (unknown fields refused); an error is one line naming the file, the
field and what was expected (:class:`ReleaseDataError`). This module reads files only: it names no engine.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from repro.state_probes import ProbeSet, ProbeState

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

INDEX_NAME = "index.toml"
SITE_RE = re.compile(r"^[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")
_VERSION_RE = r"^[0-9][0-9A-Za-z.+-]*$"
_PIN_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]*(?:\[[\w,.-]+\])?\s*(?:==|>=|<=|~=|!=|<|>)\s*[0-9][\w.+!*-]*$"


class ReleaseDataError(ValueError):
    """A release data file that does not parse or validate; ``str()`` is one line naming the file, the field and the
    fix (the CLI exits 2 on it)."""


class CpuCompat(BaseModel):
    """``[cpu]``: what the CPU testbed of this release needs (CPU compatibility).

    Attributes:
        recipe: the setup recipe: ``scripts/<recipe>/setup.sh`` of a clone (``cpu_testbed``); "" = none yet.
        python: the base interpreter the recipe builds the venv with ("" = the recipe's default).
        torch: the torch pin of the testbed venv (``2.14.1``; a local build may carry ``+cpu``).
        pins: other pins of the release's wheel the venv keeps (``sglang-kernel==0.4.6.post1``).
        kernel_standin: folder (inside the recipe's files) of the stand-in for the engine's kernel package, put first
            on the server's PYTHONPATH ("" = the real package runs).
        compat: the compat-layer items the release needs (names of the recipe's compat layer, ``ITEMS`` there).
        packages: extra packages the recipe installs beside the engine (PD: Mooncake, the router), as pins.
        kind: ``venv`` (a venv of its own) or ``overlay`` (the release's own wheel over the venv of ``base``, a
            release with the same torch pin whose file says ``kind = "venv"``).
        base: the release an overlay runs on ("" for a venv).
        torch_build: ``cuda`` = the registry's torch build, never a local ``+cpu`` wheel of the same version
            (sglang imports torchvision, whose registry wheels need the registry's torch); "" = whichever pip picks.
        skip_deps: dependencies the release's wheel lists that the recipe leaves out (unreachable here and unused on
            CPU): the engine goes in with ``--no-deps``, then every other listed dependency.
    """

    model_config = ConfigDict(extra="forbid")
    recipe: str = Field("", pattern=r"^[A-Za-z0-9_-]*$")
    python: str = ""
    torch: str = Field(..., pattern=_VERSION_RE)
    pins: list[str] = Field(default_factory=list)
    kernel_standin: str = Field("", pattern=r"^[A-Za-z0-9_./-]*$")
    compat: list[str] = Field(default_factory=list)
    packages: list[str] = Field(default_factory=list)
    kind: Literal["venv", "overlay"] = "venv"
    base: str = Field("", pattern=r"^$|" + _VERSION_RE)
    torch_build: Literal["", "cuda"] = ""
    skip_deps: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _overlay_base(self) -> "CpuCompat":
        if (self.kind == "overlay") != bool(self.base):
            raise ValueError('kind = "overlay" needs base = "<release with its own venv>" (and only an overlay has one)')
        return self

    @field_validator("pins", "packages")
    @classmethod
    def _pins(cls, v: list[str]) -> list[str]:
        bad = [p for p in v if not re.match(_PIN_RE, p)]
        if bad:
            raise ValueError(f"{bad}: expected pip pins 'name==version'")
        return v

    @field_validator("compat")
    @classmethod
    def _items(cls, v: list[str]) -> list[str]:
        bad = [p for p in v if not re.match(r"^[a-z][a-z0-9_]*$", p)]
        if bad or len(set(v)) != len(v):
            raise ValueError(f"{v}: expected distinct item names (lower_case_with_underscores)")
        return v


class ReleaseFile(BaseModel):
    """One ``<V>.toml``: everything engine-specific the harness knows about release ``V`` beyond the index."""

    model_config = ConfigDict(extra="forbid")
    engine: str = Field(..., min_length=1)
    release: str = Field(..., pattern=_VERSION_RE)
    read_from: str = ""
    cpu: Optional[CpuCompat] = None
    sites: dict[str, list[str]] = Field(default_factory=dict)
    state: Optional[ProbeState] = None

    @field_validator("sites")
    @classmethod
    def _sites(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        for name, alts in v.items():
            bad = [a for a in alts if not SITE_RE.match(a)]
            if not alts or bad:
                raise ValueError(f"{name}: expected a non-empty list of 'module:Class.method' names, got {alts!r}")
        return v


class IndexFile(BaseModel):
    """``index.toml``: the engine's release index and how reports name a release."""

    model_config = ConfigDict(extra="forbid")
    engine: str = Field(..., min_length=1)
    index: str = ""
    version_patterns: list[str] = Field(default_factory=list)
    testbed_default: str = Field("", pattern=r"^$|" + _VERSION_RE)

    @field_validator("version_patterns")
    @classmethod
    def _patterns(cls, v: list[str]) -> list[str]:
        for p in v:
            try:
                rx = re.compile(p)
            except re.error as e:
                raise ValueError(f"{p!r} is no regular expression: {e}") from None
            if rx.groups < 1:
                raise ValueError(f"{p!r}: expected one group (the version)")
        return v


@dataclass(frozen=True)
class EngineReleases:
    """Everything in one engine's ``releases_dir``.

    Attributes:
        engine: the engine's name (``index.toml``'s, else the release files').
        folder: the folder read.
        index_json: the JSON release index (None: the engine has none).
        version_patterns: regexes whose first group is a version a report names.
        testbed_default: the release the CPU testbed sets up when none is named ("" = not said).
        releases: version → :class:`ReleaseFile`.
    """

    engine: str
    folder: Path
    index_json: Optional[Path] = None
    version_patterns: tuple[str, ...] = ()
    testbed_default: str = ""
    releases: dict[str, ReleaseFile] = field(default_factory=dict)

    def get(self, version: str) -> Optional[ReleaseFile]:
        """Release ``version``'s data, or None when there is no ``<version>.toml``."""
        return self.releases.get(version)

    def recipes(self) -> dict[str, str]:
        """version → setup recipe, for the releases whose ``[cpu]`` names one."""
        return {v: r.cpu.recipe for v, r in sorted(self.releases.items()) if r.cpu is not None and r.cpu.recipe}

    def probe_sets(self) -> dict[str, ProbeSet]:
        """version → :class:`~repro.state_probes.ProbeSet` for every release with a ``[state]`` table."""
        return {v: ProbeSet(engine=r.engine, release=v, tick_function=r.state.tick_function, probe=r.state.probe)
                for v, r in sorted(self.releases.items()) if r.state is not None}

    def plan_probes(self, package: Optional[str] = None) -> Optional[dict[str, Any]]:
        """The plan's ``ledger.digest`` part: ``{"package", "releases": {release: [probe, ...]}}`` (the injector picks
        the installed release's list); None when no release has probes."""
        sets = self.probe_sets()
        if not sets:
            return None
        return {"package": package or self.engine, "releases": {r: ps.to_plan() for r, ps in sets.items()}}


def _read(path: Path, model: type[BaseModel]) -> BaseModel:
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ReleaseDataError(f"{path}: not a readable TOML file: {e}") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"]) or "(top level)"
        raise ReleaseDataError(f"{path}: {loc}: {first['msg']}; fix the file (schema: docs/adapters.md, "
                               "'Per-release data')") from None


def load_release_file(path: Path) -> ReleaseFile:
    """Read and validate one ``<V>.toml``.

    Raises:
        ReleaseDataError: unreadable, a field outside the schema, or ``release`` is not the file name's version.
    """
    rf = _read(path, ReleaseFile)
    assert isinstance(rf, ReleaseFile)
    if rf.release != Path(path).stem:
        raise ReleaseDataError(f"{path}: release: {rf.release!r} is not the file's version {Path(path).stem!r}; "
                               "name the file <release>.toml")
    return rf


@lru_cache(maxsize=16)
def _load(folder: str, stamp: tuple) -> EngineReleases:
    d = Path(folder)
    idx: Optional[IndexFile] = None
    if (d / INDEX_NAME).is_file():
        got = _read(d / INDEX_NAME, IndexFile)
        assert isinstance(got, IndexFile)
        idx = got
    rels: dict[str, ReleaseFile] = {}
    for f in sorted(d.glob("[0-9]*.toml")):
        rf = load_release_file(f)
        engine = idx.engine if idx else next(iter(rels.values())).engine if rels else rf.engine
        if rf.engine != engine:
            raise ReleaseDataError(f"{f}: engine: {rf.engine!r} is not this folder's engine {engine!r}")
        rels[rf.release] = rf
    if idx is None and not rels:
        raise ReleaseDataError(f"{d}: no {INDEX_NAME} and no <release>.toml; an adapter's releases_dir holds them "
                               "(docs/adapters.md, 'Per-release data')")
    engine = idx.engine if idx else next(iter(rels.values())).engine
    index_json = None
    if idx is not None and idx.index:
        index_json = d / idx.index
        if not index_json.is_file():
            raise ReleaseDataError(f"{d / INDEX_NAME}: index: {idx.index!r} is not a file in {d}")
    for v, r in rels.items():
        if r.cpu is not None and r.cpu.kind == "overlay":
            b = rels.get(r.cpu.base)
            if b is None or b.cpu is None or b.cpu.kind != "venv" or not b.cpu.recipe:
                raise ReleaseDataError(f"{d / (v + '.toml')}: cpu.base: {r.cpu.base!r} is no release of this folder "
                                       'with its own venv recipe (kind = "venv", recipe set)')
    if idx is not None and idx.testbed_default and idx.testbed_default not in rels:
        raise ReleaseDataError(f"{d / INDEX_NAME}: testbed_default: {idx.testbed_default!r} has no "
                               f"{idx.testbed_default}.toml in {d}")
    return EngineReleases(engine, d, index_json, tuple(idx.version_patterns) if idx else (),
                          idx.testbed_default if idx else "", rels)


def load_releases(folder: Path) -> EngineReleases:
    """Read and validate an engine's ``releases_dir`` (cached until a file in it changes).

    Raises:
        ReleaseDataError: a file fails its schema, or the folder holds no release data.
    """
    d = Path(folder)
    try:
        stamp = tuple(sorted((p.name, p.stat().st_mtime_ns) for p in d.glob("*.toml")))
    except OSError:
        stamp = ()
    return _load(str(d.resolve()), stamp)


def adapter_releases(adapter: Any) -> Optional[EngineReleases]:
    """The release data of ``adapter`` (its ``releases_dir``), or None when it declares none.

    Raises:
        ReleaseDataError: as :func:`load_releases`.
    """
    d = getattr(adapter, "releases_dir", None)
    if d is None or not Path(d).is_dir():
        return None
    return load_releases(Path(d))


__all__ = ["ReleaseDataError", "CpuCompat", "ReleaseFile", "IndexFile", "EngineReleases",
           "load_release_file", "load_releases", "adapter_releases", "INDEX_NAME", "SITE_RE"]
