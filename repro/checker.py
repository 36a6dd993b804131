"""The checker's confirm step, shared by ``repro run``, ``repro watch`` and ``repro hunt``.

Capture every rank, wait ``confirm_gap_s``, capture again, measure each rank's CPU use across both captures,
analyse both and apply the DEADLOCKED rule (``repro.verdict.judge_stall``). Collection (``repro.capture``) never
imports analysis; this module is where the two meet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import psutil

from repro.analysis import Analysis, analyze, frames_unchanged
from repro.capture import capture_ranks
from repro.stacks import RankCapture
from repro.verdict import StallJudgement, judge_stall

CONFIRM_GAP_S = 1.0  # seconds between the first capture and the confirming one


def cpu_seconds(pids: Mapping[int, int]) -> dict[int, float]:
    """rank -> user+system CPU seconds used so far by that rank's process; ranks whose process is gone are left out."""
    out: dict[int, float] = {}
    for rank, pid in pids.items():
        try:
            t = psutil.Process(pid).cpu_times()
            out[rank] = t.user + t.system
        except psutil.Error:
            pass
    return out


@dataclass(frozen=True)
class StallCheck:
    """Two captures of every rank ``confirm_gap_s`` apart, their analyses and the judgement on them.

    ``cpu_percent``: rank -> share of one core (percent) used between the start of the first capture and the end
    of the second.
    """

    first: Sequence[RankCapture]
    second: Sequence[RankCapture]
    first_analysis: Analysis
    second_analysis: Analysis
    unchanged: bool
    cpu_percent: Mapping[int, float]
    judgement: StallJudgement


def check_stall(
    rank_pids: Mapping[int, int],
    stacks_dir: Path,
    expected_ranks: Sequence[int],
    *,
    tag: str = "",
    second_tag: Optional[str] = None,
    confirm_gap_s: float = CONFIRM_GAP_S,
    **capture_kw: Any,
) -> StallCheck:
    """Capture all ranks twice and judge whether they are deadlocked (DESIGN §1).

    Args:
        rank_pids: rank -> pid of that rank's process.
        stacks_dir: where ``rank<k>{tag}.txt|.json`` (first) and ``rank<k>{second_tag}.*`` (confirming) go.
        expected_ranks: every rank the job has (a rank missing from the captures blocks a DEADLOCKED call).
        tag / second_tag: file-name tags of the two captures (default second tag: ``tag + "b"``).
        confirm_gap_s: seconds between the two captures.
        capture_kw: passed to ``repro.capture.capture_ranks`` (timeout_s, native, injector_dir, fallback_signal).
    Returns:
        A StallCheck; ``judgement.deadlocked`` only when every rule holds.
    Raises:
        OSError: ``stacks_dir`` cannot be written.
    """
    cpu0, t0 = cpu_seconds(rank_pids), time.time()
    first = capture_ranks(rank_pids, stacks_dir, tag=tag, **capture_kw)
    time.sleep(confirm_gap_s)
    second = capture_ranks(rank_pids, stacks_dir, tag=tag + "b" if second_tag is None else second_tag, **capture_kw)
    cpu1, t1 = cpu_seconds(rank_pids), time.time()
    cpu_pct = {k: 100.0 * (cpu1[k] - cpu0[k]) / max(1e-3, t1 - t0) for k in cpu0 if k in cpu1}
    a1, a2 = analyze(first), analyze(second)
    unchanged = frames_unchanged(first, second)
    return StallCheck(first, second, a1, a2, unchanged, cpu_pct, judge_stall(a1, a2, unchanged, cpu_pct, expected_ranks))
