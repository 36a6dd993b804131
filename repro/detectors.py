"""THE detector set of every topology (:func:`detector_set`): a rank that died (``repro.checker``), the ledger proof
(``repro.proof``, when the plan's ledger is on), then the stall rule (:class:`StallDetector`: no progress for
``stall_s`` → capture every rank twice → the DEADLOCKED rule). The protocol they follow: :mod:`repro.detect`."""

from __future__ import annotations

import time
from typing import Any, Mapping, Optional

from repro.detect import DetectContext, Detection, Detector
from repro.verdict import DEADLOCKED, Verdict


class StallDetector:
    """No progress for ``stall_s`` → capture every rank twice 1 s apart → the DEADLOCKED rule.

    Captures at most once per ``stall_s`` (the n-th capture's files are tagged ``-n`` / ``-nb`` in ``stacks/``).
    """

    name = "stall"

    def __init__(self) -> None:
        self.captures = 0
        self.last_capture_t = 0.0

    def start(self, ctx: DetectContext) -> None:
        self.captures = 0
        self.last_capture_t = 0.0

    def poll(self, ctx: DetectContext) -> Optional[Detection]:
        from repro.checker import check_stall

        stalled = ctx.state.stalled_for(ctx.now) if ctx.state is not None else 0.0
        if stalled < ctx.stall_s or ctx.now - self.last_capture_t < ctx.stall_s:
            return None
        self.captures += 1
        tag = f"-{self.captures}"
        ctx.emit("capture", {"n": self.captures, "stalled_s": stalled})
        chk = check_stall(ctx.rank_pids, ctx.run_dir.stacks_dir, list(ctx.expected_ranks), tag=tag, native=ctx.native,
                          injector_dir=ctx.injector_dir, fallback_signal=ctx.plan.get("faulthandler_signal"))
        j = chk.judgement
        self.last_capture_t = time.time()
        ctx.emit("judged", {"judgement": j, "analysis": chk.second_analysis})
        record = {"capture": self.captures, "tag": tag, "stalled_s": round(stalled, 2), "deadlocked": j.deadlocked,
                  "reason": j.reason, "cpu_percent": {str(k): round(v, 1) for k, v in chk.cpu_percent.items()},
                  "time": self.last_capture_t}
        return Detection(self.name, j.deadlocked, Verdict(DEADLOCKED, j.reason) if j.deadlocked else None,
                         chk.second_analysis, j.reason, record)

    def stop(self, ctx: DetectContext) -> None:
        pass


def detector_set(plan: Optional[Mapping[str, Any]], stall: Any = None) -> list[Detector]:
    """THE detector set of every topology: rank death, ledger proof (when the plan's ledger is on), then the stall
    rule (``stall``: the topology's own stall detector — a stack's captures every server; default
    :class:`StallDetector`). ``repro.pd`` scopes the first two to each server (:class:`ScopedDetector`)."""
    out = default_detectors(plan)
    return out[:-1] + [stall if stall is not None else out[-1]]


def default_detectors(plan: Optional[Mapping[str, Any]] = None) -> list[Detector]:
    """The detectors a run uses, in polling order: a rank that died (``repro.checker.RankDeathDetector``), the ledger proof (``repro.proof.LedgerProofDetector``, when the
    plan's ledger is on), then the stall rule. ``plan``: the session's plan."""
    from repro.proof import LedgerProofDetector

    from repro.checker import RankDeathDetector

    led = (plan or {}).get("ledger") or {}
    # a dead rank first: its survivors wait in a collective it will never join, which is a crash, not a deadlock
    return [RankDeathDetector()] + ([LedgerProofDetector()] if led.get("enabled") else []) + [StallDetector()]
