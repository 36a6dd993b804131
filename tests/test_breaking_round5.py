"""Breaking pass round 5 (issue 29): what a new user's bad input to the natural hunt's newer fields did, each
refused before any folder or server with one line naming the file, the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PD_BASE = REPO / "scenarios/sglang/natural_hunt_pd.toml"
NEMESES = REPO / "scenarios/sglang/natural_nemeses.toml"
RECEIVER = 'perturbations = ["pending_transferring"]\nservers = ["decode"]'


def _catalogue(tmp_path: Path, servers: str) -> Path:
    text = NEMESES.read_text()
    assert RECEIVER in text
    p = tmp_path / "nemeses.toml"
    p.write_text(text.replace(RECEIVER, f'perturbations = ["pending_transferring"]\nservers = {servers}'))
    return p


@pytest.mark.parametrize("servers", ['["encoder"]', '["router"]', '["decode", "decod"]'])
def test_a_point_naming_no_engine_server_of_the_stack_is_refused_before_the_baseline(tmp_path: Path, servers: str):
    """Round 5: `servers = ["encoder"]` (or the router, or a typo) on a PD base launched the whole PD stack's
    baseline (~50 s) and then dropped every row of the point ("not reached"); now one line, nothing launched."""
    import repro.hunt as H
    from repro.catalogue import HuntError
    from tests.test_hunt import FakeRunner

    fr = FakeRunner({})
    with pytest.raises(HuntError) as e:
        H.hunt(H.HuntOptions(scenario_path=PD_BASE, evidence_root=tmp_path / "ev", natural=True,
                             catalogue_path=_catalogue(tmp_path, servers), only=["pd_receiver_poll"], spare=False),
               runs=fr)
    msg = str(e.value)
    assert "nemeses.toml" in msg and "pd_receiver_poll" in msg and "its engine servers: prefill, decode" in msg, msg
    assert not fr.sessions and not (tmp_path / "ev").exists()


def test_a_points_servers_must_be_names(tmp_path: Path):
    """`servers = [1]` was read as a server named "1" (then the same silent drop)."""
    from repro.catalogue import HuntError, load_catalogue

    with pytest.raises(HuntError) as e:
        load_catalogue(_catalogue(tmp_path, "[1]"))
    assert "points[11].servers: expected a list of server names" in str(e.value) and "(got [1], a list)" in str(e.value), str(e.value)


def test_known_server_names_and_a_single_server_base_still_pass(tmp_path: Path):
    """The check keeps what worked: the shipped catalogue on the PD base, and a PD-only point on a one-server base
    (a single server's rows have no server and are always kept)."""
    from repro.catalogue import load_catalogue
    from repro.hunt.loop import _check_point_servers
    from repro.scenario import load_scenario
    from repro.targets.registry import get_adapter

    cat = load_catalogue(NEMESES)
    for base in (PD_BASE, REPO / "scenarios/sglang/natural_hunt_hicache.toml"):
        s = load_scenario(base)
        _check_point_servers(cat.points, get_adapter(s.server.adapter), s, base, cat.path)


SCHED = "sglang.srt.managers.scheduler:Scheduler.get_next_batch_to_run"
SCENARIO = """
name = "st"
[server]
tp_size = 2
[[variants]]
name = "v"
expect = "success"
[[variants.injections]]
id = "n"
site = "{site}"
action = {action}
"""


@pytest.mark.parametrize("action", ['{ kind = "miss", keep_pages = 0 }', '{ kind = "fail", answer = "false" }'])
def test_a_storage_answer_on_a_scheduler_method_is_refused_before_launch(tmp_path: Path, action: str):
    """Round 5: `miss` / `fail` on Scheduler.get_next_batch_to_run passed `sites` ("all 2 injection(s) resolve") and
    `run`'s pre-launch check; it would answer the scheduler's batch with False / None, forcing the engine's own
    bookkeeping, while the plan and fire records said `nature: natural`. Now `run` (and `sites`) refuse it."""
    from repro.run.prepare import check_launch
    from repro.runner import RunError, RunOptions

    p = tmp_path / "s.toml"
    p.write_text(SCENARIO.format(site=SCHED, action=action))
    with pytest.raises(RunError) as e:
        check_launch(RunOptions(scenario_path=p, evidence_root=tmp_path / "ev"))
    msg = str(e.value)
    assert str(p) in msg and "variants.v.injections.n" in msg and SCHED in msg and "storage backend methods" in msg, msg
    assert not (tmp_path / "ev").exists()


def test_a_storage_answer_on_the_backend_passes_the_check(tmp_path: Path):
    from repro.scenario import load_scenario, storage_action_problem
    from repro.targets.registry import get_adapter

    p = tmp_path / "s.toml"
    p.write_text(SCENARIO.format(site="sglang.srt.mem_cache.hicache_storage:HiCacheFile.batch_get",
                                 action='{ kind = "miss", keep_pages = 0 }'))
    ad = get_adapter("sglang")
    assert storage_action_problem(load_scenario(p).variants, ad.storage_sites, ad.name) is None


def test_a_catalogue_point_offering_a_storage_answer_off_the_backend_is_refused(tmp_path: Path):
    """The same in a hunt catalogue: the scheduler tick point offering storage_miss ran as a 'natural' row."""
    import repro.hunt as H
    from repro.catalogue import HuntError
    from tests.test_hunt import FakeRunner

    text = NEMESES.read_text()
    old = 'perturbations = ["delay_2s", "stop_3s", "clock_step_3600", "clock_skew_fast"]'
    assert old in text
    cat = tmp_path / "c.toml"
    cat.write_text(text.replace(old, 'perturbations = ["delay_2s", "storage_miss"]'))
    fr = FakeRunner({})
    with pytest.raises(HuntError) as e:
        H.hunt(H.HuntOptions(scenario_path=REPO / "scenarios/sglang/natural_hunt_hicache.toml", evidence_root=tmp_path / "ev",
                             natural=True, catalogue_path=cat, spare=False), runs=fr)
    assert "decision point scheduler_tick" in str(e.value) and "storage_miss" in str(e.value), str(e.value)
    assert not fr.sessions and not (tmp_path / "ev").exists()


def test_every_bundled_scenario_name_is_a_scenario():
    """Round 5: the "bundled scenario" names an unknown SCENARIO lists offered natural_nemeses and hunt_workloads (a
    catalogue, a workload file); `repro run natural_nemeses` then said "invalid scenario (7 problem(s))"."""
    from repro import resources
    from repro.scenario import load_scenario

    names = resources.scenario_names()
    assert "natural_hunt_hicache" in names
    for n in names:
        load_scenario(resources.find_scenario(n))


PD_FAULT = REPO / "scenarios/sglang/natural_pd_transfer_fault.toml"


@pytest.mark.parametrize("old, new, expected", [
    ('server = "prefill"', 'server = "encoder"', "injections.pd_transfer_fault.server: 'encoder' names no engine server"),
    ('server = "prefill"', 'server = "router"', "injections.pd_transfer_fault.server: 'router' names no engine server"),
    ("[server.roles.decode]", "[server.roles.decoder]", "server.roles.decoder: topology 'pd' has no role 'decoder'"),
    ('topology = "pd"', 'topology = "ring"', "server.topology 'ring' is not known to the sglang adapter"),
])
def test_a_pd_scenarios_server_names_are_checked_before_launch(tmp_path: Path, old: str, new: str, expected: str):
    """Round 5: an injection's `server = "encoder"` (or "router") passed `sites` (exit 0) and run's pre-launch
    check, then `repro run` made the evidence folder and died with a ValueError traceback (exit 1); so did
    `topology = "ring"`; `[server.roles.decoder]` (a typo) was ignored: the decode server ran at its default TP."""
    from repro.run.prepare import check_launch
    from repro.runner import RunError, RunOptions

    text = PD_FAULT.read_text()
    assert old in text
    p = tmp_path / "pd.toml"
    p.write_text(text.replace(old, new))
    with pytest.raises(RunError) as e:
        check_launch(RunOptions(scenario_path=p, evidence_root=tmp_path / "ev"))
    assert str(p) in str(e.value) and expected in str(e.value), str(e.value)
    assert not (tmp_path / "ev").exists()


def test_the_shipped_pd_scenarios_pass_the_server_check():
    from repro.pd import topology_problem
    from repro.scenario import load_scenario
    from repro.targets.registry import get_adapter

    for p in (PD_FAULT, PD_BASE, REPO / "scenarios/sglang/disagg_bootstrap_divergence.toml"):
        s = load_scenario(p)
        assert topology_problem(s, get_adapter(s.server.adapter)) is None, p
