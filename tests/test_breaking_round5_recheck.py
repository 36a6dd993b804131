"""Re-check of breaking pass round 5 (issue 29, helper h37v): on a PD stack, an injection's gate ranks count in the
TP group of the server it runs on. A decode server of TP 4 (prefill TP 2) with `server = "decode"` and
`ranks = [3]` was refused by `sites` and `run` as "outside the TP group of size 2" (the prefill's) although decode
rank 3 exists; the same rule `repro hunt --rank` got in round 5 (h37b-5)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PD_FAULT = REPO / "scenarios/sglang/natural_pd_transfer_fault.toml"


def _pd(tmp_path: Path, server: str, ranks: str) -> Path:
    text = PD_FAULT.read_text()
    for old in ("[server.roles.decode]\ntp_size = 2", "ranks = [0]", 'server = "prefill"\nsite = ['):
        assert old in text, old
    text = text.replace("[server.roles.decode]\ntp_size = 2", "[server.roles.decode]\ntp_size = 4")
    text = text.replace("ranks = [0]", f"ranks = {ranks}", 1)
    text = text.replace('server = "prefill"\nsite = [', f"{server}site = [", 1)
    p = tmp_path / "pd.toml"
    p.write_text(text)
    return p


def _problem(p: Path):
    from repro.pd import injection_tp_sizes
    from repro.scenario import gate_rank_problem, load_scenario
    from repro.targets.registry import get_adapter

    s = load_scenario(p)
    return gate_rank_problem(s.variants, s.server.tp_size, injection_tp_sizes(s, get_adapter(s.server.adapter),
                                                                               s.server.tp_size))


@pytest.mark.parametrize("server", ['server = "decode"\n', ""])  # on decode; no server field: every engine server
def test_a_decode_rank_of_a_wider_decode_server_is_accepted(tmp_path: Path, server: str):
    assert _problem(_pd(tmp_path, server, "[3]")) is None


@pytest.mark.parametrize("server, ranks, expected", [
    ('server = "decode"\n', "[4]", "lists rank(s) [4], outside the TP group of size 4 (server decode) (expected 0..3)"),
    ('server = "prefill"\n', "[3]", "lists rank(s) [3], outside the TP group of size 2 (server prefill) (expected 0..1)"),
])
def test_a_rank_outside_its_own_servers_tp_is_refused_before_launch(tmp_path: Path, server: str, ranks: str,
                                                                    expected: str):
    from repro.run.prepare import check_launch
    from repro.runner import RunError, RunOptions

    p = _pd(tmp_path, server, ranks)
    with pytest.raises(RunError) as e:
        check_launch(RunOptions(scenario_path=p, evidence_root=tmp_path / "ev"))
    assert str(p) in str(e.value) and expected in str(e.value), str(e.value)
    assert not (tmp_path / "ev").exists()


HICACHE_BASE = REPO / "scenarios/sglang/natural_hunt_hicache.toml"
NEMESES = REPO / "scenarios/sglang/natural_nemeses.toml"
SET_PERTS = 'perturbations = ["storage_write_fails", "delay_2s"]'


def test_hunting_only_points_that_offer_no_perturbation_is_refused_before_the_baseline(tmp_path: Path):
    """Re-check: a catalogue point with `perturbations = []` chosen alone (`--only storage_set`) launched the ~55 s
    baseline, then planned 0 trials; now one line naming the catalogue and the point, nothing launched."""
    import repro.hunt as H
    from repro.catalogue import HuntError
    from tests.test_hunt import FakeRunner

    text = NEMESES.read_text()
    assert text.count(SET_PERTS) == 1
    cat = tmp_path / "nemeses.toml"
    cat.write_text(text.replace(SET_PERTS, "perturbations = []"))
    fr = FakeRunner({})
    with pytest.raises(HuntError) as e:
        H.hunt(H.HuntOptions(scenario_path=HICACHE_BASE, evidence_root=tmp_path / "ev", natural=True,
                             catalogue_path=cat, only=["storage_set"], spare=False), runs=fr)
    msg = str(e.value)
    assert str(cat) in msg and "decision point(s) storage_set offer no perturbation (perturbations = [])" in msg, msg
    assert not fr.sessions and not (tmp_path / "ev").exists()


def test_a_shard_holding_no_trial_says_so_and_exits_0(tmp_path: Path):
    """Re-check: `hunt H --natural --only storage_set --rank 0 --shard 5/8` (a shard with none of the plan's 2 keys)
    started no server, yet said "nothing was perturbed: the baseline burst reached none of the chosen decision
    points" and exited 4 (no baseline ran); now it says the shard holds no trial, exit 0, its folder kept for
    hunt-merge."""
    from typer.testing import CliRunner

    from repro.cli import app
    from repro.shard import shard_of

    keys = [("storage_set", p, 0, "") for p in ("storage_write_fails", "delay_2s")]
    empty = next(k for k in range(1, 9) if all(shard_of(x, 8) != k for x in keys))
    r = CliRunner().invoke(app, ["hunt", str(HICACHE_BASE), "--natural", "--only", "storage_set", "--rank", "0",
                                 "--shard", f"{empty}/8", "--evidence-dir", str(tmp_path / "ev")])
    out = " ".join(r.output.split())
    assert r.exit_code == 0, r.output
    assert f"shard {empty}/8 holds no trial of the plan" in out and "baseline burst reached none" not in out, out
    assert list((tmp_path / "ev").glob("*/*-hunt/HUNT.md"))


@pytest.mark.parametrize("text", ["", '[configs.x]\nsays = "x"\nargs = []\n'])
def test_workload_all_of_a_file_without_workloads_is_refused_before_launch(tmp_path: Path, text: str):
    """Re-check: `hunt H --natural --workload all --workload-file <an empty file>` made a hunt-matrix folder and
    launched the base group's baseline (the quiet burst alone: "all" of nothing); now one line, nothing made."""
    from repro.catalogue import HuntError
    from repro.hunt.matrix import hunt_matrix
    from repro.hunt.options import HuntOptions
    from tests.test_hunt import FakeRunner

    wf = tmp_path / "workloads.toml"
    wf.write_text(text)
    fr = FakeRunner({})
    with pytest.raises(HuntError) as e:
        hunt_matrix(HuntOptions(scenario_path=HICACHE_BASE, evidence_root=tmp_path / "ev", natural=True,
                                workloads=["all"], workload_file=wf, spare=False), runs=fr)
    assert f"--workload all: {wf} defines no workload" in str(e.value), str(e.value)
    assert not fr.sessions and not (tmp_path / "ev").exists()


IO_AUX = REPO / "scenarios/sglang/natural_hicache_io_aux_fault.toml"


@pytest.mark.parametrize("server, refused", [('"decode"', True), ('"prefill"', True), ('"server"', False)])
def test_an_injection_server_on_a_one_server_scenario_is_checked(tmp_path: Path, server: str, refused: bool):
    """Round 5's note (1), re-checked: `server = "decode"` on a one-server scenario was ignored without a word
    (`sites` exit 0, `run` launched); now refused before launch like a PD scenario's unknown server. The single
    server's own name ("server") still passes."""
    from repro.pd import topology_problem
    from repro.run.prepare import check_launch
    from repro.runner import RunError, RunOptions
    from repro.scenario import load_scenario
    from repro.targets.registry import get_adapter

    old = 'id = "io_aux_page_transfer_fault"\n'
    text = IO_AUX.read_text()
    assert text.count(old) == 1
    p = tmp_path / "one.toml"
    p.write_text(text.replace(old, f"{old}server = {server}\n"))
    s = load_scenario(p)
    problem = topology_problem(s, get_adapter(s.server.adapter))
    if not refused:
        assert problem is None, problem
        return
    assert problem and f"injections.io_aux_page_transfer_fault.server: {server.replace(chr(34), chr(39))} names no " \
                       "server of this one-server scenario (topology 'single')" in problem, problem
    with pytest.raises(RunError) as e:
        check_launch(RunOptions(scenario_path=p, evidence_root=tmp_path / "ev"))
    assert str(p) in str(e.value) and "drop the field" in str(e.value), str(e.value)
    assert not (tmp_path / "ev").exists()
