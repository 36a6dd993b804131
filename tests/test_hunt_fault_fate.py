"""A natural ``fault`` trial's hunt row says what became of the faulted thread (round 4 of issue 29, left by h29b):
the injector's ``fault_outcome`` event (injectors/repro_injector/_natural.py) is read with the fire it follows
(``repro.injection_records.FireEvent.effects``) and ``repro.hunt.loop.fault_fates`` adds it to the effect sentence.
Before, HUNT.md's effect column had only the lockstep-state sentence and the thread's death stayed in the fire log."""

import json
from pathlib import Path

from repro.hunt.loop import fault_fates
from repro.injection_records import read_injector_dir


def _fire_log(folder: Path, pid: int, events: list[dict]) -> None:
    (folder / f"fires-{pid}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events), encoding="utf-8")


def test_the_fault_outcome_reaches_the_rows_effect(tmp_path: Path) -> None:
    _fire_log(tmp_path, 101, [
        {"event": "armed", "rank": 0, "arm_seq": 1, "ids": ["io_aux_fault"]},
        {"event": "fire", "rank": 0, "arm_seq": 1, "id": "io_aux_fault", "time": 10.0, "n": 1, "caller": "x",
         "nature": "natural", "thread": "prefetch_io_aux", "action": {"kind": "fault"}},
        {"event": "fault_outcome", "rank": 0, "id": "io_aux_fault", "thread": "prefetch_io_aux", "alive": False,
         "reentries": 0, "outcome": "thread died", "died_of_fault": True},
    ])
    _fire_log(tmp_path, 102, [
        {"event": "armed", "rank": 1, "arm_seq": 1, "ids": ["io_aux_fault"]},
    ])
    fires = [f for log in read_injector_dir(tmp_path).logs for f in log.fires if f.rank == 0]
    assert len(fires) == 1 and fires[0].effects, fires
    assert fault_fates(fires) == "; fault on thread prefetch_io_aux: thread died"


def test_no_fault_no_words(tmp_path: Path) -> None:
    _fire_log(tmp_path, 7, [
        {"event": "armed", "rank": 0, "arm_seq": 1, "ids": ["d"]},
        {"event": "fire", "rank": 0, "arm_seq": 1, "id": "d", "time": 1.0, "n": 1, "caller": "x", "nature": "natural",
         "thread": "MainThread", "action": {"kind": "delay"}},
        {"event": "clock_shifted", "rank": 0, "id": "d"},
    ])
    fires = [f for log in read_injector_dir(tmp_path).logs for f in log.fires]
    assert fault_fates(fires) == ""
