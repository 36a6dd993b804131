"""The ledger's records: one collective of one rank (:class:`Record`), a process group as a rank saw it, one rank's
ledger, the first divergence."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from repro.diagnosis import DivergenceKind


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
        vin / vout: the values a small CPU tensor of an ``all_reduce`` / ``broadcast`` carried in and out (a list,
            or a number for a 0-d tensor; injectors/repro_injector/_ledger_args.py), None when not recorded.
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
    vin: Any = None
    vout: Any = None

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
