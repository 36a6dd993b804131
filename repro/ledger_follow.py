"""Follow every rank's collective ledger while a burst runs (tail, never re-read) and keep the live alignment.

The injector writes ``ledger-<pid>.jsonl`` per rank process (format: ``injectors/repro_injector/_ledger.py``),
on disk at the next scheduler tick, and within 250 ms of the rank's last write while it is blocked in gloo.
:class:`LedgerFollower` keeps one open file handle per rank and reads only the bytes added since the last
:meth:`LedgerFollower.poll`; :class:`LiveAlignment` keeps, per process group and sequence number, which ranks entered
and which left, with op, reduce op, shapes, dtypes, call site and thread (``repro.ledger.Record``). ``repro.proof``
decides from it.

What a follower trusts (each rank separately; :attr:`RankFollow.unreliable` says why not):

- a file is a *prefix* of that rank's history: records are appended in the order the rank made them, so what has
  been read is the rank's exact state at some moment (the proofs in ``repro.proof`` only need that);
- the injector's own rotation (``ledger-<pid>.jsonl`` renamed to ``.1`` once it holds ``max_records // 2`` enter
  records, a new part opened with ``part`` + 1) is followed seamlessly: the old handle is read to its end (the
  injector closed it before renaming), then the new part is opened;
- anything else makes the rank **unreliable** for the rest of the burst, and no proof may use it (the stall rule
  decides instead): the file shrank under the handle (truncated), a new part whose ``part`` is not the next one (a
  part was missed: rotated twice between two polls, or by something else than the injector), a line that is not
  JSON before the end of the file (a lost exit record would look like a rank still blocked), or no ledger file at
  all for the rank (missing).

A partial last line (the writer is mid-line) waits for its newline. Memory is bounded: a (group, sequence number)
that every member entered and left is dropped once ``repro.proof`` has looked at it (:meth:`LiveAlignment.retire`).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Optional

from repro.evidence import Layout
from repro.ledger import GroupInfo, Record, _tuple
from repro.state_follow import LiveState

CHUNK_MAX_BYTES = 4 << 20  # read at most this much per rank per poll (a follower that fell behind catches up)
_decode = json.JSONDecoder().decode  # json.loads minus its per-call encoding sniffing (the ledger is UTF-8)


def _left(r: Record, t_exit: float, err) -> Record:
    """``dataclasses.replace(r, t_exit=t_exit, err=err)`` without re-running the constructor (half the follower's
    time per exit line went there, measured in benchmarks/RESULTS.md): a copy of the frozen record's fields."""
    new = object.__new__(Record)
    new.__dict__.update(r.__dict__)
    new.__dict__["t_exit"] = t_exit
    new.__dict__["err"] = err
    return new


@dataclass
class Slot:
    """One (group, sequence number) across ranks: ``entered`` rank → its record (``t_exit``/``err`` filled when it
    left), ``left`` the ranks whose exit was read."""

    group: str
    seq: int
    entered: dict[int, Record] = field(default_factory=dict)
    left: set[int] = field(default_factory=set)


@dataclass
class RankFollow:
    """What the follower knows of one rank.

    Attributes:
        rank / pid; max_seq: group → highest sequence number entered (as read); last_thread: group → the thread of
        the rank's latest record on that group (the thread that will issue its next one, when ``threads_on`` holds
        only it: a group used from several threads has no single issuing thread); open: (group, seq) →
        record entered and not yet left; from_start: the window began at part 0, byte 0 (so a group the rank never
        used is known to be at sequence 0); unreliable: why no proof may use this rank (None = usable);
        warnings: what was seen and tolerated.
    """

    rank: int
    pid: int
    max_seq: dict[str, int] = field(default_factory=dict)
    last_thread: dict[str, str] = field(default_factory=dict)
    threads_on: dict[str, set] = field(default_factory=dict)  # group → every thread seen issuing on it
    open: dict[tuple[str, int], Record] = field(default_factory=dict)
    from_start: bool = False
    unreliable: Optional[str] = None
    warnings: list[str] = field(default_factory=list)
    records_read: int = 0
    last_t: float = 0.0

    def knows_group(self, group: str) -> bool:
        """True when this rank's position on ``group`` is known (a record of it was read, or the window is whole)."""
        return group in self.max_seq or self.from_start

    def seq_on(self, group: str) -> int:
        return self.max_seq.get(group, 0)

    def blocking(self) -> dict[str, Record]:
        """thread → the record that thread is inside now (its latest open record)."""
        out: dict[str, Record] = {}
        for r in self.open.values():
            cur = out.get(r.thread)
            if cur is None or r.t_enter >= cur.t_enter:
                out[r.thread] = r
        return out


class LiveAlignment:
    """Per process group and sequence number, which ranks entered and left (fed by :class:`LedgerFollower`).

    Attributes:
        ranks: rank → :class:`RankFollow`; groups: key → :class:`repro.ledger.GroupInfo` (the most complete seen);
        slots: (group, seq) → :class:`Slot` still of interest; p2p_groups: groups that carried send/recv (their
        sequence numbers do not line up across ranks: never compared); last_enter: the newest record entered.
    """

    def __init__(self, expected_ranks: Iterable[int] = ()) -> None:
        self.expected = sorted(expected_ranks)
        self.ranks: dict[int, RankFollow] = {}
        self.groups: dict[str, GroupInfo] = {}
        self.slots: dict[tuple[str, int], Slot] = {}
        self.p2p_groups: set[str] = set()
        self.last_enter: Optional[Record] = None
        self.dirty: set[tuple[str, int]] = set()  # slots changed since repro.proof last looked

    def rank(self, rank: int, pid: int = 0) -> RankFollow:
        rf = self.ranks.get(rank)
        if rf is None:
            rf = self.ranks[rank] = RankFollow(rank, pid)
        return rf

    def members(self, group: str) -> tuple[int, ...]:
        g = self.groups.get(group)
        return g.ranks if g is not None and g.ranks else tuple(self.expected)

    def backend(self, group: str) -> str:
        g = self.groups.get(group)
        return (g.backend or "").lower() if g is not None else ""

    def add_group(self, d: Mapping) -> None:
        key = str(d.get("g"))
        old = self.groups.get(key)
        self.groups[key] = GroupInfo(key=key, ranks=tuple(d.get("ranks") or (old.ranks if old else ())),
                                     backend=d.get("backend") or (old.backend if old else None),
                                     label=d.get("label") or (old.label if old else None))

    def add_enter(self, rf: RankFollow, d: Mapping) -> None:
        g, n = str(d.get("g")), int(d.get("seq", 0))
        r = Record(rank=rf.rank, group=g, seq=n, op=str(d.get("op") or "?"), api=str(d.get("api") or ""),
                   red=d.get("red"), shapes=_tuple(d.get("shapes")), dtypes=_tuple(d.get("dtypes")),
                   site=tuple(d.get("site") or ()), tick=int(d.get("tick") or 0), t_enter=float(d.get("t") or 0.0),
                   inj=d.get("inj"), bypass=bool(d.get("bypass")), thread=str(d.get("thread") or ""),
                   src=d.get("src"))
        if r.op in ("send", "recv"):
            self.p2p_groups.add(g)
        rf.max_seq[g] = max(rf.max_seq.get(g, 0), n)
        rf.last_thread[g] = r.thread
        rf.threads_on.setdefault(g, set()).add(r.thread)
        rf.open[(g, n)] = r
        rf.records_read += 1
        rf.last_t = max(rf.last_t, r.t_enter)
        slot = self.slots.get((g, n))
        if slot is None:
            slot = self.slots[(g, n)] = Slot(g, n)
        slot.entered[rf.rank] = r
        self.dirty.add((g, n))
        if self.last_enter is None or r.t_enter >= self.last_enter.t_enter:
            self.last_enter = r

    def add_exit(self, rf: RankFollow, d: Mapping) -> None:
        g, n = str(d.get("g")), int(d.get("seq", 0))
        r = rf.open.pop((g, n), None)
        t = float(d.get("t") or 0.0)
        rf.last_t = max(rf.last_t, t)
        slot = self.slots.get((g, n))
        if slot is None or r is None:
            return
        slot.entered[rf.rank] = _left(r, t, d.get("err"))
        slot.left.add(rf.rank)
        self.dirty.add((g, n))

    def retire(self, key: tuple[str, int]) -> None:
        """Forget a slot every member entered and left (``repro.proof`` has judged it)."""
        self.slots.pop(key, None)
        self.dirty.discard(key)

    def usable(self, rank: int) -> bool:
        rf = self.ranks.get(rank)
        return rf is not None and rf.unreliable is None and rf.records_read > 0

    def fallback_reasons(self) -> list[str]:
        """Why a proof cannot use some rank (empty when every expected rank is followed cleanly)."""
        out = []
        for k in self.expected:
            rf = self.ranks.get(k)
            if rf is None or (rf.records_read == 0 and rf.unreliable is None):
                out.append(f"rank {k}: no ledger records (ledger missing for this rank)")
            elif rf.unreliable:
                out.append(f"rank {k}: {rf.unreliable}")
        return out


class _Tail:
    """One rank's ledger, followed by handle: reads what was appended, follows the injector's rotation."""

    def __init__(self, directory: Path, pid: int, rf: RankFollow) -> None:
        self.path = Path(directory) / Layout.ledger_file(pid)
        self.rf = rf
        self.fh = None
        self.ino: Optional[int] = None
        self.offset = 0
        self.partial = b""
        self.part: Optional[int] = None

    def _open(self) -> bool:
        try:
            fh = open(self.path, "rb")
        except OSError:
            return False
        self.fh, self.ino, self.offset, self.partial = fh, os.fstat(fh.fileno()).st_ino, 0, b""
        return True

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None

    def read(self, on_line) -> None:
        rf = self.rf
        if rf.unreliable is not None:
            return
        if self.fh is None and not self._open():
            return
        for _ in range(4):  # this part, then the next one(s) if it rotated meanwhile
            size = os.fstat(self.fh.fileno()).st_size
            if size < self.offset:
                rf.unreliable = f"{self.path.name} shrank from {self.offset} to {size} bytes (truncated)"
                self.close()
                return
            self.fh.seek(self.offset)
            chunk = self.fh.read(CHUNK_MAX_BYTES)
            self.offset += len(chunk)
            data = self.partial + chunk
            lines = data.split(b"\n")
            self.partial = lines.pop()
            for ln in lines:
                if ln.strip():
                    on_line(self, ln)
                    if rf.unreliable is not None:
                        self.close()
                        return
            if len(chunk) == CHUNK_MAX_BYTES:
                return  # more next poll
            try:
                ino = os.stat(self.path).st_ino
            except OSError:
                return
            if ino == self.ino:
                return
            # rotated: the injector closed this part before renaming it, so what is left was just read
            if self.partial.strip():
                rf.unreliable = f"{self.path.name}: rotated with an unfinished last line (truncated record)"
                self.close()
                return
            self.close()
            if not self._open():
                return


class LedgerFollower:
    """Tail every rank's ledger into a :class:`LiveAlignment`.

    Args:
        injector_dir: the injector folder (``ledger-<pid>.jsonl`` files).
        rank_pids: rank → pid of the rank processes to follow.
    Use :meth:`poll` (cheap: one ``fstat`` and one read per rank) as often as wanted; :meth:`close` at the end.
    Costs measured in ``benchmarks/ledger_proof.py`` (the follower's own CPU).
    """

    def __init__(self, injector_dir: Path, rank_pids: Mapping[int, int]) -> None:
        self.dir = Path(injector_dir)
        self.rank_pids = dict(rank_pids)
        self.alignment = LiveAlignment(sorted(rank_pids))
        self.tails = {r: _Tail(self.dir, pid, self.alignment.rank(r, pid)) for r, pid in self.rank_pids.items()}
        self.lines = 0
        self.state = LiveState(sorted(rank_pids))  # the lockstep state digest, followed live (repro.state_follow)

    def _line(self, tail: _Tail, ln: bytes) -> None:
        rf, al = tail.rf, self.alignment
        try:
            d = _decode(ln.decode("utf-8"))
        except ValueError:
            rf.unreliable = f"{tail.path.name}: a line that is not JSON at byte {tail.offset} (corrupt or truncated)"
            return
        self.lines += 1
        e = d.get("e")
        if e == "enter":
            al.add_enter(rf, d)
            t = d.get("tick")
            if isinstance(t, int) and t > self.state.last_tick.get(rf.rank, t):
                self.state.last_tick[rf.rank] = t
        elif e == "state" or e == "state_error":
            self.state.add(rf.rank, d)
        elif e == "exit":
            al.add_exit(rf, d)
        elif e == "group":
            al.add_group(d)
        elif e == "header":
            part = int(d.get("part") or 0)
            if tail.part is None:
                rf.from_start = part == 0 and int(d.get("dropped") or 0) == 0
                if d.get("rank") is not None and int(d["rank"]) != rf.rank:
                    rf.unreliable = f"{tail.path.name} says rank {d['rank']}, expected rank {rf.rank}"
            elif part != tail.part + 1:
                rf.unreliable = (f"{tail.path.name}: part {part} followed part {tail.part} (a part was missed: rotated "
                                 "more than once between two reads, or by something else)")
            tail.part = part

    def poll(self) -> int:
        """Read what every rank appended since the last poll. Returns the number of lines read."""
        before = self.lines
        for tail in self.tails.values():
            try:
                tail.read(self._line)
            except OSError as e:
                tail.rf.unreliable = f"{tail.path.name}: {e}"
        return self.lines - before

    def close(self) -> None:
        self.closed = True
        for t in self.tails.values():
            t.close()

    closed = False


MAX_SHARED_FOLLOWERS = 16
_SHARED: "OrderedDict[tuple, LedgerFollower]" = OrderedDict()


def shared_follower(injector_dir: Path, rank_pids: Mapping[int, int]) -> LedgerFollower:
    """The one :class:`LedgerFollower` of a live server's ledgers, kept across bursts.

    A session drives many bursts on one server (controls, clean bursts, hunt trials); each burst's detector follows
    the ledgers from where the previous one stopped instead of re-reading every file from its start (the files hold
    up to ``max_records`` collectives per rank: re-reading them cost the harness ~0.1 s of CPU more per burst,
    measured in benchmarks/RESULTS.md). Keyed by the injector folder and the rank → pid map, so a restarted server
    (new pids) gets a new follower; at most :data:`MAX_SHARED_FOLLOWERS` are kept, the oldest closed first. What a
    follower found unusable (a truncated or out-of-order ledger) stays unusable for the server's life: never a
    proof from it.

    Args:
        injector_dir: the injector folder holding ``ledger-<pid>.jsonl``.
        rank_pids: rank → pid of the server's rank processes.
    Returns:
        A follower that has not been closed (callers must not close it; :func:`forget_followers` does).
    """
    key = (str(Path(injector_dir).resolve()), tuple(sorted((int(k), int(v)) for k, v in rank_pids.items())))
    f = _SHARED.pop(key, None)
    if f is None or f.closed:
        f = LedgerFollower(Path(injector_dir), rank_pids)
    _SHARED[key] = f
    while len(_SHARED) > MAX_SHARED_FOLLOWERS:
        _k, old = _SHARED.popitem(last=False)
        old.close()
    return f


def forget_followers() -> None:
    """Close and drop every follower :func:`shared_follower` keeps."""
    while _SHARED:
        _k, f = _SHARED.popitem()
        f.close()


__all__ = ["LedgerFollower", "LiveAlignment", "RankFollow", "Slot", "CHUNK_MAX_BYTES", "shared_follower",
           "forget_followers"]
