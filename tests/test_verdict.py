"""The verdict rules of DESIGN §1, on records (no server): each rule blocks DEADLOCKED / SUCCEEDED on its own."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from repro.driver import RequestRecord
from repro.verdict import (
    DEADLOCKED,
    INCONCLUSIVE,
    SUCCEEDED,
    InjectionCheck,
    exit_code_for,
    judge_completion,
    judge_stall,
)


def _analysis(states: dict[int, str], diverged: bool, summary: str = "rank 0 in all_reduce; rank 1 in broadcast") -> NS:
    return NS(ranks=[NS(rank=k, state=s) for k, s in states.items()], diverged=diverged, summary=summary)


HUNG = _analysis({0: "collective", 1: "collective"}, True)
IDLE_CPU = {0: 0.5, 1: 1.0}


def test_disagreeing_blocked_ranks_are_a_deadlock():
    j = judge_stall(HUNG, HUNG, True, IDLE_CPU, [0, 1])
    assert j.deadlocked and "rank 0" in j.reason


def test_a_busy_rank_is_not_a_deadlock_and_is_named():
    busy = _analysis({0: "collective", 1: "busy"}, True)
    j = judge_stall(HUNG, busy, True, IDLE_CPU, [0, 1])
    assert not j.deadlocked and j.busy_ranks == (1,) and "1" in j.reason


def test_a_rank_on_cpu_is_not_a_deadlock():
    j = judge_stall(HUNG, HUNG, True, {0: 0.2, 1: 85.0}, [0, 1])
    assert not j.deadlocked and "85%" in j.reason


def test_idle_ranks_in_the_same_collective_are_not_a_deadlock():
    agree = _analysis({0: "collective", 1: "collective"}, False, "both ranks in broadcast ← broadcast_pyobj")
    j = judge_stall(agree, agree, True, IDLE_CPU, [0, 1])
    assert not j.deadlocked and j.reason.startswith("ranks agree")


def test_all_idle_waiting_is_not_a_deadlock():
    idle = _analysis({0: "idle-wait", 1: "idle-wait"}, True)
    assert not judge_stall(idle, idle, True, IDLE_CPU, [0, 1]).deadlocked


def test_moving_frames_are_not_a_deadlock():
    j = judge_stall(HUNG, HUNG, False, IDLE_CPU, [0, 1])
    assert not j.deadlocked and "changed" in j.reason


def test_an_uncaptured_rank_blocks_the_call():
    one = _analysis({0: "collective"}, True)
    j = judge_stall(one, one, True, IDLE_CPU, [0, 1])
    assert not j.deadlocked and "1" in j.reason


def _ok(i: int, n: int = 4) -> RequestRecord:
    return RequestRecord(i, 8, n, status="ok", output_len=n, finish_reason="length", http_status=200)


CHECK = InjectionCheck("x", "m:C.f", {0: 5, 1: 5}, {0: 1, 1: 0}, {0: 1, 1: 0})


def test_success_needs_every_site_entered_on_every_rank():
    v = judge_completion([_ok(0), _ok(1)], [0, 1], [0, 1], [0, 1], [CHECK])
    assert v.verdict == SUCCEEDED and any("fired 1" in n for n in v.notes)
    never = InjectionCheck("x", "m:C.f", {0: 3}, {0: 0}, {0: 0})
    v = judge_completion([_ok(0)], [0, 1], [0, 1], [0, 1], [never])
    assert v.verdict == INCONCLUSIVE and "m:C.f" in v.reason and "rank(s) 1" in v.reason


def test_a_counter_that_is_not_required_may_stay_at_zero_and_its_per_rank_counts_are_noted():
    counter = InjectionCheck("aborts", "m:C.f", {0: 2}, {0: 2}, {0: 0}, required=False)
    v = judge_completion([_ok(0)], [0, 1], [0, 1], [0, 1], [CHECK, counter])
    assert v.verdict == SUCCEEDED and any(n.startswith("aborts:") and "TP0 2, TP1 0" in n for n in v.notes)
    absent = InjectionCheck("aborts", "m:C.f", {}, {}, {}, absent="no such class", required=False)
    assert judge_completion([_ok(0)], [0, 1], [0, 1], [0, 1], [absent]).verdict == INCONCLUSIVE  # still a bad site


def test_gate_never_matching_is_said_in_words():
    unmatched = InjectionCheck("x", "m:C.f", {0: 2, 1: 2}, {}, {})
    v = judge_completion([_ok(0)], [0, 1], [0, 1], [0, 1], [unmatched])
    assert v.verdict == SUCCEEDED and "never matched" in v.notes[0]


def test_injector_not_loaded_or_not_armed_is_inconclusive():
    assert "not loaded on rank(s) 1" in judge_completion([_ok(0)], [0, 1], [0], [0, 1], [CHECK]).reason
    assert "never seen by rank(s) 0" in judge_completion([_ok(0)], [0, 1], [0, 1], [1], [CHECK]).reason


def test_a_short_answer_is_an_error_not_a_success():
    short = RequestRecord(0, 8, 4, status="ok", output_len=3, finish_reason="abort", http_status=200)
    v = judge_completion([short, _ok(1)], [0, 1], [0, 1], [0, 1], [CHECK])
    assert v.verdict == INCONCLUSIVE and v.reason.startswith("requests errored: 1 of 2")


@pytest.mark.parametrize(
    "verdict,expect,code",
    [(DEADLOCKED, None, 3), (SUCCEEDED, None, 0), (INCONCLUSIVE, None, 4), (DEADLOCKED, "deadlock", 0),
     (DEADLOCKED, "success", 5), (INCONCLUSIVE, "inconclusive", 0)],
)
def test_exit_codes(verdict, expect, code):
    assert exit_code_for(verdict, expect) == code
