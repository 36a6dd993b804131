"""COMPARISON.md shows each side's first divergent lockstep state next to its verdict (issue 33 item 2).

Evidence folders are written here the way a run writes them (``verdict.json`` with ``state_divergence``, the shape
of ``repro.state_digest.StateDivergence.to_dict``); no server.
"""

from __future__ import annotations

import json
from pathlib import Path

from repro import evidence as ev
from repro.compare import CompareOptions, CompareResult, SideResult, comparison_markdown, compare_json, state_of
from repro.state_digest import StateDivergence, StateStatus

REPO = Path(__file__).resolve().parent.parent
SCENARIO = REPO / "scenarios" / "sglang" / "hicache_prefetch_30760.toml"

DIVERGED = StateDivergence(
    status=StateStatus.DIVERGED, tick=41, compared=(3, 57),
    summary="at scheduler tick 41: `hicache.ongoing_prefetch` rank 0 = 0 (set 00000000), rank 1 = 1 (set 9f2c1a0b); "
            "2 tick(s) before the first divergent collective (tick 43) (ticks 3–57 compared).",
    fields={"hicache.ongoing_prefetch": {0: [0, "0" * 16], 1: [1, "9f2c1a0b" * 2]}},
    probes_compared=["req_to_token_pool.available", "hicache.ongoing_prefetch"], ticks_before_collective=2)
EQUAL = StateDivergence(status=StateStatus.EQUAL, compared=(3, 88),
                        summary="none: the ranks' lockstep state agreed at every tick from 3 to 88 (2 probes compared; "
                                "14 value changes recorded).",
                        probes_compared=["req_to_token_pool.available", "hicache.ongoing_prefetch"])


def _folder(root: Path, name: str, verdict: str, state) -> Path:
    d = root / name
    d.mkdir(parents=True)
    rec = ev.VerdictRecord(verdict=verdict, reason=f"{verdict.lower()} for the test",
                           state_divergence=state.to_dict() if state is not None else None)
    ev.write_json_atomic(d / "verdict.json", rec.to_json())
    return d


def _side(side: str, folder: Path, verdict: str, expect: str) -> SideResult:
    return SideResult(side=side, ref="installed", description="sglang 0.5.23", expect=expect, verdict=verdict,
                      reason="r", notes=(), matched=True, evidence=folder, timings={}, requests_ok=0,
                      requests_total=4, ranks=(), injections=(), versions={}, command="repro run …",
                      state=state_of(folder))


def _markdown(tmp_path: Path, before: SideResult, after: SideResult) -> str:
    res = CompareResult(sides=(before, after), folder=tmp_path / "cmp", exit_code=0, wall_s=1.0)
    opts = CompareOptions(scenario_path=SCENARIO, before="installed", after="installed")
    return comparison_markdown(res, opts, "s", "v"), compare_json(res)


def test_comparison_shows_each_sides_first_divergent_state_next_to_its_verdict(tmp_path):
    b = _side("before", _folder(tmp_path, "b", "DEADLOCKED", DIVERGED), "DEADLOCKED", "deadlock")
    a = _side("after", _folder(tmp_path, "a", "ALL REQUESTS SUCCEEDED", EQUAL), "ALL REQUESTS SUCCEEDED", "success")
    md, js = _markdown(tmp_path, b, a)
    lines = md.splitlines()
    i = next(k for k, l in enumerate(lines) if l.startswith("- **before**"))
    assert lines[i + 1] == ("  - state: first divergent state at scheduler tick 41: `hicache.ongoing_prefetch` rank 0 = 0 "
                            "(set 00000000), rank 1 = 1 (set 9f2c1a0b); 2 tick(s) before the first divergent collective "
                            "(tick 43) (ticks 3–57 compared).")
    j = next(k for k, l in enumerate(lines) if l.startswith("- **after**"))
    assert lines[j + 1] == "  - state: equal through tick 88 (ticks 3–88, 2 probes compared)"
    row = next(l for l in lines if l.startswith("| first divergent state |"))
    assert "at scheduler tick 41" in row and "equal through tick 88" in row
    assert "**after: the lockstep state stayed equal on every rank: the drift itself is gone.**" in md
    sides = {s["side"]: s for s in js["sides"]}
    assert sides["before"]["state_divergence"]["tick"] == 41 and sides["after"]["state_divergence"]["status"] == "equal"
    json.dumps(js)


def test_a_fix_that_removes_the_symptom_but_not_the_drift_is_said(tmp_path):
    b = _side("before", _folder(tmp_path, "b", "DEADLOCKED", DIVERGED), "DEADLOCKED", "deadlock")
    a = _side("after", _folder(tmp_path, "a", "ALL REQUESTS SUCCEEDED", DIVERGED), "ALL REQUESTS SUCCEEDED", "success")
    md, _ = _markdown(tmp_path, b, a)
    assert ("**after: every request succeeded while the ranks' lockstep state still diverged (tick 41): the fix "
            "removes the symptom, not the drift.**") in md


def test_a_folder_without_a_digest_reads_as_not_recorded_never_as_equal(tmp_path):
    b = _side("before", _folder(tmp_path, "b", "DEADLOCKED", None), "DEADLOCKED", "deadlock")
    nr = StateDivergence(status=StateStatus.NOT_RECORDED, summary="no digest recorded on rank(s) [1]")
    a = _side("after", _folder(tmp_path, "a", "ALL REQUESTS SUCCEEDED", nr), "ALL REQUESTS SUCCEEDED", "success")
    md, _ = _markdown(tmp_path, b, a)
    assert "  - state: no state digest recorded (no ledger, or evidence written before the state digest)" in md
    assert "  - state: not compared: no digest recorded on rank(s) \\[1\\]" in md or \
           "  - state: not compared: no digest recorded on rank(s) [1]" in md
    assert "equal through" not in md and state_of(tmp_path / "missing") is None


def test_comparison_names_each_sides_engine_and_version_old_env_json_by_its_version_key(tmp_path):
    """env.json's ``engine``/``engine_version`` (issue 30) give the engine row and the versions line; a side whose
    env.json predates them (only ``sglang``) is read by the run's version key."""
    import dataclasses

    b = dataclasses.replace(_side("before", _folder(tmp_path, "b", "DEADLOCKED", None), "DEADLOCKED", "deadlock"),
                            versions={"engine": "vllm", "engine_version": "0.32.0", "vllm": "0.32.0", "torch": "2.13.0"})
    a = dataclasses.replace(_side("after", _folder(tmp_path, "a", "ALL REQUESTS SUCCEEDED", None),
                                  "ALL REQUESTS SUCCEEDED", "success"), versions={"sglang": "0.5.18", "torch": "2.13.0"})
    res = CompareResult(sides=(b, a), folder=tmp_path / "cmp", exit_code=0, wall_s=1.0)
    opts = CompareOptions(scenario_path=SCENARIO, before="installed", after="installed")
    md = comparison_markdown(res, opts, "s", "v", engine_key="sglang")
    assert "| engine | vllm 0.32.0 | sglang 0.5.18 |" in md
    assert "- before: vllm 0.32.0, torch 2.13.0;" in md and "- after: sglang 0.5.18, torch 2.13.0;" in md
