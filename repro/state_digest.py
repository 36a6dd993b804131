"""The first divergent lockstep state: where the ranks' per-tick state digests first disagree.

The injector writes ``{"e": "state", "tick", "full", "v"}`` lines into each rank's ledger (format in
``injectors/repro_injector/_digest.py``): the probes' values at a scheduler tick's start, only those that changed
since that rank's previous tick, every probe at the first tick and at the start of every file part. The ranks of a
TP group tick in lockstep (one request broadcast per tick), so tick N is the same moment on every rank, and sglang
0.5.23 keeps the pools and in-flight sets equal at tick starts (DESIGN.md §11).

:func:`diagnose_state` rebuilds each rank's values tick by tick (forward fill from its first full digest) and
compares the ``lockstep`` probes at every tick where some rank recorded a change, from the latest first full
digest to the earliest last tick any rank reached (``compared`` range). The first tick at which two ranks differ
is the **first divergent state**: the probes that differ, each rank's value, and (from ``digest-<pid>.jsonl``)
the members only one rank holds. A probe that failed on any rank is skipped on every rank and named; ``local`` and
``info`` probes are listed, never compared. A ledger without state lines reads as "no digest recorded", never as
equal. It never changes a verdict or an exit code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from repro.evidence import Layout


class StateStatus:
    """What :func:`diagnose_state` found (strings, as written to verdict.json)."""

    NOT_RECORDED = "not_recorded"
    EQUAL = "equal"
    DIVERGED = "diverged"


@dataclass
class RankState:
    """One rank's state lines: ``lines`` = ``(tick, full, values)`` in file order; ``errors`` probe → error;
    ``last_tick``: the last tick this rank reached (its state lines and collective records); ``changes``: value
    changes after the first full digest."""

    rank: int
    pid: int
    lines: list[tuple[int, bool, dict[str, Any]]] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    last_tick: int = 0
    changes: int = 0
    members: dict[str, list[tuple[int, list[str]]]] = field(default_factory=dict)  # probe → (tick, members) ring
    kinds: dict[str, str] = field(default_factory=dict)  # probe → transient / local / info, as the injector wrote them
    tols: dict[str, float] = field(default_factory=dict)  # transient probe → tolerance, as the injector wrote it

    def values_at(self, tick: int) -> Optional[dict[str, Any]]:
        """Every probe's value at the start of ``tick`` (None before this rank's first full digest)."""
        vals: Optional[dict[str, Any]] = None
        for t, full, v in self.lines:
            if t > tick:
                break
            if full:
                vals = dict(v) if vals is None else {**vals, **v}
            elif vals is not None:
                vals.update(v)
        return vals

    def first_full(self) -> Optional[int]:
        return next((t for t, full, _ in self.lines if full), None)

    def members_at(self, probe: str, tick: int) -> Optional[list[str]]:
        got = None
        for t, m in self.members.get(probe, []):
            if t > tick:
                break
            got = m
        return got


def _read_lines(files: Sequence[str], tols: Optional[dict[str, float]] = None
                ) -> tuple[list[tuple[int, bool, dict]], dict[str, str], dict[str, str]]:
    lines: list[tuple[int, bool, dict]] = []
    errors: dict[str, str] = {}
    kinds: dict[str, str] = {}
    for f in files:
        try:
            text = Path(f).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        for raw in text.splitlines():
            if '"state' not in raw:  # cheap pre-filter (collective records never hold it)
                continue
            try:
                d = json.loads(raw)
            except ValueError:
                continue
            if d.get("e") == "state":
                kinds.update(d.get("kinds") or {})
                if tols is not None:
                    tols.update(d.get("tol") or {})
                lines.append((int(d.get("tick") or 0), bool(d.get("full")), dict(d.get("v") or {})))
            elif d.get("e") == "state_error":
                errors.setdefault(str(d.get("probe")), str(d.get("err")))
    return lines, errors, kinds


def _read_ring(folder: Path, pid: int) -> dict[str, list[tuple[int, list[str]]]]:
    out: dict[str, list[tuple[int, list[str]]]] = {}
    for name in (Layout.digest_file(pid, 1), Layout.digest_file(pid)):
        p = folder / name
        if not p.is_file():
            continue
        for raw in p.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                d = json.loads(raw)
                out.setdefault(str(d["probe"]), []).append((int(d["tick"]), list(d["members"])))
            except (ValueError, KeyError, TypeError):
                continue
    return out


def read_rank_states(ledgers: Mapping[int, Any]) -> dict[int, RankState]:
    """rank → RankState from ``repro.ledger.RankLedger`` objects (their ``files``, ``pid`` and records' ticks)."""
    out: dict[int, RankState] = {}
    for rank, led in sorted(ledgers.items()):
        tols: dict[str, float] = {}
        lines, errors, kinds = _read_lines(led.files, tols)
        rs = RankState(rank=int(rank), pid=int(led.pid), lines=lines, errors=errors, kinds=kinds, tols=tols)
        rs.last_tick = max([t for t, _, _ in lines] + [r.tick for r in led.records] + [0])
        first = rs.first_full()
        rs.changes = sum(len(v) for t, full, v in lines if not full and first is not None and t > first)
        if led.files:
            rs.members = _read_ring(Path(led.files[0]).parent, rs.pid)
        out[int(rank)] = rs
    return out


def _show(v: Any) -> str:
    if isinstance(v, list) and len(v) == 2:
        return f"{v[0]} (set {str(v[1])[:8]})"
    return "absent" if v is None else str(v)


@dataclass
class StateDivergence:
    """The state side of a run's diagnosis (see the module docstring).

    Attributes:
        status: :class:`StateStatus`; tick: the first divergent tick (None unless diverged); fields: probe →
        rank → value there; only: probe → rank → members only that rank holds (when the ring has them);
        compared: (first, last) tick compared; probes_compared / probes_local / probes_info: names; skipped:
        probe → why (failed on some rank); resolved: rank → probes with a value (not absent) at the last tick
        compared; changes: rank → value changes seen; ticks_before_collective: ticks from the first divergent
        state to the first divergent collective (None when no collective diverged).
    """

    status: str
    summary: str
    tick: Optional[int] = None
    fields: dict[str, dict[int, Any]] = field(default_factory=dict)
    only: dict[str, dict[int, list[str]]] = field(default_factory=dict)
    compared: Optional[tuple[int, int]] = None
    probes_compared: list[str] = field(default_factory=list)
    probes_local: list[str] = field(default_factory=list)
    probes_info: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    resolved: dict[int, list[str]] = field(default_factory=dict)
    changes: dict[int, int] = field(default_factory=dict)
    ticks_before_collective: Optional[int] = None
    probes_absent: list[str] = field(default_factory=list)  # probes with no value on any rank at any tick (a HiCache
    # or PD probe on a server without it): compared vacuously, so left out of the report's lists

    @property
    def diverged(self) -> bool:
        return self.status == StateStatus.DIVERGED

    def to_dict(self) -> dict:
        """verdict.json's ``state_divergence`` and ledger.json's ``state``."""
        return {"status": self.status, "summary": self.summary, "tick": self.tick,
                "fields": {p: {str(r): v for r, v in vs.items()} for p, vs in self.fields.items()},
                "only": {p: {str(r): m for r, m in vs.items()} for p, vs in self.only.items()},
                "compared_ticks": list(self.compared) if self.compared else None,
                "probes_compared": self.probes_compared, "probes_local": self.probes_local,
                "probes_info": self.probes_info, "skipped": self.skipped,
                "resolved": {str(r): v for r, v in self.resolved.items()},
                "changes": {str(r): n for r, n in self.changes.items()},
                "ticks_before_collective": self.ticks_before_collective, "probes_absent": self.probes_absent}

    def markdown_lines(self) -> list[str]:
        """The Diagnosis section's first lines: the sentence and, when diverged, one row per rank and probe."""
        out = [f"**First divergent state:** {self.summary}", ""]
        if self.diverged:
            ranks = sorted({r for vs in self.fields.values() for r in vs})
            out += ["| probe | " + " | ".join(f"rank {r}" for r in ranks) + " |",
                    "|---|" + "---|" * len(ranks)]
            for p, vs in self.fields.items():
                out.append(f"| `{p}` | " + " | ".join(_show(vs.get(r)) for r in ranks) + " |")
            out.append("")
            for p, vs in self.only.items():
                for r, m in vs.items():
                    out.append(f"- `{p}`: only rank {r} holds {', '.join(m[:10])}" + (" …" if len(m) > 10 else ""))
            if self.only:
                out.append("")
        if self.status != StateStatus.NOT_RECORDED:
            absent = set(self.probes_absent)
            compared = [p for p in self.probes_compared if p not in absent]
            local = [p for p in self.probes_local if p not in absent]
            info = [p for p in self.probes_info if p not in absent]
            out.append(f"State probes compared per rank: {', '.join(compared) or 'none'}"
                       + (f"; recorded, not compared (rank-local): {', '.join(local)}" if local else "")
                       + (f"; information (the engine reconciles): {', '.join(info)}" if info else "")
                       + (f"; {len(absent)} probe(s) with no value on this server (not listed)" if absent else "")
                       + (f"; skipped (failed on a rank): {', '.join(f'{k} ({v})' for k, v in self.skipped.items())}"
                          if self.skipped else "") + ".")
            out.append("")
        return out


def diagnose_state(ledgers: Mapping[int, Any], kinds: Optional[Mapping[str, str]] = None,
                   collective_tick: Optional[int] = None,
                   states: Optional[Mapping[int, RankState]] = None) -> StateDivergence:
    """Compare the ranks' state digests tick by tick (module docstring).

    Args:
        ledgers: rank → ``repro.ledger.RankLedger`` (one TP group).
        kinds: probe → ``lockstep`` / ``local`` / ``info`` over the kinds the ledgers' full digests name; a probe
            named by neither is lockstep.
        collective_tick: the tick of the first divergent collective (``repro.ledger.align``), for
            ``ticks_before_collective``.
        states: :func:`read_rank_states` of ``ledgers`` when the caller already read them (not read again).
    """
    states = dict(states) if states is not None else read_rank_states(ledgers)
    kinds = {**{k: v for s in states.values() for k, v in s.kinds.items()}, **dict(kinds or {})}
    recorded = {r: s for r, s in states.items() if s.first_full() is not None}
    if not recorded or len(recorded) < len(states) or len(states) < 2:
        why = ("no digest recorded (a ledger from before the state digest, or no probe file for this release)"
               if not recorded else
               f"no digest recorded on rank(s) {sorted(set(states) - set(recorded))}" if len(recorded) < len(states)
               else "one rank only: nothing to compare")
        return StateDivergence(status=StateStatus.NOT_RECORDED, summary=why)
    names: set[str] = set()
    for s in recorded.values():
        for _, _, v in s.lines:
            names.update(v)
    skipped: dict[str, str] = {}
    for r, s in sorted(recorded.items()):
        for p, err in s.errors.items():
            skipped.setdefault(p, f"rank {r}: {err}")
    present = {n for s in recorded.values() for _, _, v in s.lines for n, x in v.items() if x is not None}
    local = sorted(n for n in names if kinds.get(n) in ("local", "transient"))  # transient: repro.natural_effect
    info = sorted(n for n in names if kinds.get(n) == "info")
    compared = sorted(n for n in names if kinds.get(n, "lockstep") == "lockstep" and n not in skipped)
    start = max(s.first_full() or 0 for s in recorded.values())
    end = min(s.last_tick for s in recorded.values())
    ticks = sorted({t for s in recorded.values() for t, _, _ in s.lines if start <= t <= end} | {start})
    res = StateDivergence(status=StateStatus.EQUAL, summary="", compared=(start, end), probes_compared=compared,
                          probes_local=local, probes_info=info, skipped=skipped,
                          changes={r: s.changes for r, s in recorded.items()},
                          probes_absent=sorted(names - present))
    ranks = sorted(recorded)
    for t in ticks:
        vals = {r: recorded[r].values_at(t) or {} for r in ranks}
        diff = {p: {r: vals[r].get(p) for r in ranks} for p in compared
                if len({json.dumps(vals[r].get(p)) for r in ranks}) > 1}
        if diff:
            res.status, res.tick, res.fields = StateStatus.DIVERGED, t, diff
            for p in diff:
                mem = {r: recorded[r].members_at(p, t) for r in ranks}
                if all(m is not None for m in mem.values()):
                    sets = {r: set(m or []) for r, m in mem.items()}
                    only = {r: sorted(sets[r] - set().union(*(sets[o] for o in ranks if o != r))) for r in ranks}
                    only = {r: m for r, m in only.items() if m}
                    if only:
                        res.only[p] = only
            break
    res.resolved = {r: sorted(p for p, v in (recorded[r].values_at(end) or {}).items() if v is not None) for r in ranks}
    if res.diverged:
        if collective_tick is not None:
            res.ticks_before_collective = collective_tick - (res.tick or 0)
        parts = [f"`{p}` " + ", ".join(f"rank {r} = {_show(v)}" for r, v in vs.items()) for p, vs in res.fields.items()]
        when = (f"; {res.ticks_before_collective} tick(s) before the first divergent collective (tick {collective_tick})"
                if res.ticks_before_collective is not None
                else "; no divergent collective in the ledgers (a rank that aborted or died may not have recorded its last one)")
        res.summary = f"at scheduler tick {res.tick}: " + "; ".join(parts) + when + f" (ticks {start}–{end} compared)."
    else:
        res.summary = (f"none: the ranks' lockstep state agreed at every tick from {start} to {end} "
                       f"({len([p for p in compared if p in present])} probes compared; "
                       f"{sum(res.changes.values())} value changes recorded).")
    return res


__all__ = ["StateDivergence", "StateStatus", "RankState", "diagnose_state", "read_rank_states"]
