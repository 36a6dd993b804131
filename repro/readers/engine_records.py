"""Reader of an engine's own state dumps in its log: per-rank records, with no Python stack needed.

What the lines look like is the adapter's data (:class:`repro.targets.base.EngineDumpRules`; SGLang's in
``repro/targets/sglang/dumps.py``); this module names no engine. Two shapes:

- a **block**: a header line whose log prefix names the rank (``[<time> TP1] Scheduler debug info:``; the prefix is
  read by :func:`repro.readers.prefixes.clean_line`, as for stack dumps), then figure lines without a prefix until a
  line that is none of the block's figure lines. Blocks of several ranks may alternate in one log (each is one
  record of its rank's logger, so a block ends at the first line that is none of its figure lines).
- an **event**: one line, its rank in its prefix (a checker's "found rank divergence", a leak error).

Figures are strings as printed (``"4080"``), named ``[group] key`` for ``key=value`` lines (``[full] available``)
or by their figure group (``batch_size()``); a list of members (``reqs=[Req(rid=…), …]``) is kept as its ids.
Reading never raises on bad content; at most :data:`MAX_RECORDS` records are kept per source (the rest counted).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from repro.readers.prefixes import clean_line

MAX_RECORDS = 4096  # records kept per source (a soft watchdog dumps every timeout for as long as a hang lasts)
_TIME_RE = re.compile(r"\[(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?)")
_PAIR_RE = re.compile(r"(\w+)=([^,]*?)(?=,\s*\w+=|\s*$)")


@dataclass(frozen=True)
class EngineRecord:
    """One per-rank record of the engine's own dump.

    Attributes:
        kind: ``block`` (a multi-line state block) or the event's kind from the rules (``consensus_divergence``).
        name: the block's name (``Scheduler debug info``) or the event's label for people.
        rank: the rank its log prefix names (TP rank for SGLang), None when the line has no rank prefix.
        rank_label: the prefix's label (``TP1``), ``""`` when none; ranks are told apart by it.
        figures: figure name → value as printed (``{"[full] available": "4080", "batch_size()": "2"}``).
        members: figure name → ids of a member list (``{"reqs": ("a1", "b2")}``).
        engine: the rules' engine (``sglang 0.5.23``). source: file name. line: 1-based header / event line.
        time: the log prefix's timestamp, ``""`` when none.
    """

    kind: str
    name: str
    rank: Optional[int]
    rank_label: str
    figures: dict[str, str] = field(default_factory=dict)
    members: dict[str, tuple[str, ...]] = field(default_factory=dict)
    engine: str = ""
    source: str = ""
    line: int = 0
    time: str = ""


@dataclass
class _Compiled:
    rules: object
    header: re.Pattern
    figures: list[tuple[str, re.Pattern]]
    member: Optional[re.Pattern]
    events: list[tuple[str, str, re.Pattern]]
    timeout: Optional[re.Pattern]
    gate: tuple[str, ...]


def _compile(rules: object) -> _Compiled:
    r = rules
    return _Compiled(rules=r, header=re.compile(r.block_header) if r.block_header else re.compile(r"(?!)"),
                     figures=[(g, re.compile(p)) for g, p in r.block_figures],
                     member=re.compile(r.member_id) if r.member_id else None,
                     events=[(k, lab, re.compile(p)) for k, lab, p in r.events],
                     timeout=re.compile(r.timeout_line) if r.timeout_line else None,
                     gate=tuple(r.gate_substrings))


def _figures(group: str, m: re.Match, member: Optional[re.Pattern]) -> tuple[dict[str, str], dict[str, tuple]]:
    d = m.groupdict()
    figs: dict[str, str] = {}
    mems: dict[str, tuple] = {}
    grp = d.get("group") or d.get("pool") or group
    if d.get("pairs"):
        for k, v in _PAIR_RE.findall(d["pairs"]):
            figs[f"[{grp}] {k}"] = v.strip()
    elif d.get("members") is not None and member is not None:
        ids = tuple(member.findall(d["members"]))
        mems[grp] = ids
        figs[f"{grp} (count)"] = str(len(ids))
    elif d.get("value") is not None:
        figs[grp] = d["value"].strip()
    for k, v in d.items():  # an event's other named groups (hash, events, pool)
        if k not in ("pairs", "members", "value", "group") and v is not None:
            figs[k] = v
    return figs, mems


@dataclass
class EngineReadResult:
    """What one source held: its records (file order), how many records were not kept, and the engine's
    watchdog-timeout lines per rank label."""

    records: list[EngineRecord] = field(default_factory=list)
    dropped: int = 0
    timeouts: dict[str, int] = field(default_factory=dict)


def read_engine_records(lines: Iterable[str], rules: Sequence[object], source: str = "") -> EngineReadResult:
    """Read an engine log's own state dumps into per-rank records.

    Args:
        lines: the log's lines (a file object is fine: read one at a time).
        rules: the adapters' :class:`~repro.targets.base.EngineDumpRules` (``repro.targets.registry.
            engine_dump_rules_all()``).
        source: the file name, kept in each record.
    Returns:
        An :class:`EngineReadResult`; empty when no line is an engine dump.
    """
    comp = [_compile(r) for r in rules]
    subs = tuple(dict.fromkeys(s for c in comp for s in c.gate))
    gate_re = re.compile("|".join(re.escape(x) for x in subs)) if subs else re.compile(r"(?!)")
    out = EngineReadResult()
    blk: Optional[dict] = None  # the block being read (records are one write each: at most one is open)

    def keep(rec: EngineRecord) -> None:
        if len(out.records) >= MAX_RECORDS:
            out.dropped += 1
        else:
            out.records.append(rec)

    def close() -> None:
        nonlocal blk
        if blk is not None:
            keep(EngineRecord(kind="block", name=blk["name"], rank=blk["rank"], rank_label=blk["label"],
                              figures=blk["figures"], members=blk["members"], engine=blk["engine"], source=source,
                              line=blk["line"], time=blk["time"]))
        blk = None

    for n, raw in enumerate(lines, 1):
        if blk is None and not gate_re.search(raw):
            continue
        c = clean_line(raw)
        text = c.text.strip()
        if blk is not None:
            m = None
            for group, pat in (blk["comp"].figures if text else ()):
                m = pat.match(text)
                if m:
                    figs, mems = _figures(group, m, blk["comp"].member)
                    blk["figures"].update(figs)
                    blk["members"].update(mems)
                    break
            if m:
                continue
            close()  # a line that is no figure line ends the block (it is one write of its rank's logger)
            if not gate_re.search(raw):
                continue
        tm = _TIME_RE.search(raw)
        when = tm.group(1) if tm else ""
        label = c.label if c.rank_hint is not None else ""
        for cp in comp:
            m = cp.header.match(text)
            if m:
                blk = {"name": m.groupdict().get("name") or "state block", "rank": c.rank_hint, "label": label,
                       "figures": {}, "members": {}, "line": n, "time": when, "engine": cp.rules.engine, "comp": cp}
                break
            if cp.timeout is not None and cp.timeout.match(text):
                out.timeouts[label] = out.timeouts.get(label, 0) + 1
                break
            hit = next(((kind, lab, em) for kind, lab, pat in cp.events for em in [pat.search(text)] if em), None)
            if hit is not None:
                figs, _ = _figures(hit[0], hit[2], None)
                keep(EngineRecord(kind=hit[0], name=hit[1], rank=c.rank_hint, rank_label=label, figures=figs,
                                  engine=cp.rules.engine, source=source, line=n, time=when))
                break
    close()
    out.records.sort(key=lambda r: r.line)
    return out


__all__ = ["EngineReadResult", "EngineRecord", "MAX_RECORDS", "read_engine_records"]
