"""Lockstep state probes as engine data: one TOML file per engine release in ``repro/targets/state_probes/``.

A file (``<engine>-<release>.toml``, e.g. ``sglang-0.5.23.toml``) names the release, the tick function whose
receiver the probes read, and ``[[probe]]`` tables ``{name, path, kind}``; the path syntax is the injector's
(``injectors/repro_injector/_digest.py``: attribute chains, ``m()``, ``len(path)``, ``path[*].attr``), checked
here with the same grammar before a plan carries it. ``kind``: ``lockstep`` (compared across the ranks of a TP
group), ``local`` (rank-local by design: recorded, never compared), ``info`` (sglang reconciles it: counts only).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

PROBES_DIR = Path(__file__).resolve().parent / "targets" / "state_probes"
_SEG = r"[A-Za-z_][A-Za-z0-9_]*(?:\(\))?"
# the injector's grammar (``_digest.PATH_RE``; the injector never imports the harness, so each keeps its copy)
PATH_RE = re.compile(rf"^(?P<len>len\()?(?P<head>{_SEG}(?:\.{_SEG})*)(?:\[\*\](?P<each>(?:\.[A-Za-z_][A-Za-z0-9_]*)+))?(?(len)\))$")


class ProbeFileError(ValueError):
    """A probe file that does not parse or validate (the message names the file, the probe and the fix)."""


class Probe(BaseModel):
    """One named probe on the tick function's receiver."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$")
    path: str
    kind: Literal["lockstep", "local", "info"] = "lockstep"

    @field_validator("path")
    @classmethod
    def _syntax(cls, v: str) -> str:
        m = PATH_RE.match(v.replace(" ", ""))
        if not m or (m.group("len") and m.group("each")):
            raise ValueError(f"{v!r}: expected attribute chains, zero-argument calls 'name()', 'len(path)' or "
                             "'path[*].attr' (never free Python)")
        return v


class ProbeSet(BaseModel):
    """One engine release's probe file."""

    model_config = ConfigDict(extra="forbid")
    engine: str
    release: str
    tick_function: str = ""
    probe: list[Probe] = Field(..., min_length=1)

    @field_validator("probe")
    @classmethod
    def _unique(cls, v: list[Probe]) -> list[Probe]:
        names = [p.name for p in v]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"probe names must be unique, repeated: {dup}")
        return v

    def to_plan(self) -> list[dict[str, str]]:
        """The plan's probe list for this release: ``[{"name", "path", "kind"}, ...]``."""
        return [p.model_dump() for p in self.probe]


def load_probe_file(path: Path) -> ProbeSet:
    """Read and validate one probe file.

    Raises:
        ProbeFileError: not TOML, or a field outside the schema (the message names the file and the field).
    """
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ProbeFileError(f"{path}: not a readable TOML probe file: {e}") from None
    try:
        return ProbeSet.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise ProbeFileError(f"{path}: {loc}: {first['msg']}; fix the probe file "
                             "(syntax in repro/state_probes.py)") from None


def probe_sets(engine: str, folder: Path = PROBES_DIR) -> dict[str, ProbeSet]:
    """release → ProbeSet for every ``<engine>-*.toml`` in ``folder`` (empty when there is none)."""
    out: dict[str, ProbeSet] = {}
    for f in sorted(folder.glob(f"{engine}-*.toml")):
        ps = load_probe_file(f)
        out[ps.release] = ps
    return out


def plan_probes(engine: str, package: Optional[str] = None, folder: Path = PROBES_DIR) -> Optional[dict[str, Any]]:
    """The plan's ``ledger.digest`` part for an engine: ``{"package", "releases": {release: [probe, ...]}}``; the
    injector picks the installed release's list. None when the engine has no probe file."""
    sets = probe_sets(engine, folder)
    if not sets:
        return None
    return {"package": package or engine, "releases": {r: ps.to_plan() for r, ps in sorted(sets.items())}}


def probe_kinds(plan: Optional[dict[str, Any]]) -> dict[str, str]:
    """probe name → kind over every release of a plan's ``ledger.digest`` (what the analysis compares)."""
    out: dict[str, str] = {}
    for probes in ((plan or {}).get("releases") or {}).values():
        for p in probes:
            out[str(p["name"])] = str(p.get("kind") or "lockstep")
    for p in (plan or {}).get("probes") or []:
        out[str(p["name"])] = str(p.get("kind") or "lockstep")
    return out


__all__ = ["Probe", "ProbeSet", "ProbeFileError", "load_probe_file", "probe_sets", "plan_probes", "probe_kinds",
           "PROBES_DIR"]
