"""The lockstep state digest followed live: the first tick at which two ranks' state differs, while they still run.

:class:`repro.ledger_follow.LedgerFollower` hands every rank's ``state`` / ``state_error`` lines (format:
``injectors/repro_injector/_digest.py``) and the ticks of its collective records to one :class:`LiveState`.
:meth:`LiveState.check` compares the ranks tick by tick (the same rules as :func:`repro.state_digest.diagnose_state`:
forward fill from each rank's first full digest; ``local`` / ``info`` probes and probes that failed on any rank are
not compared), only up to the last tick *every* rank has reached, so a rank that is merely behind is never a
divergence. Each tick is compared once; what is behind the compared tick is dropped (memory stays bounded on a long
watch). The first divergence is reported once (``repro watch`` logs it as a warning line before any request times
out); it never changes a verdict.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any, Iterable, Optional

MAX_SNAPSHOTS = 4096  # value changes kept per rank awaiting comparison (memory stays bounded on a long serve)


def _show(v: Any) -> str:
    if isinstance(v, list) and len(v) == 2:
        return f"{v[0]} (set {str(v[1])[:8]})"
    return "absent" if v is None else str(v)


class LiveState:
    """Every rank's digest values as the ledgers are read (see the module docstring). Not thread-safe."""

    def __init__(self, ranks: Iterable[int]) -> None:
        self.ranks = sorted(int(r) for r in ranks)
        self.cur: dict[int, Optional[dict[str, Any]]] = {r: None for r in self.ranks}
        self.snaps: dict[int, deque] = {r: deque() for r in self.ranks}  # (tick, values at that tick's start)
        self.first_full: dict[int, Optional[int]] = {r: None for r in self.ranks}
        self.last_tick: dict[int, int] = {r: -1 for r in self.ranks}
        self.kinds: dict[str, str] = {}
        self.skipped: dict[str, str] = {}
        self.through: Optional[int] = None  # the last tick compared
        self.divergence: Optional[dict[str, Any]] = None
        self.dropped = 0  # snapshots dropped uncompared (a rank more than MAX_SNAPSHOTS changes ahead of another)

    @property
    def recorded(self) -> bool:
        """Every rank has written a full digest (before that nothing is compared)."""
        return bool(self.ranks) and all(v is not None for v in self.first_full.values())

    def add(self, rank: int, d: dict) -> None:
        """One ledger line of ``rank`` (``state``, ``state_error``, or a collective record with a ``tick``)."""
        if rank not in self.cur:
            return
        e = d.get("e")
        try:
            tick = int(d.get("tick") or 0)
        except (TypeError, ValueError):
            return
        if e == "state":
            v = d.get("v") or {}
            if d.get("full"):
                self.kinds.update(d.get("kinds") or {})
                if self.first_full[rank] is None:
                    self.first_full[rank] = tick
                vals = {**(self.cur[rank] or {}), **v}
            elif self.cur[rank] is None:
                return  # before this rank's first full digest: nothing to fill from
            else:
                vals = {**self.cur[rank], **v}
            self.cur[rank] = vals
            snaps = self.snaps[rank]
            if snaps and snaps[-1][0] == tick:
                snaps[-1] = (tick, vals)
            else:
                snaps.append((tick, vals))
            if len(snaps) > MAX_SNAPSHOTS:  # nobody called check() (a run's detector), or a rank is far behind
                self.check()
                while len(snaps) > MAX_SNAPSHOTS:
                    snaps.popleft()
                    self.dropped += 1
        elif e == "state_error":
            self.skipped.setdefault(str(d.get("probe")), f"rank {rank}: {d.get('err')}")
        if tick > self.last_tick[rank]:
            self.last_tick[rank] = tick

    def check(self) -> Optional[dict[str, Any]]:
        """Compare the ticks every rank has reached since the last check.

        Returns:
            Once, at the first divergence: ``{"status": "diverged", "tick", "fields": {probe: {rank: value}},
            "ranks", "compared_ticks", "summary"}`` (ranks as strings, values as written in the ledger); None
            otherwise (also every later call).
        """
        if self.divergence is not None or not self.recorded or len(self.ranks) < 2:
            return None
        start = max(t for t in self.first_full.values() if t is not None)
        upto = min(self.last_tick.values())
        lo = start if self.through is None else self.through + 1
        if upto < lo:
            return None
        ticks = sorted({t for r in self.ranks for t, _ in self.snaps[r] if lo <= t <= upto} | {lo})
        seqs = {r: list(self.snaps[r]) for r in self.ranks}
        pos = {r: -1 for r in self.ranks}  # index of the snapshot in force (a merge walk: one pass over each rank's)
        for t in ticks:
            for r in self.ranks:
                q = seqs[r]
                while pos[r] + 1 < len(q) and q[pos[r] + 1][0] <= t:
                    pos[r] += 1
            vals = {r: (seqs[r][pos[r]][1] if pos[r] >= 0 else {}) for r in self.ranks}
            names = sorted({n for v in vals.values() for n in v})
            diff = {p: {r: vals[r].get(p) for r in self.ranks} for p in names
                    if self.kinds.get(p, "lockstep") == "lockstep" and p not in self.skipped
                    and len({json.dumps(vals[r].get(p)) for r in self.ranks}) > 1}
            if diff:
                parts = ["`" + p + "` " + ", ".join(f"rank {r} = {_show(v)}" for r, v in vs.items())
                         for p, vs in diff.items()]
                self.divergence = {
                    "status": "diverged", "tick": t, "ranks": [str(r) for r in self.ranks],
                    "fields": {p: {str(r): v for r, v in vs.items()} for p, vs in diff.items()},
                    "compared_ticks": [start, t],
                    "summary": f"at scheduler tick {t}: " + "; ".join(parts)
                               + f" (ticks {start}–{t} compared)"}
                return self.divergence
        self.through = upto
        for r in self.ranks:  # keep only the snapshot in force at the compared tick
            snaps = self.snaps[r]
            while len(snaps) > 1 and snaps[1][0] <= upto:
                snaps.popleft()
        return None


__all__ = ["LiveState", "MAX_SNAPSHOTS"]
