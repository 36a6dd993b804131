"""A run's REPORT.md says what became of the thread a natural ``fault`` raised in (round 4 of issue 29, R4): the
injector's ``fault_outcome`` event (injectors/repro_injector/_natural.py) is read into the injection's check
(``repro.run.records.injection_checks`` → ``InjectionCheck.outcomes``) and the injections section lists it per rank.
Before, the hunt row said it (e4c96b3) but REPORT.md showed only entered/matched/fired, and the io-aux thread's death
stayed in the fire log."""

import json
from pathlib import Path

from repro.report import ReportInput, render_report
from repro.run.records import injection_checks
from repro.scenario import load_scenario
from repro.verdict import INCONCLUSIVE, Verdict

SCENARIO = Path(__file__).resolve().parents[1] / "scenarios/sglang/natural_hicache_io_aux_fault_wait_complete.toml"
FAULT_ID = "io_aux_page_transfer_fault"


def _fire_log(folder: Path, pid: int, events: list[dict]) -> None:
    (folder / f"fires-{pid}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events), encoding="utf-8")


def _report(tmp_path: Path, rank0_events: list[dict]) -> str:
    inj = tmp_path / "injector"
    inj.mkdir()
    counts = {"event": "counts", "arm_seq": 1, "counts": {FAULT_ID: {"entered": 1, "matched": 1, "fired": 1}}}
    _fire_log(inj, 101, [{"event": "armed", "rank": 0, "arm_seq": 1, "ids": [FAULT_ID]}, {**counts, "rank": 0},
                         *rank0_events])
    _fire_log(inj, 102, [{"event": "armed", "rank": 1, "arm_seq": 1, "ids": [FAULT_ID]},
                         {"event": "counts", "rank": 1, "arm_seq": 1,
                          "counts": {FAULT_ID: {"entered": 2, "matched": 0, "fired": 0}}}])
    variant = next(v for v in load_scenario(SCENARIO).variants if v.name == "io_aux_fault")
    checks = injection_checks(inj, variant, {0: 101, 1: 102})[2]
    stacks = tmp_path / "stacks"
    stacks.mkdir()
    return render_report(ReportInput(scenario="s", variant="io_aux_fault", variant_expects="deadlock",
                                     verdict=Verdict(INCONCLUSIVE, "stalled"), stacks_dir=stacks, command="repro run s",
                                     has_injections=True, ranks=[0, 1], checks=checks))


def test_report_says_the_faulted_thread_died(tmp_path: Path) -> None:
    fire = {"event": "fire", "rank": 0, "arm_seq": 1, "id": FAULT_ID, "time": 10.0, "n": 1, "caller": "x",
            "nature": "natural", "thread": "Thread-7 (prefetch_io_aux_func)", "action": {"kind": "fault"}}
    outcome = {"event": "fault_outcome", "rank": 0, "id": FAULT_ID, "thread": "Thread-7 (prefetch_io_aux_func)",
               "alive": False, "reentries": 0, "outcome": "thread died", "died_of_fault": True}
    text = _report(tmp_path, [fire, outcome])
    section = text.split("## Injections", 1)[1].split("## Requests", 1)[0]
    assert f"- `{FAULT_ID}` on TP0: fault on thread Thread-7 (prefetch_io_aux_func): thread died" in section, section
    assert "on TP1:" not in section


def test_report_has_no_outcome_line_when_nothing_fired(tmp_path: Path) -> None:
    text = _report(tmp_path, [])
    section = text.split("## Injections", 1)[1].split("## Requests", 1)[0]
    assert "fault on thread" not in section and " on TP0:" not in section, section


def test_report_says_whether_the_run_gave_what_its_variant_expects(tmp_path: Path) -> None:
    """The demo's report said only "expects **deadlock**" under a DEADLOCKED verdict (newcomer pass): it now says the
    run gave it, or what it gave instead."""
    from repro.verdict import DEADLOCKED

    stacks = tmp_path / "stacks"
    stacks.mkdir()

    def line(v: str) -> str:
        text = render_report(ReportInput(scenario="s", variant="x", variant_expects="deadlock", verdict=Verdict(v, "r"),
                                         stacks_dir=stacks, command="repro run s", has_injections=False, ranks=[0, 1]))
        return next(ln for ln in text.splitlines() if ln.startswith("Variant `x` expects"))

    assert "**deadlock** — this run gave it, as the variant is written to." in line(DEADLOCKED)
    assert "**deadlock** — this run gave INCONCLUSIVE instead." in line(INCONCLUSIVE)
