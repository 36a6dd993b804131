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
