"""Lockstep state probes: the schema of one probe and its path grammar; the probes themselves are engine data.

Each engine release's probes live in its release file (``repro/targets/<engine>/releases/<V>.toml``, ``[state]``:
``tick_function`` and ``[[state.probe]]`` tables ``{name, path, kind}``; loaded by ``repro.targets.release_data``). The
path syntax is the injector's (``injectors/repro_injector/_digest.py``: attribute chains, ``m()``, ``len(path)``,
``path[*].attr``, ``sum(path[*].attr)``), checked here with the same grammar before a plan carries it. ``kind``:
``lockstep`` (compared across the ranks of a TP group at every tick: a difference is a divergence), ``transient`` (a
rank-local *input to a reconciliation*, e.g. a queue length the engine MIN-reduces before acting on it: it may differ
between the ranks until the engine reconciles it; ``repro.natural_effect`` reports its episodes — moved on a rank,
equal again at tick N and the collective of tick N-1 — never a divergence or a verdict), ``local`` (rank-local by
design: recorded, never compared), ``info`` (the engine reconciles it: counts only).
"""

from __future__ import annotations

import re
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_SEG = r"[A-Za-z_][A-Za-z0-9_]*(?:\(\))?"
# the injector's grammar (``_digest.PATH_RE``; the injector never imports the harness, so each keeps its copy)
PATH_RE = re.compile(rf"^(?:(?P<fn>len|sum)\()?(?P<head>{_SEG}(?:\.{_SEG})*)(?:\[\*\](?P<each>(?:\.[A-Za-z_][A-Za-z0-9_]*)+))?(?(fn)\))$")


class Probe(BaseModel):
    """One named probe on the tick function's receiver."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$")
    path: str
    kind: Literal["lockstep", "transient", "local", "info"] = "lockstep"
    tolerance: float = Field(0.0, ge=0.0)  # transient numbers this close count as equal (e.g. per-rank clock readings)

    @field_validator("path")
    @classmethod
    def _syntax(cls, v: str) -> str:
        m = PATH_RE.match(v.replace(" ", ""))
        if not m or (m.group("fn") == "len" and m.group("each")) or (m.group("fn") == "sum" and not m.group("each")):
            raise ValueError(f"{v!r}: expected attribute chains, zero-argument calls 'name()', 'len(path)', "
                             "'path[*].attr' or 'sum(path[*].attr)' (never free Python)")
        return v

    @model_validator(mode="after")
    def _tolerance_only_for_transient(self) -> "Probe":
        if self.tolerance and self.kind != "transient":
            raise ValueError(f"probe {self.name!r}: tolerance = {self.tolerance} is for kind = \"transient\" only "
                             f"(got kind = {self.kind!r}); drop tolerance or set kind = \"transient\"")
        return self


class ProbeState(BaseModel):
    """A release file's ``[state]`` table: the tick function whose receiver the probes read, and the probes."""

    model_config = ConfigDict(extra="forbid")
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
        return [p.model_dump(exclude_defaults=True) | {"name": p.name, "path": p.path, "kind": p.kind} for p in self.probe]


class ProbeSet(ProbeState):
    """One engine release's probes, with the engine and the release named."""

    engine: str
    release: str


def probe_kinds(plan: Optional[dict[str, Any]]) -> dict[str, str]:
    """probe name → kind over every release of a plan's ``ledger.digest`` (what the analysis compares)."""
    out: dict[str, str] = {}
    for probes in ((plan or {}).get("releases") or {}).values():
        for p in probes:
            out[str(p["name"])] = str(p.get("kind") or "lockstep")
    for p in (plan or {}).get("probes") or []:
        out[str(p["name"])] = str(p.get("kind") or "lockstep")
    return out


__all__ = ["Probe", "ProbeState", "ProbeSet", "probe_kinds", "PATH_RE"]
