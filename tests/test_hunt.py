"""repro hunt without a server: catalogue, rows from the baseline's ``seen`` events, gates, diagnosis, generated
scenario files, and the hunt loop's bookkeeping (streaming, restarts, budget, interrupt) with a stand-in runner."""

from __future__ import annotations

import dataclasses
import json
import time
import types
from pathlib import Path
from typing import Any, Optional

import pytest

from repro import evidence as ev
from repro import hunt as H
from repro.hunt import loop as HL
from repro import runner as real_runner
from repro.driver import DriverState
from repro.scenario import compile_plan, load_scenario
from repro.verdict import DEADLOCKED, INCONCLUSIVE, SUCCEEDED, InjectionCheck, Verdict
from repro.targets.registry import get_adapter

REPO = Path(__file__).resolve().parent.parent
BASE = REPO / "scenarios" / "sglang" / "hicache_prefetch_30760.toml"
PREFILL = "sglang.srt.managers.scheduler:Scheduler._get_new_batch_prefill_raw"
GNAR = "sglang.srt.managers.scheduler:Scheduler.get_num_allocatable_reqs"


@pytest.fixture(autouse=True)
def _no_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(HL, "SETTLE_S", 0.0)  # the stand-in server never crashes late unless a test says so


def _seen(point: str, stack: list[str], loops: list[list[str]], rank: Optional[int] = 0) -> dict:
    return {"event": "seen", "id": f"probe-{point}", "rank": rank, "caller": stack[0], "stack": stack, "loops": loops}


# ---------------------------------------------------------------------------------------------------- catalogue
def test_shipped_catalogue_loads_and_names_the_issue_points() -> None:
    cat = H.load_catalogue()
    names = {p.name for p in cat.points}
    for needed in ("get_num_allocatable_reqs", "req_to_token_available_size", "kv_available_size", "pop_bootstrapped",
                   "perf_counter", "check_hicache_events"):
        assert needed in names
    assert cat.point("get_num_allocatable_reqs").perturbations[0] == "zero_once"
    assert any("_can_terminate_prefetch" in f for n in cat.named for f in n.frames)


def test_catalogue_errors_name_the_field_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(H.HuntError, match="hunt catalogue not found"):
        H.load_catalogue(tmp_path / "nope.toml")
    bad = tmp_path / "c.toml"
    bad.write_text('[perturbations.z]\naction = { kind = "return_value", value = 0 }\n'
                   '[[points]]\nname = "p"\nsite = "m:C.f"\nperturbations = ["zero"]\n')
    with pytest.raises(H.HuntError, match=r"points\[0\].perturbations: unknown \['zero'\]; defined: \['z'\]"):
        H.load_catalogue(bad)
    bad.write_text('[perturbations.z]\naction = { kind = "explode" }\n[[points]]\nname = "p"\nsite = "m:C.f"\n')
    with pytest.raises(H.HuntError, match="perturbations.z.action is not a valid injection action"):
        H.load_catalogue(bad)
    bad.write_text('[perturbations.z]\naction = { kind = "skip" }\n[[points]]\nname = "p"\nsite = "not a site"\n')
    with pytest.raises(H.HuntError, match=r"points\[0\].site"):
        H.load_catalogue(bad)
    with pytest.raises(H.HuntError, match="no decision point 'nope'; known: "):
        H.load_catalogue().point("nope")


SHIPPED = REPO / "scenarios/sglang/hunt_catalogue.toml"


@pytest.mark.parametrize("old,new,says", [
    ('perturbations = ["zero_once", "minus_one"', 'perturbation = ["zero_once", "minus_one"',
     r"points\[0\] \(name = 'get_num_allocatable_reqs'\): unknown field 'perturbation'; did you mean 'perturbations'\?"),
    ("callers = [", "caller = [", r"unknown field 'caller'; did you mean 'callers'\?"),
    ("by_construction = true", 'by_construction = "false"',
     r"perturbations.skip_collective_once.by_construction: expected a TOML boolean .*\(got \"false\", a string\)"),
    ('says = "returns 0 once"', 'says = "returns 0 once"\nsay = "x"', r"perturbations.zero_once: unknown field 'say'; did you mean 'says'"),
    ("version = 1", "version = 99", "version = 99: this harness reads hunt catalogue version"),
    ("version = 1", 'version = "1"', r"version: expected an integer \(got \"1\", a string\)"),
    ("version = 1", "version = 1\nbogus_top = 3", "top level: unknown field 'bogus_top'; expected one of: version, "),
    ("[[known]]", "[[knwon]]", "top level: unknown field 'knwon'; did you mean 'known'"),
    ("[[classify.named]]", "[[classify.nmed]]", "classify: unknown field 'nmed'; did you mean 'named'"),
    ("owner = ", "ownr = ", r"sites.apis.GroupCoordinator: unknown field 'ownr'; did you mean 'owner'"),
])
def test_a_catalogue_typo_or_wrong_type_is_refused_naming_the_entry_and_nearest_field(tmp_path: Path, old, new, says) -> None:
    """The catalogue was read with .get(): `perturbation = [...]` left a point with no perturbation, `caller = [...]`
    dropped its clock-call filter, `by_construction = "false"` read as True, `version = 99` and unknown keys passed."""
    text = SHIPPED.read_text()
    assert old in text, old
    bad = tmp_path / "c.toml"
    bad.write_text(text.replace(old, new, 1))
    with pytest.raises(H.HuntError, match=says):
        H.load_catalogue(bad)


def test_a_hunt_with_a_typo_in_its_catalogue_starts_no_server(tmp_path: Path) -> None:
    cat = tmp_path / "c.toml"
    cat.write_text(SHIPPED.read_text().replace("callers = [", "caller = [", 1))
    fr = FakeRunner({})
    with pytest.raises(H.HuntError, match="did you mean 'callers'"):
        H.hunt(_opts(tmp_path, catalogue_path=cat), runs=fr)
    assert not fr.sessions and not fr.driven


def test_every_shipped_catalogue_loads() -> None:
    root = SHIPPED.parent.parent
    cats = sorted(root.glob("*/hunt_catalogue.toml")) + sorted(root.glob("*/natural_nemeses.toml"))
    assert len(cats) >= 3
    for c in cats:
        assert H.load_catalogue(c).points, c


# --------------------------------------------------------------------------------------------------------- rows
def test_a_point_called_before_and_inside_the_admission_loop_gives_two_rows() -> None:
    cat = H.load_catalogue()
    seen = [
        _seen("get_num_allocatable_reqs", [PREFILL, "m:Scheduler.get_new_batch_prefill"], [[], []]),
        _seen("get_num_allocatable_reqs", [PREFILL, "m:Scheduler.get_new_batch_prefill"], [["req"], []]),
        _seen("get_num_allocatable_reqs", [PREFILL, "m:Scheduler.get_new_batch_prefill"], [["req"], []], rank=1),
        _seen("get_num_allocatable_reqs", [PREFILL], [["req"]], rank=None),  # HTTP server / detokenizer: ignored
    ]
    rows = H.rows_from_seen(cat, seen, {"probe-get_num_allocatable_reqs": "get_num_allocatable_reqs"})
    assert [(r.loop_var, r.ranks) for r in rows] == [(None, (0,)), ("req", (0, 1))]
    before, inside = rows
    assert before.where == "Scheduler._get_new_batch_prefill_raw, outside loops"
    assert inside.where == "Scheduler._get_new_batch_prefill_raw, in `for req`"
    assert inside.gate(0) == {"called_from": [PREFILL], "inside_loop": "req", "max_depth": 1, "ranks": [0],
                              "occurrence": {"mode": "first"}}
    assert before.gate(1) == {"called_from": [PREFILL], "max_depth": 1, "ranks": [1], "occurrence": {"mode": "first"}}


def test_a_loop_in_the_callers_caller_names_both_frames_in_the_gate() -> None:
    cat = H.load_catalogue()
    pool = "sglang.srt.mem_cache.memory_pool:ReqToTokenPool.available_size"
    seen = [_seen("req_to_token_available_size", [GNAR, PREFILL, "m:x"], [[], ["req"], []])]
    (row,) = H.rows_from_seen(cat, seen, {"probe-req": "req_to_token_available_size"} | {"probe-req_to_token_available_size": "req_to_token_available_size"})
    assert row.caller == GNAR and row.loop_frame == PREFILL and row.loop_var == "req"
    g = row.gate(0)
    assert g["called_from"] == [PREFILL, GNAR] and g["inside_loop"] == "req" and g["max_depth"] == 3
    assert "Scheduler.get_num_allocatable_reqs ← Scheduler._get_new_batch_prefill_raw in `for req`" == row.where
    assert pool  # the site itself is the catalogue's, not part of the row


def test_clock_rows_are_kept_only_for_timeout_like_callers() -> None:
    cat = H.load_catalogue()
    seen = [
        _seen("perf_counter", ["sglang.srt.managers.scheduler:Scheduler.log_stats", "m:y"], [[], []]),
        _seen("perf_counter", ["sglang.srt.utils.poll_timer:PollTimer.elapsed",
                               "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache._prefetch_deadline_expired"], [[], []]),
    ]
    rows = H.rows_from_seen(cat, seen, {"probe-perf_counter": "perf_counter"})
    assert [r.caller for r in rows] == ["sglang.srt.utils.poll_timer:PollTimer.elapsed"]


def test_trials_are_row_by_perturbation_by_rank_and_unknown_perturbations_fail() -> None:
    cat = H.load_catalogue()
    rows = [H.Row("get_num_allocatable_reqs", PREFILL, PREFILL, "req")]
    trials = H.plan_trials(cat, rows, [0, 1])
    assert [t.name for t in trials[:3]] == ["t001-get_num_allocatable_reqs-zero_once-r0",
                                             "t002-get_num_allocatable_reqs-zero_once-r1",
                                             "t003-get_num_allocatable_reqs-minus_one-r0"]
    assert len(trials) == 2 * len(cat.point("get_num_allocatable_reqs").perturbations)
    assert [t.name for t in H.plan_trials(cat, rows, [0], ["zero_once"])] == ["t001-get_num_allocatable_reqs-zero_once-r0"]
    with pytest.raises(H.HuntError, match="--perturbation zero: not in"):
        H.plan_trials(cat, rows, [0], ["zero"])


# ---------------------------------------------------------------------------------------------------- diagnosis
def _rank(rank: int, state: str, chain: list[str], op: Optional[str] = "all_reduce") -> dict:
    return {"rank": rank, "state": state, "op": op if state == "collective" else None, "caller_chain": chain,
            "wait": "zmq poll" if state == "idle-wait" else None}


def test_30760_shape_is_a_known_scheduling_cache_deadlock_in_the_prefetch_all_reduce() -> None:
    cat = H.load_catalogue()
    analysis = {"ranks": [
        _rank(0, "collective", ["VocabParallelEmbedding.forward", "LlamaModel.forward", "ModelRunner.forward"]),
        _rank(1, "collective", ["UnifiedRadixCache._can_terminate_prefetch", "UnifiedRadixCache.check_prefetch_progress",
                                "Scheduler._get_new_batch_prefill_raw"]),
    ]}
    d = H.diagnose(analysis, cat)
    assert d.family == H.FAMILY_SCHED
    assert d.collective.startswith("prefetch all_reduce")
    assert d.in_ranks == (1,) and d.known == "sglang#30760"
    t = H.Trial(1, H.Row("get_num_allocatable_reqs", PREFILL, PREFILL, "req"), cat.perturbations["zero_once"], 0)
    s = H.hazard_statement(t, DEADLOCKED, d, 1, 1, 2)
    assert s.startswith("rank-local `get_num_allocatable_reqs` returns 0 once on rank 0 (Scheduler._get_new_batch_prefill_raw, in `for req`)")
    assert "rank(s) 1 wait in it, rank(s) 0 never issue it" in s and "scheduling/cache" in s and "sglang#30760" in s


def test_forward_only_deadlock_and_idle_broadcast_are_told_apart() -> None:
    cat = H.load_catalogue()
    fwd = {"ranks": [_rank(0, "collective", ["VocabParallelEmbedding.forward", "ModelRunner.forward"]),
                     _rank(1, "collective", ["broadcast_pyobj", "Scheduler.recv_requests"], op="broadcast")]}
    d = H.diagnose(fwd, cat)
    assert d.family == H.FAMILY_FORWARD and d.in_ranks == (0,) and d.known is None
    sched_vs_fwd = {"ranks": [_rank(0, "collective", ["UnifiedRadixCache.check_hicache_events", "Scheduler.get_next_batch_to_run"]),
                              _rank(1, "collective", ["LlamaModel.forward"])]}
    d2 = H.diagnose(sched_vs_fwd, cat)
    assert d2.family == H.FAMILY_SCHED and d2.collective.startswith("per-tick HiCache event all_reduce") and d2.known is None
    assert H.diagnose(None, cat).family == H.FAMILY_UNCLEAR


# ----------------------------------------------------------------------------------------------- scenario files
def test_finding_scenario_is_ready_to_run(tmp_path: Path) -> None:
    cat = H.load_catalogue()
    base = load_scenario(BASE)
    t = H.Trial(4, H.Row("get_num_allocatable_reqs", PREFILL, PREFILL, "req"), cat.perturbations["minus_one"], 1)
    d = H.Diagnosis(H.FAMILY_SCHED, "prefetch all_reduce", (0,), known="sglang#30760")
    f = tmp_path / "finding.toml"
    f.write_text(H.finding_scenario(base, BASE, cat, t, d))
    s = load_scenario(f)
    assert s.mirrors == "sglang#30760" and s.server == base.server
    assert s.burst == base.burst.model_copy(update={"seed": base.burst.seed + 4})  # the trial's own prompts
    (v,) = s.variants
    assert v.name == "finding" and v.expect == "deadlock"
    inj = v.injections[0]
    assert inj.site == list(cat.point("get_num_allocatable_reqs").sites)
    assert inj.action.kind == "return_value" and inj.action.offset == -1
    assert inj.gate.called_from == [PREFILL] and inj.gate.inside_loop == "req" and inj.gate.ranks == [1]
    plan = compile_plan(s, v, tmp_path / "out", tmp_path / "ARM")
    assert plan["injections"][0]["action"]["offset"] == -1


# ------------------------------------------------------------------------------------------ hunt loop bookkeeping
class FakeRunner:
    """Stand-in for repro.runner: real scenario files, prepare and evidence folders; a scripted Session."""

    RunOptions = real_runner.RunOptions
    RunError = real_runner.RunError

    def __init__(self, script: dict[str, str], interrupt_at: Optional[str] = None, die_after: Optional[str] = None,
                 die_later: bool = False) -> None:
        self.script = script  # trial name substring -> verdict
        self.interrupt_at = interrupt_at
        self.die_after = die_after  # the server dies right after this trial's (successful) burst
        self.die_later = die_later  # ... only after the settle check (alive once more, dead at the next trial)
        self.alive_checks = 0
        self.sessions: list["FakeSession"] = []
        self.driven: list[str] = []
        self.driven_on: list[str] = []  # the evidence folder name of the server each variant was driven on
        self.events: list[tuple[str, str]] = []  # (launch|start|stop, folder name)
        self.seeds: list[int] = []
        runner = self

        class FakeSession:
            def __init__(self, p: Any, observe: Any) -> None:
                self.p, self.rank_pids, self.healthy_s = p, {}, 1.0
                self.interrupted_in_teardown = False  # as repro.runner.Session (run_one reads it after stop)
                self.starts = self.stops = self.launches = self.starts_of_launched = 0
                self.running = self.launched = False
                runner.sessions.append(self)

            @property
            def server(self) -> Any:
                die = runner.die_after and runner.driven and runner.die_after in runner.driven[-1]
                if die and runner.die_later:
                    runner.alive_checks += 1
                    die = runner.alive_checks > 1
                return types.SimpleNamespace(is_running=lambda: self.running and not die)

            def launch(self) -> None:  # the spare: processes started, health not waited for
                assert not self.running, "launch over a running server"
                self.launches += 1
                self.running = self.launched = True
                runner.events.append(("launch", self.p.evidence.path.name))
                return None

            def start(self) -> None:
                self.starts += 1
                self.starts_of_launched += self.launched
                self.running, self.launched = True, False
                self.rank_pids = {0: 100 + 10 * runner.sessions.index(self), 1: 101 + 10 * runner.sessions.index(self)}
                runner.events.append(("start", self.p.evidence.path.name))
                return None

            def restart(self) -> None:
                self.stop()
                return self.start()

            def stop(self) -> list:
                if self.running:
                    self.stops += 1
                    runner.events.append(("stop", self.p.evidence.path.name))
                self.running = self.launched = False
                return []

            def close_drivers(self) -> None:
                pass

            def drive(self, variant: Any, run_dir: Any, n: Any = None, native: bool = False) -> Any:
                assert self.running and not self.launched, "drive on a stopped or not yet healthy server"
                runner.driven.append(variant.name)
                runner.driven_on.append(self.p.evidence.path.name)
                runner.seeds.append(self.p.scenario.burst.seed)
                if runner.interrupt_at and runner.interrupt_at in variant.name:
                    raise KeyboardInterrupt
                st = DriverState(8, 0, 0, 8, 0, 1.0, True)
                if variant.name == "baseline":
                    inj = self.p.evidence.injector_dir
                    lines = [_seen("get_num_allocatable_reqs", [PREFILL, "m:a"], [[], []]),
                             _seen("get_num_allocatable_reqs", [PREFILL, "m:a"], [["req"], []])]
                    (inj / "fires-100.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
                    return real_runner.Outcome(Verdict(INCONCLUSIVE, "probe never entered"), None, st, {"burst_s": 1.0}, True)
                verdict = next((v for k, v in runner.script.items() if k in variant.name), SUCCEEDED)
                if verdict == "NEW":  # a deadlock in a scheduling/cache collective no known issue covers
                    analysis = types.SimpleNamespace(to_dict=lambda: {"ranks": [
                        _rank(0, "collective", ["UnifiedRadixCache.check_hicache_events", "Scheduler.get_next_batch_to_run"]),
                        _rank(1, "idle-wait", ["Scheduler.recv_requests"])]})
                    return real_runner.Outcome(Verdict(DEADLOCKED, "ranks disagree"), analysis, st, {"burst_s": 12.0}, False)
                if verdict == DEADLOCKED:
                    analysis = types.SimpleNamespace(to_dict=lambda: {"ranks": [
                        _rank(0, "collective", ["LlamaModel.forward"]),
                        _rank(1, "collective", ["UnifiedRadixCache._can_terminate_prefetch", "Scheduler._get_new_batch_prefill_raw"])]})
                    return real_runner.Outcome(Verdict(DEADLOCKED, "ranks disagree"), analysis, st, {"burst_s": 12.0}, False)
                return real_runner.Outcome(Verdict(verdict, "ok"), None, st, {"burst_s": 2.0}, True)

        self.Session = FakeSession

    def make_session(self, p: Any, observe: Any = None, detectors: Any = None, hosts: Any = ()) -> Any:
        """As ``repro.runner.make_session``: the (scripted) session of ``p``."""
        return self.Session(p, observe)

    def prepare(self, opts: Any, label_default: Optional[str] = None, variants: Any = None) -> Any:
        scen = load_scenario(opts.scenario_path)
        variant = scen.variant(opts.variant if not variants else variants[0])
        evd = ev.EvidenceDir(opts.evidence_root, scen.name, opts.label or label_default or variant.name)
        return types.SimpleNamespace(scenario=scen, variant=variant, evidence=evd, python="py", plan={},
                                     adapter=get_adapter(scen.server.adapter))

    def run(self, opts: Any, observe: Any = None) -> Any:
        self.confirm_runs = getattr(self, "confirm_runs", []) + [Path(opts.scenario_path)]
        load_scenario(opts.scenario_path)  # the finding's scenario file must be loadable
        return types.SimpleNamespace(verdict=Verdict(DEADLOCKED, "again"), evidence=Path(opts.evidence_root) / "confirm")

    def collect_versions(self, injector_dir: Path, python: str, adapter: Any) -> dict:
        return {"engine": adapter.name, "engine_version": "0.5.23", "sglang": "0.5.23", "torch": "2.14.1", "python": "3.11"}

    def snapshot_session(self, p: Any, run_dir: Any) -> None:
        pass

    def finish_evidence(self, p: Any, opts: Any, variant: Any, evd: Any, outcome: Any, rank_pids: Any, interrupted: bool) -> None:
        evd.write_json("verdict.json", outcome.verdict.to_json())

    def injection_checks(self, injector_dir: Path, variant: Any, rank_pids: Any) -> tuple:
        fired = {0: 1, 1: 0} if variant.name.endswith("r0") else {0: 0, 1: 1}
        return [0, 1], [0, 1], [InjectionCheck(variant.injections[0].id, "s", {0: 5, 1: 5}, fired, fired)], None


def _opts(tmp_path: Path, **kw: Any) -> H.HuntOptions:
    kw.setdefault("spare", False)  # these tests count the plain restarts; tests/test_hunt_spare.py the spare's swaps
    return H.HuntOptions(scenario_path=BASE, evidence_root=tmp_path / "ev", only=("get_num_allocatable_reqs",),
                         perturbations=("zero_once", "delay_once"), **kw)


def _lines(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "hunt.jsonl").read_text().splitlines()]


def test_hunt_streams_every_trial_restarts_only_after_a_hang_and_writes_a_scenario_per_deadlock(tmp_path: Path) -> None:
    fr = FakeRunner({"-zero_once-r0": DEADLOCKED})
    res = H.hunt(_opts(tmp_path), runs=fr)
    # 2 rows × 2 perturbations × 2 ranks
    assert len(res.rows) == 2 and len(res.results) == 8
    assert fr.driven[0] == "baseline" and len(fr.driven) == 9
    base_seed = load_scenario(BASE).burst.seed
    assert fr.seeds == [base_seed] + [base_seed + n for n in range(1, 9)]  # fresh prompts for every trial
    assert load_scenario(res.deadlocks[0].scenario_file).burst.seed == base_seed + res.deadlocks[0].trial.n
    base_s, trial_s = fr.sessions
    assert base_s.stops == 1 and not base_s.running
    # two trials deadlocked (zero_once on rank 0, both rows): two restarts, the session ends stopped
    assert trial_s.starts == 3 and not trial_s.running  # t001 and t005 hung; both are followed by more trials
    dl = res.deadlocks
    assert len(dl) == 2 and all(r.scenario_file and r.scenario_file.is_file() for r in dl)
    assert all(r.diagnosis.known == "sglang#30760" for r in dl)
    trials = [x for x in _lines(res.folder) if x["event"] == "trial"]
    assert [t["trial"] for t in trials] == [r.trial.name for r in res.results]
    md = (res.folder / "HUNT.md").read_text()
    assert "status**: complete; 8 trial(s) run of 8" in md
    assert "- **engine**: sglang 0.5.23" in md  # the run's engine and the version its baseline's env.json names
    assert md.index("zero_once") < md.index("delay_once")  # deadlocks first
    assert "in `for req`" in md and "[scheduling/cache]" in md


def test_interrupted_hunt_keeps_what_it_found_and_stops_the_server(tmp_path: Path) -> None:
    fr = FakeRunner({"-zero_once-r0": DEADLOCKED}, interrupt_at="t003")
    with pytest.raises(KeyboardInterrupt):
        H.hunt(_opts(tmp_path), runs=fr)
    (folder,) = [p for p in (tmp_path / "ev" / "hicache_prefetch_30760").iterdir() if p.name.endswith("-hunt")]
    trials = [x for x in _lines(folder) if x["event"] == "trial"]
    assert [t["verdict"] for t in trials] == [DEADLOCKED, SUCCEEDED]
    assert _lines(folder)[-1] == {**_lines(folder)[-1], "event": "end", "status": "interrupted"}
    md = (folder / "HUNT.md").read_text()
    assert "status**: interrupted" in md and "interrupted_during**: t003-" in md
    assert all(not s.running for s in fr.sessions)
    assert json.loads((folder / "run.json").read_text())["status"] == "interrupted"


def test_budget_end_marks_the_rest_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fr = FakeRunner({})
    clock = iter([0.0] + [0.0] * 6 + [10_000.0] * 100)
    real_time = time.time
    monkeypatch.setattr(H.Clock, "elapsed", property(lambda self: next(clock, 10_000.0)))
    res = H.hunt(_opts(tmp_path, budget_min=1.0), runs=fr)
    assert res.budget_exhausted
    assert any(r.verdict == H.NOT_RUN for r in res.results) and any(r.verdict == SUCCEEDED for r in res.results)
    assert all(not s.running for s in fr.sessions)
    assert real_time() > 0


def test_sites_option_needs_a_sites_table_in_the_catalogue(tmp_path: Path) -> None:
    cat = tmp_path / "c.toml"
    cat.write_text('[perturbations.z]\naction = { kind = "skip" }\n[[points]]\nname = "get_num_allocatable_reqs"\n'
                   'site = "m:C.f"\nperturbations = ["z"]\n')
    with pytest.raises(H.HuntError, match=r"--sites: .* has no \[sites.apis\] table"):
        H.hunt(_opts(tmp_path, sites=True, catalogue_path=cat), runs=FakeRunner({}))


def test_site_rows_are_collective_call_sites_seen_during_the_burst_with_skip_and_extra() -> None:
    from repro.ledger import Record

    cat = H.load_catalogue()
    cache = ("sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache._all_reduce_attn_groups",
             "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache._all_reduce",
             "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.check_hicache_events")
    emb = ("sglang.srt.layers.vocab_parallel_embedding:VocabParallelEmbedding.forward", "torch.nn.modules.module:Module._call_impl")
    recs = [
        Record(0, "1", 1, "all_reduce", api="torch.distributed.all_reduce", site=cache, t_enter=100.0),
        Record(1, "1", 1, "all_reduce", api="torch.distributed.all_reduce", site=cache, t_enter=100.0),
        Record(0, "2", 1, "all_reduce", api="GroupCoordinator.all_reduce", site=emb, t_enter=101.0),
        Record(0, "2", 2, "all_reduce", api="GroupCoordinator.all_reduce", site=emb, t_enter=50.0),  # start-up
        Record(0, "1", 2, "all_reduce", api="torch.distributed.all_reduce", site=cache, t_enter=102.0, inj="x"),  # ours
        Record(0, "3", 1, "send", api="other.send", site=emb, t_enter=101.0),  # an API the catalogue does not place
    ]
    cat2, rows = H.site_rows(cat, recs, since=99.0)
    assert [(r.point, r.ranks) for r in rows] == [("coll-torch.distributed.all_reduce", (0, 1)),
                                                   ("coll-GroupCoordinator.all_reduce", (0,))]
    td, gc = rows
    assert cat2.point(td.point).sites == ("torch.distributed:all_reduce",)
    assert cat2.point(td.point).perturbations == ("skip_torch_distributed",)  # no self: no extra collective
    assert cat2.point(gc.point).sites == ("sglang.srt.distributed.parallel_state:GroupCoordinator.all_reduce",)
    assert cat2.point(gc.point).perturbations == ("skip_GroupCoordinator", "extra_all_reduce")
    assert cat2.perturbations["skip_GroupCoordinator"].action == {"kind": "skip", "return_arg": 1}
    assert cat2.perturbations["extra_all_reduce"].action == {"kind": "extra_collective", "op": "all_reduce", "group": "cpu_group"}
    assert td.gate(1) == {"called_from": list(cache), "max_depth": 12, "ranks": [1], "occurrence": {"mode": "first"}}
    trials = H.plan_trials(cat2, rows, [0])
    assert [t.name for t in trials] == ["t001-coll-torch.distributed.all_reduce-skip_torch_distributed-r0",
                                        "t002-coll-GroupCoordinator.all_reduce-skip_GroupCoordinator-r0",
                                        "t003-coll-GroupCoordinator.all_reduce-extra_all_reduce-r0"]
    _, only = H.site_rows(cat, recs, since=99.0, matching=["*check_hicache_events"])
    assert [r.point for r in only] == ["coll-torch.distributed.all_reduce"]


def test_bad_options_fail_before_anything_starts(tmp_path: Path) -> None:
    fr = FakeRunner({})
    with pytest.raises(H.HuntError, match="no decision point 'nope'"):
        H.hunt(H.HuntOptions(scenario_path=BASE, evidence_root=tmp_path, only=("nope",)), runs=fr)
    with pytest.raises(H.HuntError, match=r"--rank \[5\]: the base scenario's TP size is 2"):
        H.hunt(H.HuntOptions(scenario_path=BASE, evidence_root=tmp_path, ranks=(5,)), runs=fr)
    with pytest.raises(H.HuntError, match="scenario file not found"):
        H.hunt(H.HuntOptions(scenario_path=tmp_path / "x.toml", evidence_root=tmp_path), runs=fr)
    assert fr.sessions == []


def test_a_hang_in_the_last_trial_does_not_restart_the_server(tmp_path: Path) -> None:
    fr = FakeRunner({"t008-": DEADLOCKED})
    res = H.hunt(_opts(tmp_path), runs=fr)
    assert [r.verdict for r in res.results].count(DEADLOCKED) == 1 and res.results[-1].verdict == DEADLOCKED
    assert fr.sessions[1].starts == 1 and not fr.sessions[1].running


CRASH_LOG = """[TP0] Prefill batch, #new-seq: 2
terminate called after throwing an instance of 'gloo::EnforceNotMet'
  what():  [enforce fail at pair.cc:464] op.preamble.length <= op.nbytes. 12288 vs 64. Received data size doesn't match expected size. Is there a distributed collective mismatch in your code?
Fatal Python error: Aborted

Thread 0x00007f7687ff46c0 (most recent call first):
  File "/usr/lib/python3.11/queue.py", line 180 in get
  File "/v/sglang/srt/managers/cache_controller.py", line 1253 in prefetch_io_aux_func
Thread 0x00007f78e6c49b80 (most recent call first):
  File "/v/torch/distributed/distributed_c10d.py", line 3913 in all_reduce
  File "/work/main/injectors/repro_injector/_ledger.py", line 386 in repro_ledger[torch.distributed.all_reduce]
  File "/v/sglang/srt/distributed/parallel_state.py", line 699 in all_reduce
  File "/v/sglang/srt/distributed/communication_op.py", line 23 in tensor_model_parallel_all_reduce
  File "/v/sglang/srt/layers/vocab_parallel_embedding.py", line 533 in forward
  File "/v/sglang/srt/model_executor/model_runner.py", line 1860 in forward
  File "/v/sglang/srt/managers/scheduler.py", line 4870 in run_batch
"""


def test_a_desync_gloo_caught_is_a_crash_in_the_forward_not_a_success() -> None:
    cat = H.load_catalogue()
    d = H.crash_diagnosis(CRASH_LOG, cat)
    assert d is not None and d.family == H.FAMILY_FORWARD
    assert d.collective == "gloo size mismatch in all_reduce ← tensor_model_parallel_all_reduce ← forward ← forward"
    assert H.crash_diagnosis("[TP0] Connection reset by peer\n", cat) is None
    sched = CRASH_LOG.replace("line 533 in forward", "line 1 in _can_terminate_prefetch").replace(
        "line 1860 in forward", "line 2 in check_prefetch_progress")
    d2 = H.crash_diagnosis(sched, cat)
    assert d2.family == H.FAMILY_SCHED and d2.collective.startswith("gloo size mismatch in prefetch all_reduce")
    t = H.Trial(2, H.Row("get_num_allocatable_reqs", PREFILL, None, None), cat.perturbations["zero_once"], 0)
    r = H.TrialResult(t, INCONCLUSIVE, "requests errored", diagnosis=d)
    assert r.desync_crash and H.rank_key(r) < H.rank_key(H.TrialResult(t, SUCCEEDED, "ok"))
    assert "gloo aborted a rank" in H.hazard_statement(t, INCONCLUSIVE, d, 1, 1, 2)


def test_confirm_reruns_only_new_scheduling_findings_and_lists_them_as_findings(tmp_path: Path) -> None:
    fr = FakeRunner({"t001-": DEADLOCKED, "t002-": "NEW"})
    res = H.hunt(_opts(tmp_path, confirm=True), runs=fr)
    known, new = res.results[0], res.results[1]
    assert known.diagnosis.known == "sglang#30760" and known.confirmed is None  # known issues are not re-run
    assert new.diagnosis.family == H.FAMILY_SCHED and new.diagnosis.known is None and new.confirmed is True
    assert fr.confirm_runs == [new.scenario_file]
    md = (res.folder / "HUNT.md").read_text()
    findings = md.split("## Findings", 1)[1].split("## Deadlocks", 1)[0]
    assert new.trial.name in findings and known.trial.name not in findings


def test_a_server_that_dies_right_after_a_clean_burst_is_blamed_on_that_trial_and_restarted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(HL, "SETTLE_S", 0.0)
    fr = FakeRunner({}, die_after="t002-")
    res = H.hunt(_opts(tmp_path), runs=fr)
    r2 = res.results[1]
    assert r2.verdict == INCONCLUSIVE and "server died within 0 s after the burst" in r2.reason
    assert "inconclusive (server died" in r2.hazard
    assert res.results[2].verdict == SUCCEEDED and fr.sessions[1].starts == 2  # restarted before t003


def test_a_server_that_dies_between_trials_is_blamed_on_the_trial_before_not_the_next(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # measured: a perturbed idle-path read made a rank raise seconds after a clean burst; the next trial then met
    # "connection refused" on every request and was reported INCONCLUSIVE for something it did not do
    monkeypatch.setattr(HL, "SETTLE_S", 0.0)
    fr = FakeRunner({}, die_after="t002-", die_later=True)
    res = H.hunt(_opts(tmp_path), runs=fr)
    r2, r3 = res.results[1], res.results[2]
    assert r2.verdict == INCONCLUSIVE and "server died" in r2.reason and "before the next trial" in r2.reason
    assert "delayed crash" in r2.hazard
    assert r3.verdict == SUCCEEDED and fr.sessions[1].starts == 2  # t003 ran on a restarted server
    lines = _lines(res.folder)
    amended = [x for x in lines if x["event"] == "amended"]
    assert [x["trial"] for x in amended] == [r2.trial.name]
    assert "the server died 0 s after the burst (a delayed crash" in (res.folder / "HUNT.md").read_text()  # hazard column


def test_sites_matching_looks_at_every_recorded_frame_of_a_call_site() -> None:
    # sglang 0.5.23: check_hicache_events is the 4th frame of its all_reduce (… ← _sync_hicache_ready_counts ← it)
    from repro.ledger import Record

    site = ("sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache._all_reduce_attn_groups",
            "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache._all_reduce",
            "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache._sync_hicache_ready_counts",
            "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.check_hicache_events")
    recs = [Record(0, "1", 1, "all_reduce", api="torch.distributed.all_reduce", site=site, t_enter=100.0)]
    _, rows = H.site_rows(H.load_catalogue(), recs, since=99.0, matching=["*check_hicache_events"])
    assert [r.gate_frames for r in rows] == [site[:3]]  # matched by its 4th frame, keyed (and gated) by the first 3
    # the table names all three: the first two are shared with the prefetch all_reduce's call site
    assert rows[0].where.endswith("UnifiedRadixCache._all_reduce ← UnifiedRadixCache._sync_hicache_ready_counts")
    _, none = H.site_rows(H.load_catalogue(), recs, since=99.0, matching=["*recv_requests"])
    assert none == []


def test_sites_matching_nothing_is_an_error_naming_the_call_sites_seen(tmp_path: Path, monkeypatch) -> None:
    import time as _time

    import repro.ledger as L

    site = ("sglang.srt.utils.common:broadcast_pyobj",
            "sglang.srt.managers.scheduler_components.request_receiver:SchedulerRequestReceiver.recv_requests")
    rec = L.Record(0, "1", 1, "broadcast", api="torch.distributed.broadcast", site=site, t_enter=_time.time() + 60)
    monkeypatch.setattr(L, "load_ledgers", lambda *a, **k: {0: types.SimpleNamespace(records=[rec])})
    with pytest.raises(H.HuntError) as e:
        H.hunt(_opts(tmp_path, sites=True, sites_matching=("*check_hicache_events",)), runs=FakeRunner({}))
    msg = str(e.value)
    assert "no collective call site of the baseline burst matched --sites-matching *check_hicache_events" in msg
    assert "broadcast_pyobj ← SchedulerRequestReceiver.recv_requests" in msg and "Baseline evidence:" in msg


@pytest.mark.parametrize("kw, says", [
    ({"sites_matching": ("*x",)}, "--sites-matching *x needs --sites"),
    ({"requests": 0}, "--requests must be ≥ 1 (got 0)"),
    ({"perturbations": ("skip_once",)}, "--perturbation skip_once: no chosen decision point offers it; get_num_allocatable_reqs: zero_once"),
    ({"python": "/nonexistent/python"}, "--python /nonexistent/python"),
])
def test_bad_options_fail_before_any_folder_or_server(tmp_path: Path, kw: dict, says: str) -> None:
    fr = FakeRunner({})
    opts = _opts(tmp_path, **{k: v for k, v in kw.items() if k != "perturbations"})
    if "perturbations" in kw:
        opts = dataclasses.replace(opts, perturbations=kw["perturbations"])
    with pytest.raises(H.HuntError) as e:
        H.hunt(opts, runs=fr)
    assert says in str(e.value)
    assert not (tmp_path / "ev").exists() and fr.sessions == []


def test_an_evidence_dir_that_is_a_file_is_a_hunt_error(tmp_path: Path) -> None:
    (tmp_path / "ev").write_text("not a folder")
    with pytest.raises(H.HuntError, match="cannot create the evidence folder"):
        H.hunt(_opts(tmp_path), runs=FakeRunner({}))


def test_a_failed_hunt_says_so_in_hunt_md(tmp_path: Path, monkeypatch) -> None:
    import repro.ledger as L

    monkeypatch.setattr(L, "load_ledgers", lambda *a, **k: {})
    with pytest.raises(H.HuntError):
        H.hunt(_opts(tmp_path, sites=True, sites_matching=("nomatch*",)), runs=FakeRunner({}))
    (folder,) = [d for d in (tmp_path / "ev" / "hicache_prefetch_30760").iterdir() if d.name.endswith("-hunt")]
    md = (folder / "HUNT.md").read_text()
    assert "**status**: failed" in md and "**error**: no collective call site" in md
    assert _lines(folder)[-1]["event"] == "end" and _lines(folder)[-1]["status"] == "failed"


def test_no_trial_server_is_started_when_the_baseline_used_up_the_budget(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(H.Clock, "remaining", property(lambda self: 0.0))
    fr = FakeRunner({})
    res = H.hunt(_opts(tmp_path), runs=fr)
    assert len(fr.sessions) == 1  # the baseline's only
    assert res.results and all(r.verdict == H.NOT_RUN for r in res.results) and res.budget_exhausted


def test_known_labels_match_the_fingerprints_their_cited_issues_quote_and_nothing_else() -> None:
    """Each ``[[known]]`` label of the catalogue against the py-spy / faulthandler fingerprint quoted in the issue
    or PR it cites (sglang#27489's description, sglang#37909's stack); a chain none of them quotes gets no label."""
    cat = H.load_catalogue()
    # sglang#27489: "TP0: all_reduce → writing_check → check_hicache_events → get_new_batch_prefill_raw"; TP1-3 in
    # recv_requests' broadcast (a hang: one rank blocked in the drain's all_reduce)
    for method in ("writing_check", "loading_check"):
        analysis = {"ranks": [
            _rank(0, "collective", [f"UnifiedRadixCache.{method}", "UnifiedRadixCache.check_hicache_events",
                                    "Scheduler.get_new_batch_prefill_raw", "Scheduler.event_loop_overlap"]),
            _rank(1, "collective", ["broadcast_pyobj", "Scheduler.recv_requests", "Scheduler.event_loop_overlap"],
                  op="broadcast"),
        ]}
        assert H.diagnose(analysis, cat).known == "sglang#27489", method
    # sglang#37909: gloo's size check aborts prefill TP0 in pop_bootstrapped's poll all_reduce (a desync)
    pd_log = CRASH_LOG.replace("line 699 in all_reduce", "line 199 in poll_and_all_reduce_attn_cp_tp_group").replace(
        "line 23 in tensor_model_parallel_all_reduce", "line 517 in pop_bootstrapped").replace(
        "line 533 in forward", "line 1163 in event_loop_normal_disagg_prefill")
    d = H.crash_diagnosis(pd_log, cat)
    assert d is not None and d.known == "sglang#37909", d
    # the forward's all_reduce and a prefetch chain without the admission loop are no known issue
    assert H.crash_diagnosis(CRASH_LOG, cat).known is None
    other = {"ranks": [_rank(0, "collective", ["UnifiedRadixCache._can_terminate_prefetch", "Scheduler.handle_req"])]}
    assert H.diagnose(other, cat).known is None
    # every label cites an issue and names frames (the abort-on-timeout clock issue, sglang#27221, is not one)
    assert all(k.issue.startswith("sglang#") and k.frames for k in cat.known)
    assert "sglang#27221" not in {k.issue for k in cat.known}


class QuietBaselineRunner(FakeRunner):
    """FakeRunner whose quiet baseline succeeds and whose evidence is written by the real ``finish_evidence``."""

    def __init__(self, script: dict[str, str]) -> None:
        super().__init__(script)
        base_drive = self.Session.drive

        def drive(session: Any, variant: Any, run_dir: Any, n: Any = None, native: bool = False) -> Any:
            out = base_drive(session, variant, run_dir, n, native)
            if variant.name == "baseline":  # every request of the probe-only burst came back
                out.verdict = Verdict(SUCCEEDED, "8/8 requests completed")
            return out

        self.Session.drive = drive

    finish_evidence = staticmethod(real_runner.finish_evidence)


def test_the_quiet_baseline_runs_through_the_one_run_loop_and_writes_a_verdict(tmp_path: Path) -> None:
    """The baseline is driven by runner.run_one like every run: its folder (the one the hunt reports) holds a
    verdict.json of the run's shape and REPORT.md; its server is stopped after the burst, before any trial."""
    fr = QuietBaselineRunner({})
    res = H.hunt(_opts(tmp_path), runs=fr)
    bd = ev.EvidenceDir.open(res.baseline)
    rec = bd.verdict.read()
    assert isinstance(rec, ev.VerdictRecord)
    assert rec.verdict == SUCCEEDED and rec.kind == "run" and rec.variant == "baseline" and rec.exit_code == 0
    assert rec.evidence == str(res.baseline) and rec.rank_pids == {"0": 100, "1": 101}
    assert "burst_s" in rec.timings and "healthy_s" in rec.timings
    assert bd.report.path.is_file() and bd.env.path.is_file()
    assert json.loads(bd.run.path.read_text())["status"] == "complete"
    base_s = fr.sessions[0]
    assert base_s.p.evidence.path == res.baseline and base_s.stops == 1 and not base_s.running
    assert fr.events.index(("stop", res.baseline.name)) < fr.events.index(("start", fr.sessions[1].p.evidence.path.name))
    assert len(res.results) == 8 and [x for x in _lines(res.folder) if x["event"] == "baseline"][0]["evidence"] == str(res.baseline)


@pytest.mark.parametrize("how", ["start", "deadlock", "failed_requests"])
def test_an_unhealthy_baseline_raises_with_its_evidence_and_its_verdict_written(tmp_path: Path, how: str) -> None:
    """A baseline whose server does not start, that deadlocks or loses requests stops the hunt with a HuntError
    naming its folder; that folder still holds the run's verdict.json (the one run loop wrote it) and no trial ran."""
    fr = QuietBaselineRunner({})
    base_start, base_drive = fr.Session.start, fr.Session.drive

    def start(session: Any) -> Any:
        base_start(session)
        return Verdict(INCONCLUSIVE, "server failed to start: boom") if how == "start" else None

    def drive(session: Any, variant: Any, run_dir: Any, n: Any = None, native: bool = False) -> Any:
        out = base_drive(session, variant, run_dir, n, native)
        if how == "deadlock":
            out.verdict, out.clean = Verdict(DEADLOCKED, "ranks disagree"), False
        elif how == "failed_requests":
            out.state = DriverState(8, 0, 0, 6, 2, 1.0, True)
        return out

    fr.Session.start, fr.Session.drive = start, drive
    with pytest.raises(H.HuntError) as ei:
        H.hunt(_opts(tmp_path), runs=fr)
    msg = str(ei.value)
    (bd,) = [p for p in (tmp_path / "ev" / "hicache_prefetch_30760").iterdir() if p.name.endswith("-hunt-baseline")]
    want = {"start": f"baseline server: server failed to start: boom (evidence: {bd})",
            "deadlock": f"the clean baseline burst did not succeed (DEADLOCKED: ranks disagree); a hunt needs a healthy "
                        f"base scenario. Evidence: {bd}"}
    if how in want:
        assert msg == want[how]
    else:
        assert msg.startswith("the clean baseline burst did not succeed (ALL REQUESTS SUCCEEDED") and str(bd) in msg
    rec = ev.EvidenceDir.open(bd).verdict.read()
    assert rec.verdict == {"start": INCONCLUSIVE, "deadlock": DEADLOCKED, "failed_requests": SUCCEEDED}[how]
    assert len(fr.sessions) == 1 and not fr.sessions[0].running and fr.driven == ([] if how == "start" else ["baseline"])


@pytest.mark.parametrize("budget", [float("nan"), float("inf"), float("-inf"), 0.0])
def test_a_non_finite_or_non_positive_budget_is_refused_before_anything_starts(tmp_path: Path, budget: float) -> None:
    """--budget-min nan passed '<= 0' (False for nan) and Clock's max(0, nan) = 0 made every trial NOT RUN; inf is
    no budget at all. Refused (HuntError: exit 2) before the baseline: no server, no hunt folder."""
    fr = FakeRunner({})
    with pytest.raises(H.HuntError, match="--budget-min must be a finite number of minutes > 0"):
        H.hunt(_opts(tmp_path, budget_min=budget), runs=fr)
    assert not fr.sessions and not (tmp_path / "ev").exists()
