"""The ledger diagnosis of a run (:class:`LedgerDiagnosis`, :func:`diagnose`): the alignment with its state digest and
its report lines."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Mapping, Optional, Union

from repro.diagnosis import DivergenceKind, md_cell
from repro.evidence import Layout
from repro.ledger.align import _group_info, _summary, align, check_consistent, divergence_tick, per_tick_counts
from repro.ledger.load import load_ledgers, rank_pids_of
from repro.ledger.types import Divergence, RankLedger
from repro.state_digest import StateDivergence, diagnose_state


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
    unread: list[str] = field(default_factory=list)  # ledgers that should be there and could not be read, and why

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
                "unread": self.unread,
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
    Returns:
        The LedgerDiagnosis; a rank pid without a readable ledger (or, with no pids, a group rank without one) is in
        ``unread``, and then a comparison that found no divergence says the ledgers cannot be aligned — the ranks
        read do not stand for the group.
    """
    why: dict[int, str] = {}
    leds = load_ledgers(folder, pids, unread=why)
    if not leds:
        return None
    div = align(leds)
    unread = [f"pid {pid}: {w}" for pid, w in sorted(why.items())]
    absent = sorted({r for led in leds.values() for g in led.groups.values() for r in g.ranks} - set(leds))
    if absent and not unread:  # no pid list to name them by: the groups' ranks say who is missing
        unread = [f"rank {r}: no readable ledger" for r in absent]
    if unread and div.kind == DivergenceKind.NONE:  # one side of the comparison is missing: never "they agree"
        read = ", ".join(f"rank {r} ({len(led.records)} records)" for r, led in sorted(leds.items()))
        div = replace(div, summary=f"The ledgers cannot be aligned: {'; '.join(unread)}; read: {read}.")
    return LedgerDiagnosis(leds, div, per_tick_counts(leds), check_consistent(leds),
                           state=diagnose_state(leds, collective_tick=divergence_tick(div)), unread=unread)


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
