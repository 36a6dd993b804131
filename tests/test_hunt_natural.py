"""`repro hunt --natural`: the natural catalogue holds only natural nemeses plus one control row (a forced
catalogue is refused with the perturbations named); HUNT.md rows carry nature, fires on the target rank and the
state effect; natural deadlocks/desyncs rank first, then natural divergences without a hang, then forced/control."""

from __future__ import annotations

from pathlib import Path

import pytest

from repro.catalogue import HuntError, Perturbation, check_natural, hunt_catalogue, load_catalogue
from repro.hunt.plan import Row, Trial
from repro.hunt.report import HuntLog
from repro.hunt.results import TrialResult, rank_key
from repro.verdict import DEADLOCKED, SUCCEEDED

REPO = Path(__file__).resolve().parent.parent
NATURAL = REPO / "scenarios/sglang/natural_nemeses.toml"


def test_the_sglang_natural_catalogue_is_natural_but_its_one_control():
    cat = load_catalogue(NATURAL)
    check_natural(cat)
    natures = {p.nature for p in cat.perturbations.values()}
    assert natures == {"natural", "control"}
    assert [n for n, p in cat.perturbations.items() if p.control] == ["control_leak_one_slot"]
    assert hunt_catalogue("sglang", natural=True) == NATURAL.resolve() or hunt_catalogue("sglang", natural=True).name == NATURAL.name
    kinds = {p.action["kind"] for p in cat.perturbations.values() if not p.control}
    assert kinds == {"delay", "stop", "clock", "fault", "pending", "miss", "fail"}


def test_a_forced_catalogue_is_refused_by_natural_naming_the_forced_perturbations():
    cat = load_catalogue(REPO / "scenarios/sglang/hunt_catalogue.toml")
    with pytest.raises(HuntError) as e:
        check_natural(cat)
    assert "zero_once" in str(e.value) and "control = true" in str(e.value)


def _res(n: int, pert: Perturbation, verdict: str, effect_status: str = "", effect: str = "") -> TrialResult:
    row = Row("p", "m:Caller.f", None, None)
    r = TrialResult(Trial(n, row, pert, 0), verdict, "", fired={0: 1, 1: 0})
    r.effect_status, r.effect = effect_status, effect
    return r


DELAY = Perturbation("delay_2s", {"kind": "delay", "delay_s": 2.0}, "takes 2 s longer")
FAULT = Perturbation("fault_once", {"kind": "fault"}, "raises once")
FORCED = Perturbation("zero_once", {"kind": "return_value", "value": 0}, "returns 0")
CONTROL = Perturbation("control_leak", {"kind": "state", "pool": "req_to_token_pool", "take": 1}, "leaks", control=True)


def test_natural_hangs_rank_first_then_natural_divergences_then_forced():
    forced_dl = _res(1, FORCED, DEADLOCKED)
    control = _res(2, CONTROL, SUCCEEDED, "diverged")
    quiet = _res(3, DELAY, SUCCEEDED, "none moved")
    diverged = _res(4, FAULT, SUCCEEDED, "diverged")
    natural_dl = _res(5, FAULT, DEADLOCKED)
    order = [r.trial.n for r in sorted([forced_dl, control, quiet, diverged, natural_dl], key=rank_key)]
    assert order == [5, 4, 3, 1, 2]


def test_hunt_rows_show_nature_fires_on_the_target_rank_and_the_effect(tmp_path: Path):
    log = HuntLog(tmp_path, {"scenario": "s"})
    log.add(_res(1, FAULT, SUCCEEDED, "reconciled", "`hits` differed at tick 3, equal again at tick 5"))
    log.add(_res(2, CONTROL, SUCCEEDED, "diverged", "`req_to_token_pool.available` differs from tick 9"))
    md = (tmp_path / "HUNT.md").read_text()
    assert "| nature | rank | fired on rank |" in md
    assert "| fault_once | natural | 0 | 1 | ALL REQUESTS SUCCEEDED" in md or "| fault_once | natural | 0 | 1 |" in md
    assert "equal again at tick 5" in md and "| control_leak | control |" in md
    rec = log.results[0].to_json()
    assert rec["nature"] == "natural" and rec["fired_on_target"] == 1 and rec["effect_status"] == "reconciled"


def test_a_trial_whose_nemesis_outlives_it_gets_a_fresh_server_for_the_next_trial(tmp_path: Path) -> None:
    """A fault can kill the thread it hit and a clock shift stays in the process: on a shared trial server the next
    trial would run against that (measured: an io-aux fault on rank 0, then a crash in the next trial). Each such
    trial is followed by a restart; a delay is not."""
    import repro.hunt as H
    from tests.test_hunt import BASE, FakeRunner

    src = (REPO / "scenarios/sglang/hunt_catalogue.toml").read_text()
    cat = tmp_path / "hunt_catalogue.toml"
    cat.write_text(src.replace('perturbations = ["zero_once", "minus_one", "plus_one", "delay_once"]',
                               'perturbations = ["zero_once", "minus_one", "plus_one", "delay_once", "fault_once"]', 1)
                   + '\n[perturbations.fault_once]\naction = { kind = "fault" }\nsays = "raises once"\n')
    (tmp_path / "hunt_workloads.toml").write_text((REPO / "scenarios/sglang/hunt_workloads.toml").read_text())
    fr = FakeRunner({})
    res = H.hunt(H.HuntOptions(scenario_path=BASE, evidence_root=tmp_path / "ev", only=("get_num_allocatable_reqs",),
                               perturbations=("fault_once", "delay_once"), catalogue_path=cat, spare=False), runs=fr)
    assert len(res.results) == 8
    trial_s = fr.sessions[1]
    # order per row: delay r0, delay r1, fault r0, fault r1; 4 fault trials, the last of them last of all: 3 restarts
    faults = [r.trial.n for r in res.results if r.trial.perturbation.name == "fault_once"]
    assert len(faults) == 4 and trial_s.starts == 1 + sum(1 for n in faults if n < 8)


def test_workload_baseline_probes_are_observe_only_counters_so_an_unreached_point_is_a_row_less(tmp_path: Path):
    """Measured: `repro hunt --natural --config …` failed both groups' clean runs because one catalogue point (the
    storage hit query) was never entered; a point a workload never reaches must only mean no row."""
    from repro.scenario import load_scenario
    from repro.scenario_toml import scenario_toml

    base = load_scenario(REPO / "scenarios/sglang/natural_hunt_hicache.toml")
    text = scenario_toml(base, base.name, "x", [("v", "success", "d", [
        {"id": "p", "site": ["m:f"], "action": {"kind": "none", "record_callers": True},
         "gate": {"occurrence": {"mode": "every"}}, "required": False}])])
    f = tmp_path / "s.toml"
    f.write_text(text)
    assert load_scenario(f).variants[0].injections[0].required is False
    src = (REPO / "repro/hunt/loop.py").read_text()
    assert '"gate": {"occurrence": {"mode": "every"}}, "required": False}' in src  # the workload baseline's probes
