"""Reading the injector's ``ledger-<pid>[.N].jsonl`` files into :class:`RankLedger` records (:func:`load_ledgers`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

from repro.evidence import Layout
from repro.ledger.types import GroupInfo, LedgerError, RankLedger, Record, _tuple


LEDGER_RE = Layout.LEDGER_FILE_RE  # ledger-<pid>[.N].jsonl (the store names the files)


def _take_line(d: dict, groups: dict, enters: dict, order: list, exits: dict, rank: Optional[int], pid: int,
               dropped: int, max_records: int) -> tuple[Optional[int], int, int, int]:
    """Fold one ledger line (a JSON object: ``e`` = header / group / enter / exit) into the reader's tables; returns
    the header fields (rank, pid, dropped, max_records) as they stand after it. Raises ValueError / TypeError on a
    field of the wrong type (the caller skips the line with a warning)."""
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
        groups[key] = GroupInfo(key=key, ranks=tuple(int(r) for r in (d.get("ranks") or (old.ranks if old else ()))),
                                backend=d.get("backend") or (old.backend if old else None),
                                label=d.get("label") or (old.label if old else None))
    elif e == "enter":
        k = (str(d.get("g")), int(d.get("seq", 0)))
        if k not in enters:
            order.append(k)
        enters[k] = d
    elif e == "exit":
        exits[(str(d.get("g")), int(d.get("seq", 0)))] = d
    return rank, pid, dropped, max_records


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
            if not isinstance(d, dict):
                warnings.append(f"{p.name}:{i}: not a ledger record (a JSON {type(d).__name__}); skipped")
                continue
            try:
                rank, pid, dropped, max_records = _take_line(d, groups, enters, order, exits, rank, pid, dropped,
                                                             max_records)
            except (ValueError, TypeError) as err:
                warnings.append(f"{p.name}:{i}: malformed ledger record ({err}); skipped")
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
                           thread=str(d.get("thread") or ""), src=d.get("src"), vin=d.get("in"),
                           vout=x.get("out") if x else None))
    return RankLedger(rank=rank, pid=pid, groups=groups, records=recs, dropped=dropped, max_records=max_records,
                      files=[str(p) for p in paths], warnings=warnings)


def load_ledgers(folder: Union[str, Path], pids: Optional[Iterable[int]] = None,
                 unread: Optional[dict[int, str]] = None) -> dict[int, RankLedger]:
    """Read every rank's ledger in an injector folder (``<evidence>/injector`` or a folder holding it).

    Args:
        folder: the injector out_dir, or an evidence folder (its ``injector/`` is used).
        pids: only these processes (the rank pids of the server that ran); default all. When several processes
            claim one rank (a restarted server), the one with the newest record wins.
        unread: when given, gains pid → why for each process among ``pids`` (or with ledger files) whose ledger
            could not be read: no ledger file, or files that are not a ledger (``LedgerError``'s message).
    Returns:
        rank → :class:`RankLedger`; empty when there is no ledger file.
    """
    d = Path(folder)
    if (d / Layout.INJECTOR.name).is_dir():
        d = d / Layout.INJECTOR.name
    want = set(pids) if pids is not None else None
    if not d.is_dir():
        if unread is not None:
            unread.update({pid: "no ledger file" for pid in sorted(want or ())})
        return {}
    by_pid: dict[int, list[Path]] = {}
    for f in d.iterdir():
        m = LEDGER_RE.match(f.name)
        if m:
            by_pid.setdefault(int(m.group(1)), []).append(f)
    out: dict[int, RankLedger] = {}
    if unread is not None:
        unread.update({pid: "no ledger file" for pid in sorted((want or set()) - set(by_pid))})
    for pid, files in sorted(by_pid.items()):
        if want is not None and pid not in want:
            continue
        try:
            led = read_ledger_files(files)
        except (LedgerError, OSError, ValueError, TypeError) as e:
            if unread is not None:
                unread[pid] = f"unreadable ({str(e)[:300]})"
            continue
        old = out.get(led.rank)
        if old is None or led.last_time() > old.last_time():
            out[led.rank] = led
    return out


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
