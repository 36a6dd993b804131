"""The engine's own dumps compared across ranks: which figures differ, with every rank's value.

A production report often has no Python stack (py-spy refused: no ``SYS_PTRACE`` in the container) but does have
the engine's per-rank state dumps in its log: SGLang's soft-watchdog ``Scheduler debug info`` blocks, its rank
consensus checker's "Found rank divergence" line, its idle "memory leak detected!" error. In a TP group every rank
runs a replica of the scheduler on the same broadcast inputs, so at a hang their batches, requests and pool figures
should be equal (DESIGN.md §11); a figure that differs between ranks is the hint to the cause. Records come from
:func:`repro.readers.engine_records.read_engine_records` with the adapters' patterns; this module compares them:
each rank's last block (the state it is stuck in), figure by figure; member lists as sets (the ids only one rank
holds). Events are listed by name with their ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

from repro.evidence import Layout
from repro.readers.engine_records import EngineReadResult, EngineRecord, read_engine_records

MAX_FILE_BYTES = 512 * 1024 * 1024  # a log above this is not read for engine dumps (named in a warning)


@dataclass
class FigureDiff:
    """One figure whose value differs between ranks: ``values`` rank label → value (``"absent"`` when a rank's
    block lacks it); ``only`` rank label → members only that rank holds (member lists)."""

    figure: str
    values: dict[str, str]
    only: dict[str, list[str]] = field(default_factory=dict)

    def sentence(self) -> str:
        s = f"`{self.figure}` " + ", ".join(f"{lab} = {v}" for lab, v in self.values.items())
        for lab, m in self.only.items():
            s += f" ({lab} alone holds {', '.join(m[:5])}{' …' if len(m) > 5 else ''})"
        return s


@dataclass
class EngineDumpReport:
    """The engine's own dumps of one analysis.

    Attributes:
        records: every record read (file order per source).
        last_blocks: rank label → that rank's last block (the state compared).
        blocks_per_rank: rank label → how many blocks it printed.
        diffs: the figures that differ between the ranks' last blocks (empty: equal, or fewer than 2 ranks).
        events: the one-line events (consensus checker, leak errors).
        warnings: what could not be read (file too large, records not kept).
    """

    records: list[EngineRecord] = field(default_factory=list)
    last_blocks: dict[str, EngineRecord] = field(default_factory=dict)
    blocks_per_rank: dict[str, int] = field(default_factory=dict)
    diffs: list[FigureDiff] = field(default_factory=list)
    events: list[EngineRecord] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def diverged(self) -> bool:
        return bool(self.diffs)

    @property
    def summary(self) -> str:
        """One sentence: what the engine's dumps say across ranks."""
        parts = []
        if self.last_blocks:
            engine = next(iter(self.last_blocks.values())).engine
            name = next(iter(self.last_blocks.values())).name
            ranks = ", ".join(self.last_blocks)
            counts = ", ".join(f"{lab}: {n}" for lab, n in self.blocks_per_rank.items())
            head = f"{engine} '{name}' blocks of {ranks} ({counts}; the last of each compared)"
            if len(self.last_blocks) < 2:
                parts.append(head + ": one rank only, nothing to compare")
            elif self.diffs:
                parts.append(head + ": the ranks differ in " + "; ".join(d.sentence() for d in self.diffs))
            else:
                n = len({f for b in self.last_blocks.values() for f in b.figures})
                parts.append(head + f": every figure equal across ranks ({n} compared)")
        by_kind: dict[str, list[EngineRecord]] = {}
        for e in self.events:
            by_kind.setdefault(e.name, []).append(e)
        for name, evs in by_kind.items():
            labs = sorted({e.rank_label or "no rank prefix" for e in evs})
            extra = ""
            hashes = {e.rank_label: e.figures.get("hash") for e in evs if e.figures.get("hash")}
            if len(set(hashes.values())) > 1:
                extra = " (local hashes " + ", ".join(f"{k} = {v[:12]}" for k, v in hashes.items()) + ")"
            pools = sorted({e.figures.get("pool", "") for e in evs} - {""})
            if pools and "leak" in e.kind:
                extra += " (" + ", ".join(pools) + ")"
            parts.append(f"{name} on {', '.join(labs)}{extra}, line {evs[0].line}")
        return "Engine's own dumps: " + ("; ".join(parts) if parts else "none found") + "."

    def to_dict(self) -> dict[str, Any]:
        """analysis JSON's ``engine_dumps``."""
        return {"summary": self.summary, "diverged": self.diverged,
                "blocks_per_rank": self.blocks_per_rank,
                "last_blocks": {lab: {"rank": b.rank, "line": b.line, "time": b.time, "source": b.source,
                                      "figures": b.figures, "members": {k: list(v) for k, v in b.members.items()}}
                                for lab, b in self.last_blocks.items()},
                "differing_figures": [{"figure": d.figure, "values": d.values, "only": d.only} for d in self.diffs],
                "events": [{"kind": e.kind, "name": e.name, "rank": e.rank, "rank_label": e.rank_label,
                            "figures": e.figures, "line": e.line, "time": e.time, "source": e.source}
                           for e in self.events],
                "warnings": self.warnings}

    def markdown_lines(self) -> list[str]:
        """A Diagnosis paragraph: the sentence, then one row per figure and rank when blocks were compared."""
        out = [f"**{self.summary}**", ""]
        if len(self.last_blocks) >= 2:
            labs = list(self.last_blocks)
            figs = list(dict.fromkeys(f for b in self.last_blocks.values() for f in b.figures))
            diff = {d.figure for d in self.diffs}
            out += ["| figure | " + " | ".join(labs) + " |", "|---|" + "---|" * len(labs)]
            for f in figs:
                cells = [self.last_blocks[lab].figures.get(f, "absent") for lab in labs]
                out.append(f"| {'**' if f in diff else ''}`{f}`{'**' if f in diff else ''} | " + " | ".join(cells) + " |")
            out.append("")
        return out


def compare_records(records: Sequence[EngineRecord]) -> EngineDumpReport:
    """Compare the ranks' last blocks figure by figure (module docstring).

    Args:
        records: from :func:`repro.readers.engine_records.read_engine_records` (several sources may be mixed:
            one file per rank is the same as one log with every rank).
    Returns:
        An :class:`EngineDumpReport`; a block without a rank prefix is kept under ``""`` and compared like a rank.
    """
    rep = EngineDumpReport(records=list(records))
    for r in records:
        if r.kind == "block":
            lab = r.rank_label or (f"rank {r.rank}" if r.rank is not None else "no rank prefix")
            rep.last_blocks[lab] = r
            rep.blocks_per_rank[lab] = rep.blocks_per_rank.get(lab, 0) + 1
        else:
            rep.events.append(r)
    rep.last_blocks = dict(sorted(rep.last_blocks.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank, kv[0])))
    rep.blocks_per_rank = {lab: rep.blocks_per_rank[lab] for lab in rep.last_blocks}
    if len(rep.last_blocks) < 2:
        return rep
    labs = list(rep.last_blocks)
    figs = list(dict.fromkeys(f for b in rep.last_blocks.values() for f in b.figures))
    for f in figs:
        vals = {lab: rep.last_blocks[lab].figures.get(f, "absent") for lab in labs}
        if len(set(vals.values())) > 1:
            rep.diffs.append(FigureDiff(figure=f, values=vals))
    for m in dict.fromkeys(k for b in rep.last_blocks.values() for k in b.members):
        sets = {lab: set(rep.last_blocks[lab].members.get(m, ())) for lab in labs}
        only = {lab: sorted(s - set().union(*(sets[o] for o in labs if o != lab))) for lab, s in sets.items()}
        only = {lab: v for lab, v in only.items() if v}
        if only:
            key = f"{m} (count)"
            d = next((d for d in rep.diffs if d.figure == key), None)
            if d is None:
                d = FigureDiff(figure=f"{m} (ids)", values={lab: str(len(sets[lab])) for lab in labs})
                rep.diffs.append(d)
            d.only = only
    return rep


def _files(paths: Iterable[Union[str, Path]]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            out += sorted(x for x in p.iterdir() if x.is_file() and (x.name == Layout.SERVER_LOG.name or x.suffix == ".log"))
    return list(dict.fromkeys(out))


def read_engine_dumps(paths: Iterable[Union[str, Path]], rules: Optional[Sequence[object]] = None) -> Optional[EngineDumpReport]:
    """Read and compare the engine's own dumps in ``paths`` (files; a folder's ``server.log`` and ``*.log``).

    Args:
        paths: what ``repro analyze`` was given.
        rules: the engines' patterns (default: every registered adapter's, ``repro.targets.registry``).
    Returns:
        The report, or None when no file holds an engine dump record.
    """
    if rules is None:
        from repro.targets.registry import engine_dump_rules_all

        rules = engine_dump_rules_all()
    if not rules:
        return None
    records: list[EngineRecord] = []
    warnings: list[str] = []
    for f in _files(paths):
        try:
            if f.stat().st_size > MAX_FILE_BYTES:
                warnings.append(f"{f}: larger than {MAX_FILE_BYTES // (1024 * 1024)} MB, not read for engine dumps")
                continue
            with open(f, encoding="utf-8", errors="replace") as fh:
                res: EngineReadResult = read_engine_records(fh, rules, source=f.name)
        except OSError as e:
            warnings.append(f"{f}: not readable ({e.strerror})")
            continue
        records += res.records
        if res.dropped:
            warnings.append(f"{f.name}: {res.dropped} engine dump record(s) beyond the first {len(res.records)} not read")
    if not records:
        return None
    rep = compare_records(records)
    rep.warnings = warnings
    return rep


__all__ = ["EngineDumpReport", "FigureDiff", "compare_records", "read_engine_dumps"]
