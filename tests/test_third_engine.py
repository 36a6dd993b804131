"""A third engine, added by registration alone (issue 30): ``tests/third_engine/`` (an adapter module, its package,
its release data, its scenario) and ``tests/fake_servers/third_engine_server.py`` (its server) are all there is; no
file of ``repro/`` knows it. Registered with ``repro.targets.registry.register``, it is what the interpreter choice,
``repro sites``, ``repro run`` (a real server tree of three processes, the real injector in each) and env.json's
engine version use."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from repro.cli import app
from repro.evidence import read_json
from repro.interpreter import choose_python
from repro.procs import alive, load_procs
from repro.targets import registry
from third_engine.adapter import HERE, ThirdEngineAdapter

SCENARIO = HERE / "smoke.toml"


@pytest.fixture
def third(tmp_path: Path):
    registry.register("thirdeng", lambda: ThirdEngineAdapter(tmp_path / "testbed"))
    try:
        yield registry.get_adapter("thirdeng")
    finally:
        registry.unregister("thirdeng")


def test_a_third_engine_added_by_registration_alone_is_used_by_interpreter_sites_run_and_env(third, tmp_path):
    # the interpreter choice: this Python has no thirdeng, so the adapter's own testbed (never SGLang's)
    py = choose_python(None, third)
    assert py == str(third.testbed_python()) and py.startswith(str(tmp_path))

    # repro sites: the scenario's adapter resolves its site in that interpreter and names its engine and version
    r = CliRunner().invoke(app, ["sites", str(SCENARIO), "--json"])
    assert r.exit_code == 0, r.output
    sites = json.loads(r.stdout)
    assert sites["engine"] == "thirdeng" and sites["engine_version"] == "7.1.0" and sites["python"] == py, sites
    assert sites["injections"][0]["resolved"] == "thirdeng.core:Engine.step"

    # repro run against its server: both ranks found by its titles, the tick site entered on each, success
    r = CliRunner().invoke(app, ["run", str(SCENARIO), "--evidence-dir", str(tmp_path / "ev"), "--json"])
    out = json.loads(r.stdout)
    assert r.exit_code == 0 and out["verdict"] == "ALL REQUESTS SUCCEEDED", r.output
    run = Path(out["evidence"])
    assert not [p for p in load_procs(run / "processes.json") if alive(p)], "server processes left running"
    env = read_json(run / "env.json")
    assert env["engine"] == "thirdeng" and env["engine_version"] == env["thirdeng"] == "7.1.0", env
    assert env["target_python"] == py and "sglang" not in env
    plan = read_json(run / "plan.json")
    assert plan["engine"] == {"name": "thirdeng", "package": "thirdeng", "distribution": "thirdeng"}
    assert plan["ledger"]["tick_function"] == "thirdeng.core:Engine.step" and plan["fork_ranks"] == {}
    from repro.injection_records import read_injector_dir

    counts = read_injector_dir(run / "injector").counts_by_rank("observe_tick")
    assert counts["entered"].get(0, 0) > 0 and counts["entered"].get(1, 0) > 0, counts

    # its per-release data, in its own folder and the one schema
    assert third.release_data().releases["7.1.0"].sites == {"scheduler.tick": ["thirdeng.core:Engine.step"]}
