"""Scenario files as people save them: non-UTF-8 bytes, a UTF-8 BOM, unknown fields named by variant/injection."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from repro.cli import app
from repro.scenario import ScenarioError, load_scenario

REPO = Path(__file__).resolve().parent.parent
SMOKE = REPO / "scenarios" / "sglang" / "smoke_extra_allreduce.toml"


@pytest.mark.parametrize("verb", ["run", "sites"])
def test_a_non_utf8_scenario_is_one_line_exit_2_naming_byte_and_position(tmp_path: Path, verb: str):
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(SMOKE.read_bytes().replace(b"extra_collective", b"extra\xe9collective", 1))
    r = CliRunner().invoke(app, [verb, str(bad), "--evidence-dir", str(tmp_path / "ev")] if verb == "run" else [verb, str(bad)])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and "0xe9" in r.output and "line " in r.output and "UTF-8" in r.output
    assert len([ln for ln in r.output.splitlines() if ln.strip()]) == 1, r.output
    assert not (tmp_path / "ev").exists()


def test_a_utf8_bom_is_accepted(tmp_path: Path):
    bom = tmp_path / "bom.toml"
    bom.write_bytes(b"\xef\xbb\xbf" + SMOKE.read_bytes())
    assert load_scenario(bom).name == load_scenario(SMOKE).name


def test_an_unknown_field_names_the_variant_and_injection_with_a_did_you_mean(tmp_path: Path):
    bad = tmp_path / "typo.toml"
    bad.write_text(SMOKE.read_text().replace("[variants.injections.gate]", "[variants.injections.gate]\nrankz = [0]", 1))
    with pytest.raises(ScenarioError) as e:
        load_scenario(bad)
    msg = str(e.value)
    assert "variant 'extra_collective'" in msg and "injection '" in msg and "gate.rankz" in msg
    assert "did you mean 'ranks'" in msg and "variants.0.injections.0" not in msg


@pytest.mark.parametrize("old,new,says", [
    ("stall_s = 8", "stall_s = true", "stall_s: Input should be a valid number (got true, a boolean)"),
    ("stall_s = 8", 'stall_s = "8"', 'stall_s: Input should be a valid number (got "8", a string)'),
    ("tp_size = 2", 'tp_size = "2"', 'server.tp_size: Input should be a valid integer (got "2", a string)'),
    ("tp_size = 2", "tp_size = true", "server.tp_size: Input should be a valid integer (got true, a boolean)"),
    ("stall_s = 8", 'stall_s = 8\nledger = "no"', 'ledger: Value error, expected true, false or a [ledger] table'),
    ("[server]", "[ledger]\nenabled = 1\n[server]", "ledger: Value error, [ledger] enabled = 1: expected true or false"),
    ("ranks = [0]", 'ranks = ["0"]', 'gate.ranks.0: Input should be a valid integer (got "0", a string)'),
    ("ranks = [0]", "ranks = [0]\nmax_depth = 16.0", "gate.max_depth: Input should be a valid integer (got 16.0)"),
])
def test_a_number_or_boolean_of_the_wrong_type_is_refused_naming_the_field(tmp_path: Path, old, new, says):
    """Pydantic's lax mode read `stall_s = true` as a 1 s stall, `"8"` as 8, `tp_size = true` as TP 1 (then blamed
    gate.ranks), `ledger = "no"` as false; `stop_s = true` was already refused, the rest now are too, exit 2."""
    text = SMOKE.read_text()
    assert old in text
    bad = tmp_path / "lax.toml"
    bad.write_text(text.replace(old, new, 1))
    with pytest.raises(ScenarioError) as e:
        load_scenario(bad)
    msg = str(e.value)
    assert says in msg and "1 problem(s)" in msg, msg
    r = CliRunner().invoke(app, ["sites", str(bad)])
    assert r.exit_code == 2 and "Traceback" not in r.output and says in " ".join(r.output.split()), r.output


def test_an_int_still_fills_a_float_field_and_shipped_scenarios_load(tmp_path: Path):
    """`stall_s = 8` (an integer) stays an 8 s stall; every shipped scenario still loads."""
    s = load_scenario(SMOKE)
    assert s.stall_s == 8.0 and s.server.tp_size == 2
    files = [f for f in sorted((REPO / "scenarios").glob("*/*.toml")) if "[[variants]]" in f.read_text()]
    assert len(files) >= 10
    for f in files:
        load_scenario(f)


@pytest.mark.parametrize("dots", [".", ".."])
@pytest.mark.parametrize("field, old", [("name", 'name = "smoke_extra_allreduce"'),
                                        ("variants.0.name", 'name = "extra_collective"'),
                                        ("injections.0.id", 'id = "extra_allreduce_before_run_batch"')])
def test_a_name_of_only_dots_is_refused_naming_file_and_field(tmp_path: Path, dots: str, field: str, old: str):
    """'.' / '..' match the name pattern but, as the evidence folder's first level, put the run outside
    --evidence-dir (a tester's `name = ".."` wrote <dir>/../<stamp>-<variant> and a `latest` link in the parent)."""
    bad = tmp_path / "dots.toml"
    text = SMOKE.read_text()
    assert old in text
    bad.write_text(text.replace(old, old.split("=")[0] + f'= "{dots}"', 1))
    with pytest.raises(ScenarioError) as e:
        load_scenario(bad)
    msg = str(e.value)
    assert str(bad) in msg and field in msg and "only dots" in msg and "--evidence-dir" in msg


def test_sites_refuses_a_dots_scenario_name_in_one_exit_2_error(tmp_path: Path):
    bad = tmp_path / "dots.toml"
    bad.write_text(SMOKE.read_text().replace('name = "smoke_extra_allreduce"', 'name = ".."', 1))
    r = CliRunner().invoke(app, ["sites", str(bad)])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and "name" in r.output and "only dots" in r.output
