"""A hunt trial's outcome as a record (one row of HUNT.md, one line of hunt.jsonl) and the order HUNT.md lists them in."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from repro.hunt.classify import FAMILY_FORWARD, FAMILY_SCHED, Diagnosis
from repro.hunt.plan import Trial
from repro.verdict import DEADLOCKED, DESYNCED, INCONCLUSIVE, SUCCEEDED

NOT_RUN = "NOT RUN"


@dataclass
class TrialResult:
    """The outcome of one trial (one row of HUNT.md, one line of hunt.jsonl).

    ``to_verdict_s``: seconds from arming to the verdict; ``evidence``/``scenario_file``: paths (scenario only for
    DEADLOCKED); ``entered/matched/fired``: rank -> count after arming; ``confirmed``: the scenario file was re-run
    on a fresh server and deadlocked again (None: not re-run).
    """

    trial: Trial
    verdict: str
    reason: str
    to_verdict_s: float = 0.0
    diagnosis: Optional[Diagnosis] = None
    hazard: str = ""
    evidence: Optional[Path] = None
    scenario_file: Optional[Path] = None
    entered: dict = field(default_factory=dict)
    matched: dict = field(default_factory=dict)
    fired: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    confirmed: Optional[bool] = None
    ledger: str = ""  # the collective ledger's first-divergence sentence (ledger.json), when the run recorded one
    effect: str = ""  # what the perturbation moved in the lockstep state, and where it was reconciled (natural_effect)
    effect_status: str = ""  # one of repro.natural_effect.STATUSES ("" when not read)

    @property
    def nature(self) -> str:
        """natural / forced / control: the perturbation's label (``repro.catalogue.Perturbation.nature``)."""
        return self.trial.perturbation.nature

    @property
    def fired_on_target(self) -> int:
        """How often the action fired on the trial's own rank."""
        return int(self.fired.get(self.trial.rank, 0) or 0)

    @property
    def desync_crash(self) -> bool:
        """The backend caught the desync and aborted a rank (INCONCLUSIVE verdict, mismatch in the server log)."""
        return self.verdict != DEADLOCKED and self.diagnosis is not None and self.diagnosis.crash is not None

    def to_json(self) -> dict:
        t = self.trial
        return {
            "n": t.n, "trial": t.name, "workload": t.workload, "point": t.row.point, "caller": t.row.caller, "loop_frame": t.row.loop_frame,
            "loop_var": t.row.loop_var, "server": t.row.server, "row": t.row.where, "perturbation": t.perturbation.name, "rank": t.rank,
            "action": t.perturbation.action, "by_construction": t.perturbation.by_construction, "verdict": self.verdict, "reason": self.reason,
            "to_verdict_s": round(self.to_verdict_s, 2),
            "diagnosis": asdict(self.diagnosis) if self.diagnosis else None, "hazard": self.hazard,
            "evidence": str(self.evidence) if self.evidence else None,
            "scenario_file": str(self.scenario_file) if self.scenario_file else None,
            "entered": {str(k): v for k, v in self.entered.items()}, "matched": {str(k): v for k, v in self.matched.items()},
            "fired": {str(k): v for k, v in self.fired.items()}, "notes": list(self.notes), "confirmed": self.confirmed,
            "desync_crash": self.desync_crash, "ledger": self.ledger, "nature": self.nature, "effect": self.effect,
            "effect_status": self.effect_status, "fired_on_target": self.fired_on_target,
            "time": time.time(),
        }


def rank_key(r: TrialResult) -> tuple:
    """Sort order of HUNT.md: natural deadlocks and desyncs first, then natural divergences without a hang (a first
    divergent state, requests answered), then the other natural rows, then forced and control rows; within each:
    scheduling/cache deadlocks first, then forward ones, other deadlocks, the rest."""
    if r.nature == "natural":
        hang = r.verdict in (DEADLOCKED, DESYNCED) or r.desync_crash
        tier = 0 if hang else (1 if r.effect_status == "diverged" else 2)
    else:
        tier = 3
    return (tier,) + _verdict_key(r)


def _verdict_key(r: TrialResult) -> tuple:
    d = r.diagnosis
    if r.verdict == DEADLOCKED:
        fam = 0 if d and d.family == FAMILY_SCHED else (1 if d and d.family == FAMILY_FORWARD else 2)
        return (0, fam, (2 if r.trial.perturbation.by_construction else (1 if d and d.known else 0)), r.trial.n)
    if r.desync_crash:
        return (1, 0 if d and d.family == FAMILY_SCHED else 1, 0, r.trial.n)
    if r.verdict == DESYNCED:  # the ledgers proved the ranks' collectives differ: next to the desync crashes
        return (1, 0 if d and d.family == FAMILY_SCHED else 1, 0, r.trial.n)
    order = {INCONCLUSIVE: 2, SUCCEEDED: 3, NOT_RUN: 4}
    return (order.get(r.verdict, 5), 0, 0, r.trial.n)
