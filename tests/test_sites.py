"""``repro sites``: resolution in a subprocess of the target interpreter, nearest names, warnings, exit codes."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from repro.cli import app
from repro.scenario import load_scenario
from repro.sites import SitesPreflightError, check_sites

REPO = Path(__file__).resolve().parent.parent

PKG = {
    "fakeeng/__init__.py": "",
    "fakeeng/sched.py": """
        class Scheduler:
            def get_new_batch_prefill(self):
                pass

            def run_batch(self):
                pass

            def _all_reduce_attn_groups(self, t, op):
                pass
    """,
    "fakeeng/broken.py": """
        import a_module_that_does_not_exist  # import fails: resolved from source instead

        class Cache:
            def check_prefetch_progress(self, handle):
                pass
    """,
}

SCENARIO = """
name = "fake"

[[variants]]
name = "first"
expect = "deadlock"

[[variants.injections]]
id = "ok"
site = ["fakeeng.old_cache:Cache.check_prefetch_progress", "fakeeng.sched:Scheduler.run_batch"]
action = { kind = "extra_collective", method = "_all_reduce_attn_groups" }
[variants.injections.gate]
called_from = ["fakeeng.sched:Scheduler.get_new_batch_prefill"]
not_called_from = ["fakeeng.sched:Scheduler.bulk_check_prefetch_progress"]

[[variants.injections]]
id = "static"
site = "fakeeng.broken:Cache.check_prefetch_progress"
action = { kind = "none" }

[[variants]]
name = "typo"
expect = "success"

[[variants.injections]]
id = "bad"
site = "fakeeng.sched:Scheduler.run_bach"
action = { kind = "none" }
"""


@pytest.fixture()
def fake(tmp_path: Path, monkeypatch) -> Path:
    for rel, text in PKG.items():
        f = tmp_path / "pkgs" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(textwrap.dedent(text))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "pkgs"))
    monkeypatch.setenv("REPRO_PLAN", str(tmp_path / "must-not-be-used.json"))
    (tmp_path / "fake.toml").write_text(SCENARIO)
    return tmp_path / "fake.toml"


def test_first_resolving_alternative_is_used_and_absent_ones_get_nearest_names(fake: Path):
    rep = check_sites(load_scenario(fake), sys.executable, "first")
    ok, static = rep.injections
    assert ok.satisfied and ok.resolved.site == "fakeeng.sched:Scheduler.run_batch"
    absent = ok.alternatives[0]
    assert absent.status == "absent" and "fakeeng.old_cache does not exist" in absent.detail
    assert "fakeeng.sched" in absent.suggestions or "fakeeng.broken" in absent.suggestions
    # a fix's method absent in this version is a warning, not an error; the action's method was found
    assert len(ok.warnings) == 1 and "bulk_check_prefetch_progress names nothing in this version" in ok.warnings[0]
    assert static.satisfied and static.resolved.static and "import failed" in static.resolved.detail
    assert rep.ok and rep.python_version == sys.version.split()[0]


def test_missing_site_lists_nearest_names(fake: Path):
    rep = check_sites(load_scenario(fake), sys.executable, "typo")
    (bad,) = rep.injections
    assert not bad.satisfied and not rep.ok
    assert bad.alternatives[0].suggestions[0] == "Scheduler.run_batch"


def test_missing_interpreter_is_a_clear_error(fake: Path):
    with pytest.raises(SitesPreflightError, match="not found"):
        check_sites(load_scenario(fake), "/no/such/python")


def test_cli_exit_codes(fake: Path):
    runner = CliRunner()
    r = runner.invoke(app, ["sites", str(fake), "--variant", "first", "--python", sys.executable, "--json"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["sites", str(fake), "--python", sys.executable])
    assert r.exit_code == 2 and "typo/bad" in r.output
    r = runner.invoke(app, ["sites", str(fake), "--variant", "nope", "--python", sys.executable])
    assert r.exit_code == 2


@pytest.mark.sglang
@pytest.mark.parametrize("name", ["smoke_extra_allreduce", "hicache_prefetch_30760", "disagg_bootstrap_divergence"])
def test_shipped_scenarios_resolve_on_the_testbed(name: str):
    from repro import testbed

    py = testbed.testbed_python()
    assert py is not None and Path(py).exists(), f"testbed not set up: run `{testbed.setup_command()}`"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    rep = check_sites(load_scenario(REPO / "scenarios" / "sglang" / f"{name}.toml"), str(py), env=env)
    assert rep.ok, rep.as_dict()
    assert rep.versions["sglang"] == "0.5.23"
    if name == "hicache_prefetch_30760":
        by_id = {i.injection_id: i for i in rep.injections}
        alts = by_id["extra_allreduce_in_prefetch_check"].alternatives
        assert alts[0].site.endswith("HiRadixCache.check_prefetch_progress") and alts[0].status == "absent"
        assert by_id["extra_allreduce_in_prefetch_check"].resolved.site.endswith("UnifiedRadixCache.check_prefetch_progress")


@pytest.mark.parametrize("python", ["/bin/true", "/bin/false"])
def test_sites_with_a_python_that_is_not_one_names_the_python_fix_exit_2(python: str):
    """`sites --python /bin/true` said "preflight in /bin/true failed (exit 0):" with no reason, exit 1: an
    interpreter that answers nothing is bad input, said as such, naming --python."""
    r = CliRunner().invoke(app, ["sites", "smoke_extra_allreduce", "--python", python])
    flat = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert f"{python} printed nothing" in flat and "not a Python interpreter" in flat and "--python PATH" in flat, r.output
    assert "Traceback" not in r.output
