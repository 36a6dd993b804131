"""A natural action's own events (``fault_outcome``, ``stopped``, …) belong to the arming they came in: on a shared
hunt server a later trial re-arms the same injection id, and its fire must not carry an earlier trial's outcome
(``repro.injection_records._read_log``; found by helper h37f, 2026-12-06: before, the effects were never reset at an
``armed`` event, so trial 2's fire of the same id read trial 1's "thread died")."""

import json
from pathlib import Path

from repro.injection_records import fault_outcomes, read_injector_dir

FID = "io_aux_page_transfer_fault"


def _fire(seq: int, t: float) -> dict:
    return {"event": "fire", "rank": 0, "arm_seq": seq, "id": FID, "time": t, "n": 1, "caller": "x",
            "nature": "natural", "thread": "Thread-7 (prefetch_io_aux_func)", "action": {"kind": "fault"}}


def _write(folder: Path, events: list[dict]) -> None:
    folder.mkdir()
    (folder / "fires-101.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events), encoding="utf-8")


def test_a_later_arming_does_not_inherit_an_earlier_fault_outcome(tmp_path: Path) -> None:
    outcome = {"event": "fault_outcome", "rank": 0, "id": FID, "thread": "Thread-7 (prefetch_io_aux_func)",
               "alive": False, "reentries": 0, "outcome": "thread died", "died_of_fault": True}
    _write(tmp_path / "injector", [{"event": "armed", "rank": 0, "arm_seq": 1, "ids": [FID]}, _fire(1, 10.0), outcome,
                                   {"event": "armed", "rank": 0, "arm_seq": 2, "ids": [FID]}, _fire(2, 50.0)])
    (log,) = read_injector_dir(tmp_path / "injector").logs
    (fire,) = log.fires
    assert fire.arm_seq == 2 and fire.effects == (), fire.effects
    assert fault_outcomes([fire]) == []


def test_the_arming_s_own_outcome_is_kept(tmp_path: Path) -> None:
    outcome = {"event": "fault_outcome", "rank": 0, "id": FID, "thread": "Thread-9 (prefetch_io_aux_func)",
               "alive": True, "reentries": 2, "outcome": "caught", "died_of_fault": False}
    _write(tmp_path / "injector", [{"event": "armed", "rank": 0, "arm_seq": 1, "ids": [FID]}, _fire(1, 10.0),
                                   {"event": "armed", "rank": 0, "arm_seq": 2, "ids": [FID]}, _fire(2, 50.0), outcome])
    (log,) = read_injector_dir(tmp_path / "injector").logs
    (fire,) = log.fires
    assert [e["outcome"] for e in fire.effects] == ["caught"]
