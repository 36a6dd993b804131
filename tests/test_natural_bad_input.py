"""Breaking pass round 4, natural nemeses (issue 29): bad natural actions in a scenario file are refused with the
file, the field and what was expected — never coerced into another action than the one written."""

from __future__ import annotations

from pathlib import Path

import pytest

from repro.scenario import ScenarioError, load_scenario

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


@pytest.mark.parametrize("action, field, expected", [
    # a boolean was read as a 1 s stop, a string as a number: a different action than written
    ('{ kind = "stop", stop_s = true }', "stop.stop_s", "a valid number (got true, a boolean)"),
    ('{ kind = "delay", delay_s = "2" }', "delay.delay_s", "a valid number (got \"2\", a string)"),
    ('{ kind = "pending", polls = "5" }', "pending.polls", "a valid integer (got \"5\", a string)"),
    ('{ kind = "pending", polls = true }', "pending.polls", "a valid integer (got true, a boolean)"),
    ('{ kind = "fault", observe_s = false }', "fault.observe_s", "a valid number (got false, a boolean)"),
    # nan passed no bound but was named as over one ("less than or equal to 3600 (got nan)"); inf likewise
    ('{ kind = "delay", delay_s = nan }', "delay.delay_s", "a finite number (got nan)"),
    ('{ kind = "stop", stop_s = inf }', "stop.stop_s", "a finite number (got inf)"),
    ('{ kind = "clock", step_s = nan }', "clock.step_s", "a finite number (got nan)"),
    ('{ kind = "clock", skew = 0.5, for_s = nan }', "clock.for_s", "a finite number (got nan)"),
])
def test_natural_action_numbers_are_numbers_and_finite(tmp_path: Path, action: str, field: str, expected: str):
    p = tmp_path / "s.toml"
    p.write_text(HEAD + f"action = {action}\n")
    with pytest.raises(ScenarioError) as e:
        load_scenario(p)
    msg = str(e.value)
    assert str(p) in msg and field in msg and expected in msg, msg
    assert "(got True)" not in msg and "(got False)" not in msg and "(got '" not in msg, msg  # TOML's spelling, not Python's


def test_a_boolean_where_a_number_is_expected_is_named_a_boolean_in_tomls_spelling(tmp_path: Path):
    """Round 4 of issue 29 (N2): `stop_s = true` was refused with "(got True)", Python's spelling of TOML's `true`,
    which does not say a boolean was given; now "(got true, a boolean)"."""
    p = tmp_path / "s.toml"
    p.write_text(HEAD + 'action = { kind = "stop", stop_s = true }\n')
    with pytest.raises(ScenarioError) as e:
        load_scenario(p)
    assert "stop.stop_s: Input should be a valid number (got true, a boolean)" in str(e.value), str(e.value)


def test_a_pending_done_answer_without_only_done_is_refused_naming_the_fix(tmp_path: Path):
    p = tmp_path / "s.toml"
    p.write_text(HEAD + 'action = { kind = "pending", polls = 5, value = 3, done = 4 }\n')
    with pytest.raises(ScenarioError) as e:
        load_scenario(p)
    assert str(p) in str(e.value) and "only_done = true" in str(e.value), str(e.value)
    p.write_text(HEAD + 'action = { kind = "pending", polls = 5, value = 3, done = [4, 5], only_done = true }\n')
    with pytest.raises(ScenarioError, match="expected one value"):
        load_scenario(p)
    p.write_text(HEAD + 'action = { kind = "pending", polls = 5, value = 3, done = 4, only_done = true }\n')
    assert load_scenario(p)


def test_integers_still_load_as_seconds(tmp_path: Path):
    p = tmp_path / "s.toml"
    p.write_text(HEAD + 'action = { kind = "clock", step_s = -30, skew = 1, for_s = 10 }\n')
    assert load_scenario(p).variants[0].injections[0].action.step_s == -30


def test_natural_with_discover_is_refused_before_any_scan_folder_or_server(tmp_path: Path):
    """The discovery rules map what they find only to forced perturbations (zero_once, empty_once, …), none of them
    in the natural catalogue: `hunt --natural --discover` scanned the engine (~20-60 s), launched a baseline server
    and added 0 points (measured in the breaking pass). Now one line before anything, exit 2 (a HuntError)."""
    import repro.hunt as H
    from repro.catalogue import HuntError
    from tests.test_hunt import BASE, FakeRunner

    fr = FakeRunner({})
    with pytest.raises(HuntError) as e:
        H.hunt(H.HuntOptions(scenario_path=BASE, evidence_root=tmp_path / "ev", natural=True, discover=True,
                             spare=False), runs=fr)
    msg = str(e.value)
    assert "--natural --discover" in msg and "discover_rules.toml" in msg and "zero_once" in msg, msg
    assert "drop --discover" in msg and "delay_2s" in msg, msg
    assert not fr.sessions and not (tmp_path / "ev").exists()


def test_natural_with_sites_is_refused_even_when_the_catalogue_has_sites_apis(tmp_path: Path):
    """--sites makes forced rows (skip / extra collective) after the baseline, which check_natural never sees: with a
    natural catalogue that has [sites.apis] the old code would have run them in a `--natural` hunt."""
    import repro.hunt as H
    from repro.catalogue import HuntError
    from tests.test_hunt import BASE, FakeRunner

    apis = ('[sites.apis.GroupCoordinator]\nowner = "sglang.srt.distributed.parallel_state:GroupCoordinator"\n'
            'skip = { kind = "skip", return_arg = 1 }\nextra_group = "cpu_group"\n')
    cat = tmp_path / "natural_nemeses.toml"
    cat.write_text((REPO / "scenarios/sglang/natural_nemeses.toml").read_text() + "\n" + apis)
    fr = FakeRunner({})
    with pytest.raises(HuntError) as e:
        H.hunt(H.HuntOptions(scenario_path=BASE, evidence_root=tmp_path / "ev", natural=True, sites=True,
                             catalogue_path=cat, spare=False), runs=fr)
    assert "--natural --sites" in str(e.value) and "drop --sites" in str(e.value), str(e.value)
    assert not fr.sessions and not (tmp_path / "ev").exists()


def test_bad_catalogue_action_names_the_field_and_the_value(tmp_path: Path):
    """Was 'perturbations.delay_2s.action is not a valid injection action: Input should be greater than 0': no field,
    no value."""
    from repro.catalogue import HuntError, load_catalogue

    cat = tmp_path / "c.toml"
    cat.write_text((REPO / "scenarios/sglang/natural_nemeses.toml").read_text().replace(
        'action = { kind = "stop", stop_s = 3.0 }', 'action = { kind = "stop", stop_s = 1e9 }', 1))
    with pytest.raises(HuntError) as e:
        load_catalogue(cat)
    assert "perturbations.stop_3s.action" in str(e.value)
    assert "stop_s: Input should be less than or equal to 600 (got 1000000000.0)" in str(e.value), str(e.value)
