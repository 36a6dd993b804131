"""Scenario validation errors name the file, the field and what was expected; plans are what the injector reads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from repro.scenario import ScenarioError, compile_plan, load_scenario

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "injectors"))

from repro_injector._runtime import PlanError, load_plan  # noqa: E402

HEAD = 'name = "t"\n'
VARIANT = '''
[[variants]]
name = "v"
expect = "deadlock"

[[variants.injections]]
id = "i"
site = "pkg.mod:Cls.meth"
action = { kind = "skip" }
'''


def _load(tmp_path: Path, text: str):
    p = tmp_path / "s.toml"
    p.write_text(text)
    return p, lambda: load_scenario(p)


def _error(tmp_path: Path, text: str) -> str:
    p, load = _load(tmp_path, text)
    with pytest.raises(ScenarioError) as e:
        load()
    msg = str(e.value)
    assert str(p) in msg  # every error names the file
    return msg


def test_missing_file_names_the_expected_shape(tmp_path: Path):
    with pytest.raises(ScenarioError, match=r"scenario file not found \(expected a \.toml file"):
        load_scenario(tmp_path / "nope.toml")


def test_bad_toml_gives_line_and_column(tmp_path: Path):
    assert "line 2" in _error(tmp_path, HEAD + "stall_s = = 3\n")


def test_unknown_field_is_named_as_a_typo(tmp_path: Path):
    msg = _error(tmp_path, HEAD + "stal_s = 3\n" + VARIANT)
    assert "stal_s: unknown field; did you mean 'stall_s'?" in msg


def test_missing_variants(tmp_path: Path):
    assert "variants: required field is missing" in _error(tmp_path, HEAD)


def test_site_shape_is_explained(tmp_path: Path):
    msg = _error(tmp_path, HEAD + VARIANT.replace("pkg.mod:Cls.meth", "pkg.mod.Cls.meth"))
    assert "variants.0.injections.0.site" in msg and "must look like 'package.module:Class.method'" in msg


def test_inside_loop_needs_called_from(tmp_path: Path):
    msg = _error(tmp_path, HEAD + VARIANT + '\n[variants.injections.gate]\ninside_loop = "req"\n')
    assert "variants.0.injections.0.gate" in msg and "inside_loop needs called_from" in msg


def test_extra_collective_needs_exactly_one_target(tmp_path: Path):
    text = HEAD + VARIANT.replace('{ kind = "skip" }', '{ kind = "extra_collective", group = "g", method = "m" }')
    msg = _error(tmp_path, text)
    assert "variants.0.injections.0.action.extra_collective" in msg and "exactly one of 'group'" in msg


def test_unknown_action_kind_lists_the_kinds(tmp_path: Path):
    msg = _error(tmp_path, HEAD + VARIANT.replace('kind = "skip"', 'kind = "explode"'))
    assert "variants.0.injections.0.action" in msg and "'extra_collective'" in msg and "'return_value'" in msg


def test_bad_frame_pattern(tmp_path: Path):
    msg = _error(tmp_path, HEAD + VARIANT + '\n[variants.injections.gate]\ncalled_from = ["a b"]\n')
    assert "variants.0.injections.0.gate.called_from" in msg and "module:Qual.name" in msg


def test_budget_must_exceed_stall_and_ids_unique(tmp_path: Path):
    assert "budget_s (5.0) must be greater than stall_s (8.0)" in _error(tmp_path, HEAD + "stall_s = 8\nbudget_s = 5\n" + VARIANT)
    dup = VARIANT + VARIANT.split("[[variants]]")[1].split('expect = "deadlock"')[1]
    assert "injection ids must be unique" in _error(tmp_path, HEAD + dup)


def test_unknown_variant_lists_known_names(tmp_path: Path):
    _, load = _load(tmp_path, HEAD + VARIANT)
    with pytest.raises(ScenarioError, match="no variant 'x'; known: v"):
        load().variant("x")


@pytest.mark.parametrize("name", ["smoke_extra_allreduce", "hicache_prefetch_30760", "disagg_bootstrap_divergence"])
def test_shipped_scenarios_compile_to_plans_the_injector_accepts(tmp_path: Path, name: str):
    sc = load_scenario(REPO / "scenarios" / "sglang" / f"{name}.toml")
    assert sc.variants[0].expect == "deadlock" and any(v.name == "control" and v.expect == "success" for v in sc.variants)
    for v in sc.variants:
        plan = compile_plan(sc, v, tmp_path / "out", tmp_path / "arm")
        p = tmp_path / f"{v.name}.json"
        p.write_text(json.dumps(plan))
        got = load_plan(str(p))
        assert [i["id"] for i in got["injections"]] == [i.id for i in v.injections]
        for inj in got["injections"]:
            assert inj["site"]["alternatives"] and inj["action"]["kind"] in (
                "extra_collective", "skip", "return_value", "delay", "none", "state")
        if v.name == "control":
            assert all(i["action"]["kind"] == "none" for i in got["injections"])


def test_smoke_scenario_targets_rank0_on_the_tp_cpu_group():
    sc = load_scenario(REPO / "scenarios" / "sglang" / "smoke_extra_allreduce.toml")
    inj = sc.variant("extra_collective").injections[0]
    assert inj.gate.ranks == [0] and inj.action.group == "tp_cpu_group" and inj.action.op == "all_reduce"
    assert sc.stall_s <= 10 and sc.budget_s <= 120
    control = sc.variant("control").injections[0]
    assert control.site == inj.site and control.gate.called_from == inj.gate.called_from


def test_hicache_scenario_has_both_cache_classes_and_the_loop_gate():
    sc = load_scenario(REPO / "scenarios" / "sglang" / "hicache_prefetch_30760.toml")
    extra = sc.variant("extra_collective").injections[0]
    assert [s.split(":")[1] for s in extra.site] == ["HiRadixCache.check_prefetch_progress", "UnifiedRadixCache.check_prefetch_progress"]
    assert any("bulk_check_prefetch_progress" in p for p in extra.gate.not_called_from)
    drift = sc.variant("allocatable_drift").injections[0]
    assert drift.gate.inside_loop == "req" and drift.action.kind == "return_value" and drift.action.value == 0
    assert "--enable-hierarchical-cache" in sc.server.args and "file" in sc.server.args


def test_plan_reader_rejects_other_versions_and_missing_keys(tmp_path: Path):
    p = tmp_path / "plan.json"
    p.write_text(json.dumps({"version": 2}))
    with pytest.raises(PlanError, match="plan version 2 not supported"):
        load_plan(str(p))
    p.write_text(json.dumps({"version": 1, "out_dir": "x", "arm_file": "y", "injections": [{"id": "a"}]}))
    with pytest.raises(PlanError, match=r"injections\[0\] missing key 'site'"):
        load_plan(str(p))
