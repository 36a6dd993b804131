"""Collective ledgers: typed records, per-group alignment across ranks, the first divergent collective.

The injector writes one ``ledger-<pid>.jsonl`` per process (format in ``injectors/repro_injector/_ledger.py``);
this module reads them into :class:`RankLedger` records (like PyTorch Flight Recorder's ``types``/``builder``
split: no analysis in the collector) and aligns them.

Alignment (:func:`align`): for each process group, the ranks' records are lined up by per-group **sequence
number** (the Nth collective a rank entered on that group). The **first divergence** is the earliest point where
the ranks disagree:

- ``missing``: some ranks of the group entered sequence N, others never did and are blocked in another
  collective (their oldest record entered and not left, on any group, reported beside it). When a missing rank is
  not blocked in any collective (idle between ticks, or still on its way), or is still in an earlier sequence
  number of the same group, the sequence is *in flight*, not a divergence: a healthy idle server looks like that.
- ``mismatch``: all ranks entered N but with different op / reduce op / shapes / dtypes; the culprit is the rank(s)
  outside the majority (gloo pairs some of these, so they complete with wrong values instead of hanging).

Only sequence numbers present in every rank's kept window are compared (rotation drops the oldest records). When
several groups diverge, the divergence whose first record carries an injection id comes first (the nemesis' own
collective explains the others), then the earliest entered.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence, Union

from repro.diagnosis import DivergenceKind, md_cell
from repro.evidence import Layout
from repro.state_digest import StateDivergence, diagnose_state

LEDGER_RE = Layout.LEDGER_FILE_RE  # ledger-<pid>[.N].jsonl (the store names the files)


class LedgerError(ValueError):
    """A ledger file cannot be read (message names the file and line)."""


@dataclass(frozen=True)
class GroupInfo:
    """A process group as one rank saw it: ``key`` = torch's group name (same on every rank)."""

    key: str
    ranks: tuple[int, ...] = ()
    backend: Optional[str] = None
    label: Optional[str] = None

    def display(self) -> str:
        """``TP CPU group (gloo, ranks 0,1)`` from sglang's label ``tp/cpu``; else ``group 3 (gloo, ranks 0,1)``."""
        rk = ",".join(map(str, self.ranks))
        tail = f" ({self.backend}, ranks {rk})" if self.backend else f" (ranks {rk})"
        if self.label:
            first = self.label.split(" = ")[0]
            name, _, kind = first.partition("/")
            name = name.split(":")[0]  # sglang's unique name tp:0 -> tp
            return f"{name.upper()} {kind.upper() if kind == 'cpu' else kind} group{tail}"
        return f"group {self.key}{tail}"

    def short(self) -> str:
        """``tp/cpu`` (sglang label) or ``pg3``."""
        return self.label.split(" = ")[0] if self.label else f"pg{self.key}"


@dataclass(frozen=True)
class Record:
    """One collective one rank entered (and maybe left).

    Attributes:
        rank: global rank; group: group key; seq: per-group sequence number (from 1).
        op: torch-level (wire) op; api: outermost API called; red: reduce op or None.
        shapes / dtypes: of the tensors passed; site: caller frames outside the communication layers,
            innermost first (``module:qualname``); tick: scheduler tick when entered.
        t_enter / t_exit: epoch seconds; t_exit None = never left (blocked there, or the process died).
        inj: injection id when the injector's action issued it; err: exception text when the call raised.
    """

    rank: int
    group: str
    seq: int
    op: str
    api: str = ""
    red: Optional[str] = None
    shapes: tuple = ()
    dtypes: tuple = ()
    site: tuple[str, ...] = ()
    tick: int = 0
    t_enter: float = 0.0
    t_exit: Optional[float] = None
    inj: Optional[str] = None
    err: Optional[str] = None
    bypass: bool = False
    thread: str = ""
    src: Optional[int] = None  # broadcasts: the global source rank, when the call named it

    @property
    def open(self) -> bool:
        """Entered and never left."""
        return self.t_exit is None

    def signature(self) -> tuple:
        """What must agree across ranks for one sequence number: op, reduce op, shapes, dtypes."""
        return (self.op, self.red, self.shapes, self.dtypes)

    def call_site(self, n: int = 2) -> str:
        """``check_prefetch_progress ← _get_new_batch_prefill_raw`` (qualnames' last parts, ``n`` frames)."""
        return " ← ".join(short_name(s) for s in self.site[:n]) or "?"


def short_name(frame: str) -> str:
    """``sglang.srt.managers.scheduler:Scheduler.run_batch`` → ``Scheduler.run_batch``."""
    return frame.rpartition(":")[2] or frame


@dataclass
class RankLedger:
    """All kept records of one rank process, in file order, plus what was dropped.

    Attributes:
        rank / pid; groups: key → :class:`GroupInfo`; records: enter order; dropped: enter records discarded by
        rotation (the oldest); max_records: the bound the injector used; files: the files read.
    """

    rank: int
    pid: int
    groups: dict[str, GroupInfo] = field(default_factory=dict)
    records: list[Record] = field(default_factory=list)
    dropped: int = 0
    max_records: int = 0
    files: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def by_group(self) -> dict[str, dict[int, Record]]:
        """group → seq → record."""
        out: dict[str, dict[int, Record]] = {}
        for r in self.records:
            out.setdefault(r.group, {})[r.seq] = r
        return out

    def open_records(self) -> list[Record]:
        """Records entered and never left, oldest first (where this rank is blocked)."""
        return [r for r in self.records if r.open]

    def last_time(self) -> float:
        return max((r.t_exit or r.t_enter for r in self.records), default=0.0)


def _tuple(x) -> tuple:
    return tuple(_tuple(i) if isinstance(i, list) else i for i in (x or ()))


def read_ledger_files(files: Sequence[Union[str, Path]]) -> RankLedger:
    """Read one process's ledger parts (``ledger-<pid>.1.jsonl`` then ``ledger-<pid>.jsonl``) into a RankLedger.

    Garbage or truncated lines (a process killed mid-write) are skipped with a warning.
    Raises:
        LedgerError: no file has a header naming the rank (not a ledger file).
    """
    def part(p: Path) -> int:
        m = LEDGER_RE.match(p.name)
        return int(m.group(2)) if m and m.group(2) else 0

    paths = sorted((Path(f) for f in files), key=lambda p: (-part(p), p.name))  # older part (.1) first
    rank: Optional[int] = None
    pid = 0
    groups: dict[str, GroupInfo] = {}
    enters: dict[tuple[str, int], dict] = {}
    order: list[tuple[str, int]] = []
    exits: dict[tuple[str, int], dict] = {}
    dropped = 0
    max_records = 0
    warnings: list[str] = []
    for p in paths:
        for i, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except ValueError:
                warnings.append(f"{p.name}:{i}: not JSON (truncated write?); skipped")
                continue
            e = d.get("e")
            if e == "header":
                pid = int(d.get("pid") or pid)
                if d.get("rank") is not None:
                    rank = int(d["rank"])
                dropped = max(dropped, int(d.get("dropped") or 0))
                max_records = int(d.get("max_records") or max_records)
            elif e == "group":
                key = str(d.get("g"))
                old = groups.get(key)
                groups[key] = GroupInfo(key=key, ranks=tuple(d.get("ranks") or (old.ranks if old else ())),
                                        backend=d.get("backend") or (old.backend if old else None),
                                        label=d.get("label") or (old.label if old else None))
            elif e == "enter":
                k = (str(d.get("g")), int(d.get("seq", 0)))
                if k not in enters:
                    order.append(k)
                enters[k] = d
            elif e == "exit":
                exits[(str(d.get("g")), int(d.get("seq", 0)))] = d
    if rank is None:
        raise LedgerError(f"{', '.join(str(p) for p in paths)}: no header with a rank; expected a "
                          f"{Layout.ledger_file('<pid>')} written by the repro injector")
    recs: list[Record] = []
    for k in order:
        d = enters[k]
        x = exits.get(k)
        recs.append(Record(rank=rank, group=k[0], seq=k[1], op=str(d.get("op") or "?"), api=str(d.get("api") or ""),
                           red=d.get("red"), shapes=_tuple(d.get("shapes")), dtypes=_tuple(d.get("dtypes")),
                           site=tuple(d.get("site") or ()), tick=int(d.get("tick") or 0),
                           t_enter=float(d.get("t") or 0.0), t_exit=float(x["t"]) if x else None,
                           inj=d.get("inj"), err=x.get("err") if x else None, bypass=bool(d.get("bypass")),
                           thread=str(d.get("thread") or ""), src=d.get("src")))
    return RankLedger(rank=rank, pid=pid, groups=groups, records=recs, dropped=dropped, max_records=max_records,
                      files=[str(p) for p in paths], warnings=warnings)


def load_ledgers(folder: Union[str, Path], pids: Optional[Iterable[int]] = None) -> dict[int, RankLedger]:
    """Read every rank's ledger in an injector folder (``<evidence>/injector`` or a folder holding it).

    Args:
        folder: the injector out_dir, or an evidence folder (its ``injector/`` is used).
        pids: only these processes (the rank pids of the server that ran); default all. When several processes
            claim one rank (a restarted server), the one with the newest record wins.
    Returns:
        rank → :class:`RankLedger`; empty when there is no ledger file.
    """
    d = Path(folder)
    if (d / Layout.INJECTOR.name).is_dir():
        d = d / Layout.INJECTOR.name
    if not d.is_dir():
        return {}
    by_pid: dict[int, list[Path]] = {}
    for f in d.iterdir():
        m = LEDGER_RE.match(f.name)
        if m:
            by_pid.setdefault(int(m.group(1)), []).append(f)
    want = set(pids) if pids is not None else None
    out: dict[int, RankLedger] = {}
    for pid, files in sorted(by_pid.items()):
        if want is not None and pid not in want:
            continue
        try:
            led = read_ledger_files(files)
        except LedgerError:
            continue
        old = out.get(led.rank)
        if old is None or led.last_time() > old.last_time():
            out[led.rank] = led
    return out


@dataclass(frozen=True)
class Divergence:
    """The first point where the ranks of one group disagree.

    Attributes:
        kind: ``missing`` (some ranks never entered ``seq``) or ``mismatch`` (op/reduce op/shape/dtype differ),
            or ``none`` (the ledgers agree; then ``group`` is None).
        group: the group's :class:`GroupInfo`; seq: the sequence number.
        entered: rank → its record at ``seq``; missing: ranks of the group that never entered ``seq``.
        culprits: the odd rank(s): for ``missing`` the ranks that entered when they are fewer than the missing
            ones (else the missing ranks), for ``mismatch`` the ranks outside the majority signature (on an even
            split the side whose record was injected, else none).
        waits: rank → the collective it is blocked in now (its oldest open record, any group) for every rank of
            the group that has one.
        fields: for ``mismatch``, which of ``op``/``red``/``shapes``/``dtypes`` differ.
        summary: one sentence for people.
    """

    kind: DivergenceKind
    group: Optional[GroupInfo] = None
    seq: int = 0
    entered: dict = field(default_factory=dict)
    missing: tuple[int, ...] = ()
    culprits: tuple[int, ...] = ()
    waits: dict = field(default_factory=dict)
    fields: tuple[str, ...] = ()
    summary: str = ""

    def to_dict(self) -> dict:
        """Plain JSON-able data (for analysis.json / compare)."""
        def rec(r: Optional[Record]) -> Optional[dict]:
            if r is None:
                return None
            return {"rank": r.rank, "group": r.group, "seq": r.seq, "op": r.op, "api": r.api, "red": r.red,
                    "shapes": r.shapes, "dtypes": r.dtypes, "site": list(r.site), "tick": r.tick,
                    "t_enter": r.t_enter, "t_exit": r.t_exit, "inj": r.inj}
        return {"kind": DivergenceKind(self.kind).value, "group": self.group.key if self.group else None,
                "group_label": self.group.short() if self.group else None, "seq": self.seq,
                "entered": {str(k): rec(v) for k, v in self.entered.items()}, "missing": list(self.missing),
                "culprits": list(self.culprits), "waits": {str(k): rec(v) for k, v in self.waits.items()},
                "fields": list(self.fields), "summary": self.summary}


def _group_info(ledgers: dict[int, RankLedger], key: str) -> GroupInfo:
    best: Optional[GroupInfo] = None
    for led in ledgers.values():
        g = led.groups.get(key)
        if g is not None and (best is None or (g.label and not best.label)):
            best = g
    return best or GroupInfo(key=key)


def _desc(r: Record, groups: dict[int, RankLedger]) -> str:
    inj = "the injected " if r.inj else ""
    g = _group_info(groups, r.group)
    return f"{inj}{r.op} #{r.seq} on the {g.display().split(' (')[0]} from {r.call_site()}"


def align(ledgers: dict[int, RankLedger]) -> Divergence:
    """Align the ranks' ledgers per group and return the first divergence (``kind='none'`` when they agree).

    Args:
        ledgers: rank → :class:`RankLedger` (e.g. from :func:`load_ledgers`).
    Returns:
        A :class:`Divergence` (see the module docstring for the rules and the order between groups).
    """
    if not ledgers:
        return Divergence(kind=DivergenceKind.NONE, summary="no ledger recorded")
    per = {rank: led.by_group() for rank, led in ledgers.items()}
    keys = sorted({k for g in per.values() for k in g})
    waits_all = {rank: led.open_records()[0] for rank, led in ledgers.items() if led.open_records()}
    found: list[Divergence] = []
    for key in keys:
        info = _group_info(ledgers, key)
        members = [r for r in (info.ranks or sorted(ledgers)) if r in ledgers]
        if len(members) < 2:
            continue
        seqs = {r: per[r].get(key, {}) for r in members}
        lo = max((min(s) if s else 1) for s in seqs.values())
        hi = max((max(s) if s else 0) for s in seqs.values())
        for n in range(lo, hi + 1):
            at = {r: seqs[r][n] for r in members if n in seqs[r]}
            miss = tuple(r for r in members if r not in at)
            if miss and any(r not in waits_all or (waits_all[r].group == key and waits_all[r].seq < n) for r in miss):
                break  # in flight: a missing rank is not blocked in any collective (idle, or on its way), or is
                # still in an earlier collective of this group (its exit not yet written): no desync
            if miss:
                culprits = tuple(sorted(at)) if len(at) < len(miss) else miss
                found.append(Divergence(kind=DivergenceKind.MISSING, group=info, seq=n, entered=at, missing=miss, culprits=culprits,
                                        waits={r: w for r, w in waits_all.items() if r in members}))
                break
            sigs = Counter(r.signature() for r in at.values())
            if len(sigs) > 1:
                top, cnt = sigs.most_common(1)[0]
                if list(sigs.values()).count(cnt) > 1:  # even split: the injected side if any, else undecided
                    culprits = tuple(sorted(r for r, rec in at.items() if rec.inj))
                else:
                    culprits = tuple(sorted(r for r, rec in at.items() if rec.signature() != top))
                names = ("op", "red", "shapes", "dtypes")
                diff = tuple(nm for i, nm in enumerate(names) if len({rec.signature()[i] for rec in at.values()}) > 1)
                found.append(Divergence(kind=DivergenceKind.MISMATCH, group=info, seq=n, entered=at, culprits=culprits,
                                        waits={r: w for r, w in waits_all.items() if r in members}, fields=diff))
                break
            # Same op and size, but an injected record meets a genuine one, or the call sites differ: the backend
            # paired two different collectives (vLLM's shm stamps pair an extra op with the peer's next op of the
            # same kind and size), so the ranks drift out of step here, not where the drift finally hangs.
            inj = tuple(sorted(r for r, rec in at.items() if rec.inj))
            site = {r: (rec.site[0] if rec.site else "") for r, rec in at.items()}
            mixed_inj = 0 < len(inj) < len(at)
            sites = Counter(x for x in site.values() if x)
            if mixed_inj or len(sites) > 1:
                if mixed_inj:
                    culprits = inj
                else:
                    top, cnt = sites.most_common(1)[0]
                    culprits = () if list(sites.values()).count(cnt) > 1 else \
                        tuple(sorted(r for r, x in site.items() if x != top))
                diff = tuple(nm for nm, hit in (("injected", mixed_inj), ("call site", len(sites) > 1)) if hit)
                found.append(Divergence(kind=DivergenceKind.MISMATCH, group=info, seq=n, entered=at, culprits=culprits,
                                        waits={r: w for r, w in waits_all.items() if r in members}, fields=diff))
                break
    if not found:
        return Divergence(kind=DivergenceKind.NONE, summary=_agree_summary(ledgers))

    def order(d: Divergence) -> tuple:
        inj = any(r.inj for r in d.entered.values())
        return (0 if inj else 1, min((r.t_enter for r in d.entered.values()), default=0.0))

    found.sort(key=order)
    d = found[0]
    return Divergence(kind=d.kind, group=d.group, seq=d.seq, entered=d.entered, missing=d.missing,
                      culprits=d.culprits, waits=d.waits, fields=d.fields, summary=_summary(d, ledgers))


def _ranks(rs: Sequence[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ",".join(map(str, rs))


def _summary(d: Divergence, ledgers: dict[int, RankLedger], dead: Optional[Mapping[int, str]] = None) -> str:
    """One sentence for ``d``; ``dead``: rank → why it died (a dead rank's open record is where it died, never a
    wait)."""
    dead = dead or {}
    gname = d.group.display().split(" (")[0] if d.group else "?"
    if d.kind == DivergenceKind.MISSING:
        ent = sorted(d.entered)
        first = d.entered[ent[0]]
        parts = [f"{_ranks(ent)} entered {_desc(first, ledgers)}"]
        parts += [f"{_ranks([r])} died there ({dead[r]})" for r in ent if r in dead]
        waits = []
        for r in d.missing:
            w = d.waits.get(r)
            never = f"{_ranks([r])} never did"
            if r in dead:
                waits.append(f"{never}: it died ({dead[r]})" + (f"; its last record was {_desc(w, ledgers)}" if w is not None else ""))
            elif w is not None:
                waits.append(f"{never} and waits in {_desc(w, ledgers)}")
            else:
                waits.append(f"{never} (it is not blocked in any recorded collective)")
        return "; ".join(parts + waits) + "."
    if d.kind == DivergenceKind.MISMATCH:
        recs = sorted(d.entered.values(), key=lambda r: r.rank)
        if d.culprits and len(d.culprits) < len(recs):
            culprit = [r for r in recs if r.rank in d.culprits]
            others = [r for r in recs if r.rank not in d.culprits]
        else:  # an even split (or every side injected): no majority to call one side odd
            sig0 = recs[0].signature()
            culprit = [r for r in recs if r.signature() == sig0]
            others = [r for r in recs if r.signature() != sig0]

        if not d.culprits or len(d.culprits) >= len(recs):
            pass
        elif set(d.fields) <= {"injected", "call site"}:  # same op and size: name the records, the odd one first
            return (f"{gname} #{d.seq}: {_ranks([r.rank for r in culprit])} entered {_desc(culprit[0], ledgers)} while "
                    f"{_ranks([r.rank for r in others])} entered {_desc(others[0], ledgers)} (the backend paired "
                    f"them: {', '.join(d.fields)} differ).")

        def what(r: Record) -> str:
            return f"{r.op}({r.red or ''}) {list(r.shapes)} {','.join(r.dtypes)} from {r.call_site()}"
        return (f"{gname} #{d.seq}: {_ranks([r.rank for r in culprit])} entered {what(culprit[0])} while "
                f"{_ranks([r.rank for r in others])} entered {what(others[0])} ({', '.join(d.fields)} differ).")
    return d.summary


def _agree_summary(ledgers: dict[int, RankLedger]) -> str:
    per = {rank: led.by_group() for rank, led in ledgers.items()}
    keys = sorted({k for g in per.values() for k in g})
    parts = []
    for key in keys:
        n = {rank: len(g.get(key, {})) for rank, g in per.items() if key in g}
        parts.append(f"{_group_info(ledgers, key).short()}: {min(n.values())} collectives")
    return "The ranks' ledgers agree (" + "; ".join(parts) + ")."


def per_tick_counts(ledgers: dict[int, RankLedger], group: Optional[str] = None) -> dict[int, dict[int, int]]:
    """Collectives entered per rank per scheduler tick.

    Args:
        ledgers: rank → RankLedger; group: only this group (key ``"3"`` or sglang label ``tp/cpu``); None = all.
    Returns:
        rank → {tick: number of collectives entered in that tick} (ticks without collectives left out).
    """
    out: dict[int, dict[int, int]] = {}
    for rank, led in sorted(ledgers.items()):
        keys = None
        if group is not None:
            keys = {k for k, g in led.groups.items() if k == group or (g.label and group in g.label.split(" = "))}
            keys.add(group)
        c: Counter = Counter(r.tick for r in led.records if keys is None or r.group in keys)
        out[rank] = dict(sorted(c.items()))
    return out


IN_FLIGHT_MAX = 2  # broadcast_pyobj = 2 broadcasts: what a live server's ranks may be apart when read


def check_consistent(ledgers: dict[int, RankLedger], in_flight_max: int = IN_FLIGHT_MAX) -> list[str]:
    """Problems that make a healthy run's ledgers inconsistent (empty list = consistent).

    Checks, per group: every member rank has > 0 records, the same op sequence over the sequence numbers all ranks
    reached, equal sequence totals up to an in-flight tail of at most ``in_flight_max`` collectives (a live server
    read between two ticks: some ranks already entered the next request broadcast), and no rank dropped records.
    """
    problems: list[str] = []
    if not ledgers:
        return ["no ledger files"]
    for rank, led in sorted(ledgers.items()):
        if not led.records:
            problems.append(f"rank {rank}: no records")
        if led.dropped:
            problems.append(f"rank {rank}: {led.dropped} records dropped by rotation (max_records {led.max_records})")
    per = {rank: led.by_group() for rank, led in ledgers.items()}
    keys = sorted({k for g in per.values() for k in g})
    for key in keys:
        info = _group_info(ledgers, key)
        members = [r for r in (info.ranks or sorted(ledgers)) if r in ledgers]
        totals = {r: len(per[r].get(key, {})) for r in members}
        if max(totals.values()) - min(totals.values()) > in_flight_max:
            problems.append(f"group {info.short()}: sequence totals differ {totals}")
        common = set.intersection(*(set(per[r].get(key, {})) for r in members))
        ops = {r: [per[r][key][n].op for n in sorted(common)] for r in members}
        if len({tuple(v) for v in ops.values()}) > 1:
            problems.append(f"group {info.short()}: op sequences differ")
    return problems


@dataclass
class LedgerDiagnosis:
    """The ledger side of a run's diagnosis: the ledgers read, the first divergence and the bookkeeping.

    Attributes:
        ledgers: rank → RankLedger; divergence: :func:`align`'s result; per_tick: :func:`per_tick_counts` (all
        groups); problems: :func:`check_consistent`'s list (relevant for a healthy run); dropped: rank → records
        dropped by rotation.
    """

    ledgers: dict[int, RankLedger]
    divergence: Divergence
    per_tick: dict[int, dict[int, int]]
    problems: list[str]
    dead: dict[int, str] = field(default_factory=dict)  # rank → why it died during the run (never "waits in")
    state: Optional[StateDivergence] = None  # the first divergent lockstep state (repro.state_digest)

    def mark_dead(self, dead: Mapping[int, str]) -> "LedgerDiagnosis":
        """Say which ranks died (rank → why): their open records are where they died, not waits. Returns self."""
        self.dead = {int(k): str(v) for k, v in dead.items()}
        d = self.divergence
        if self.dead and d.kind != DivergenceKind.NONE:
            self.divergence = replace(d, summary=_summary(d, self.ledgers, self.dead))
        elif self.dead:
            died = "; ".join(f"rank {k} died ({v})" for k, v in sorted(self.dead.items()))
            self.divergence = replace(d, summary=f"{died}. {d.summary}")
        return self

    @property
    def dropped(self) -> dict[int, int]:
        return {r: led.dropped for r, led in sorted(self.ledgers.items())}

    def to_dict(self) -> dict:
        """What ``ledger.json`` in the evidence folder holds."""
        per_group: dict[str, dict[str, int]] = {}
        for rank, led in sorted(self.ledgers.items()):
            for r in led.records:
                g = led.groups.get(r.group)
                per_group.setdefault(g.short() if g else r.group, {}).setdefault(str(rank), 0)
                per_group[g.short() if g else r.group][str(rank)] += 1
        return {"divergence": self.divergence.to_dict(),
                "state_divergence": self.state.to_dict() if self.state is not None else None,
                "records_per_group": per_group,
                "per_tick_counts": {str(r): {str(t): n for t, n in c.items()} for r, c in self.per_tick.items()},
                "dropped": {str(r): n for r, n in self.dropped.items()},
                "consistency_problems": self.problems,
                "files": {str(r): led.files for r, led in sorted(self.ledgers.items())}}

    def markdown_lines(self, timeline: Optional[str] = Layout.TIMELINE.name) -> list[str]:
        """The Diagnosis section's ledger part: the sentence, the aligned table, the timeline picture."""
        d = self.divergence
        out = self.state.markdown_lines() if self.state is not None else []
        out += [f"**Collective ledger:** {d.summary}", ""]
        if d.kind != DivergenceKind.NONE and d.group is not None:
            out += [f"Aligned at the first divergence — {d.group.display()}, sequence #{d.seq}:", "",
                    "| rank | seq | op | reduce op | shapes | dtypes | call site | tick | state |",
                    "|---|---|---|---|---|---|---|---|---|"]
            members = sorted(set(d.entered) | set(d.missing))
            for rank in members:
                r = d.entered.get(rank)
                if r is not None:
                    state = ("died inside" if rank in self.dead else "blocked (never left)") if r.open else "left"
                    inj = f" (injected `{r.inj}`)" if r.inj else ""
                    out.append(f"| {rank} | #{r.seq} | {r.op}{inj} | {r.red or '-'} | {list(r.shapes)} | "
                               f"{','.join(r.dtypes) or '-'} | {_md(r.call_site(3))} | {r.tick} | {state} |")
                else:
                    w = d.waits.get(rank)
                    if rank in self.dead:
                        where = f"never entered: died ({_md(self.dead[rank])})" + (f"; last in {w.op} #{w.seq}" if w else "")
                    else:
                        where = (f"never entered; waits in {w.op} #{w.seq} on "
                                 f"{_group_info(self.ledgers, w.group).short()} from {_md(w.call_site(3))}"
                                 if w else "never entered")
                    out.append(f"| {rank} | - | - | - | - | - | {where} | - | - |")
            out.append("")
        if self.dropped and any(self.dropped.values()):
            out += [f"Ledger rotation dropped the oldest records: {self.dropped} (per rank).", ""]
        if timeline:
            out += [f"![per-rank collective timeline]({timeline})", "",
                    f"Timeline: [{timeline}]({timeline}) (last collectives per rank; red = first divergence).", ""]
        return out


_md = md_cell  # the one markdown escape (repro.diagnosis)


def diagnose(folder: Union[str, Path], pids: Optional[Iterable[int]] = None) -> Optional[LedgerDiagnosis]:
    """Read the ledgers of an injector (or evidence) folder and align them; None when there is no ledger.

    Args:
        folder: injector out_dir or evidence folder; pids: the server's rank pids (None = every ledger file).
    """
    leds = load_ledgers(folder, pids)
    if not leds:
        return None
    div = align(leds)
    return LedgerDiagnosis(leds, div, per_tick_counts(leds), check_consistent(leds),
                           state=diagnose_state(leds, collective_tick=divergence_tick(div)))


def divergence_tick(d: Divergence) -> Optional[int]:
    """The scheduler tick of a divergence: the earliest tick among the records entered at it (None: none)."""
    if d.kind == DivergenceKind.NONE:
        return None
    ticks = [r.tick for r in d.entered.values() if r is not None] + [r.tick for r in d.waits.values() if r is not None]
    return min(ticks) if ticks else None


def rank_pids_of(folder: Union[str, Path]) -> Optional[list[int]]:
    """The rank pids an evidence folder recorded (``verdict.json``, else ``session.json``); None when neither
    names any (then every ledger file counts). A malformed file counts as absent."""
    from repro import evidence as ev

    try:
        evd = ev.EvidenceDir.open(folder)
    except ev.EvidenceFileError:
        return None
    for member in (evd.verdict, evd.session):
        try:
            rec = member.read(missing_ok=True)
        except ev.EvidenceFileError:
            continue
        pids = [int(v) for v in (rec.rank_pids if rec is not None else {}).values()]
        if pids:
            return pids
    return None


def diagnose_paths(paths: Iterable[Union[str, Path]]) -> Optional[LedgerDiagnosis]:
    """The ledger diagnosis of the first folder among ``paths`` (evidence or injector folders; files are skipped)
    that holds ledger files, with the rank pids it recorded (:func:`rank_pids_of`); None when none does. What
    ``repro analyze`` puts beside the stack analysis."""
    for p in paths:
        p = Path(p)
        if not p.is_dir():
            continue
        try:
            diag = diagnose(p, rank_pids_of(p))
        except Exception:  # an unreadable ledger: the stack analysis still stands
            diag = None
        if diag is not None:
            return diag
    return None


__all__ = ["LedgerDiagnosis", "diagnose", "diagnose_paths", "rank_pids_of", "GroupInfo", "Record", "RankLedger", "Divergence", "LedgerError", "read_ledger_files", "load_ledgers",
           "align", "per_tick_counts", "check_consistent", "short_name"]
