"""Matching: the ranks' records lined up per process group by sequence number, the first divergence (:func:`align`),
per-tick counts and the consistency check."""

from __future__ import annotations

from collections import Counter
from typing import Mapping, Optional, Sequence

from repro.diagnosis import DivergenceKind
from repro.ledger.types import Divergence, GroupInfo, RankLedger, Record


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


def divergence_tick(d: Divergence) -> Optional[int]:
    """The scheduler tick of a divergence: the earliest tick among the records entered at it (None: none)."""
    if d.kind == DivergenceKind.NONE:
        return None
    ticks = [r.tick for r in d.entered.values() if r is not None] + [r.tick for r in d.waits.values() if r is not None]
    return min(ticks) if ticks else None
