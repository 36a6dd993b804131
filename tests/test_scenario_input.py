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
