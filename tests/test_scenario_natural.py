"""Scenario files for the natural actions (environment nemeses): each validates with errors naming the file, the
field and what was expected; compiled plans label every action natural / forced; the harness's label table and the
injector's agree."""

from __future__ import annotations

from pathlib import Path

import pytest

from repro.scenario import NATURE, ScenarioError, compile_plan, load_scenario, nature_of

REPO = Path(__file__).resolve().parent.parent

HEAD = """
name = "nat"
[[variants]]
name = "v"
expect = "success"
[[variants.injections]]
id = "n"
site = "sglang.srt.managers.scheduler:Scheduler.run_batch"
"""


def _load(tmp_path: Path, action: str) -> object:
    p = tmp_path / "s.toml"
    p.write_text(HEAD + f"action = {action}\n")
    return load_scenario(p)


@pytest.mark.parametrize("action", [
    '{ kind = "stop", stop_s = 2 }',
    '{ kind = "clock", step_s = 30 }',
    '{ kind = "clock", clocks = ["time"], skew = 0.5, for_s = 10 }',
    '{ kind = "fault", exception = "OSError", when = "after" }',
    '{ kind = "pending", polls = 3 }',
    '{ kind = "delay", delay_s = 1 }',
    '{ kind = "miss" }',
    '{ kind = "miss", keep_pages = 2, only_hits = false }',
    '{ kind = "fail" }',
    '{ kind = "fail", answer = "none", per_key = true }',
])
def test_natural_actions_load_and_compile_labelled_natural(tmp_path: Path, action: str):
    sc = _load(tmp_path, action)
    plan = compile_plan(sc, sc.variants[0], tmp_path / "out", tmp_path / "arm")
    assert plan["injections"][0]["action"]["nature"] == "natural"


def test_forced_actions_compile_labelled_forced(tmp_path: Path):
    sc = _load(tmp_path, '{ kind = "return_value", value = 0 }')
    plan = compile_plan(sc, sc.variants[0], tmp_path / "out", tmp_path / "arm")
    assert plan["injections"][0]["action"]["nature"] == "forced"


@pytest.mark.parametrize("action, field, expected", [
    ('{ kind = "stop" }', "stop_s", "required field is missing"),
    ('{ kind = "stop", stop_s = 0 }', "stop_s", "greater than 0"),
    ('{ kind = "clock" }', "clock", "set step_s"),
    ('{ kind = "clock", step_s = 1, clocks = ["uptime"] }', "clocks", "'monotonic'"),
    ('{ kind = "fault", exception = "KeyboardInterrupt" }', "exception", "'RuntimeError'"),
    ('{ kind = "pending" }', "polls", "required field is missing"),
    ('{ kind = "pending", polls = 0 }', "polls", "greater than or equal to 1"),
    ('{ kind = "stop", stop_s = 1, delay_s = 2 }', "delay_s", "unknown field"),
    ('{ kind = "miss", keep_pages = -1 }', "miss.keep_pages", "greater than or equal to 0"),
    ('{ kind = "miss", keep_pages = "2" }', "miss.keep_pages", "a valid integer"),
    ('{ kind = "miss", pages = 2 }', "pages", "unknown field"),
    ('{ kind = "fail", answer = "nope" }', "fail.answer", "'false', 'none' or 'zero'"),
    ('{ kind = "fail", per_key = "yes" }', "fail.per_key", "a valid boolean"),
])
def test_bad_natural_actions_name_file_field_and_expectation(tmp_path: Path, action: str, field: str, expected: str):
    with pytest.raises(ScenarioError) as e:
        _load(tmp_path, action)
    msg = str(e.value)
    assert str(tmp_path / "s.toml") in msg and field in msg and expected in msg, msg


def test_control_label_wins_and_tables_agree_with_the_injector():
    assert nature_of({"kind": "state", "pool": "p", "nature": "control"}) == "control"
    import sys

    sys.path.insert(0, str(REPO / "injectors"))
    try:
        from repro_injector import _natural
    finally:
        sys.path.remove(str(REPO / "injectors"))
    assert _natural.NATURE == NATURE


def test_report_injection_table_shows_each_injections_nature():
    from repro.report import injection_table
    from repro.verdict import InjectionCheck

    rows = injection_table([InjectionCheck("f", "m:C.f", {0: 1}, {0: 1}, {0: 1}, nature="natural"),
                            InjectionCheck("z", "m:C.g", {0: 1}, {0: 1}, {0: 1}, nature="forced")], [0])
    assert rows[0].startswith("| injection | nature | site |")
    assert rows[2].startswith("| `f` | natural |") and rows[3].startswith("| `z` | forced |")
