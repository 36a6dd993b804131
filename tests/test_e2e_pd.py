"""PD disaggregation end to end on the CPU testbed: a real prefill server (TP=4, HiCache), decode server (TP=1) and
SGLang's router, Mooncake moving the KV over TCP. ONE stack serves every case of this file: the control first (it
leaves the stack clean and re-armable), the hanging case last (marked ``pd``; `bash scripts/test.sh pd`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from repro import testbed
from repro.procs import processes_mentioning
from repro.runner import RunOptions, run_many
from repro.verdict import DEADLOCKED, SUCCEEDED

REPO = Path(__file__).resolve().parent.parent
DISAGG = REPO / "scenarios" / "sglang" / "disagg_bootstrap_divergence.toml"

pytestmark = pytest.mark.pd


def run_pd_variants(tmp_path_factory, folder: str, variants: list[str]):
    """Run ``variants`` of the disagg scenario on one real PD stack; (evidence root, variant -> RunResult)."""
    py = testbed.testbed_python()
    if py is None or not testbed.is_set_up():
        pytest.fail(f"CPU testbed not set up at {testbed.testbed_dir()}: run `{testbed.setup_command()}`")
    root = tmp_path_factory.mktemp(folder)
    results = run_many(RunOptions(DISAGG, evidence_root=root, python=str(py)), variants)
    return root, {r.evidence.name.split("-", 1)[1]: r for r in results}


@pytest.fixture(scope="module")
def pd_results(tmp_path_factory):
    return run_pd_variants(tmp_path_factory, "pd-evidence", ["control", "divergence"])


def _servers(run: Path) -> dict:
    return json.loads((run / "verdict.json").read_text())["servers"]


def test_pd_control_succeeds_through_the_router_with_the_site_entered_on_every_prefill_rank(pd_results):
    _, by = pd_results
    r = by["control"]
    assert r.verdict.verdict == SUCCEEDED, r.verdict.reason
    assert r.requests_ok == r.requests_total == 8
    servers = _servers(r.evidence)
    assert servers["prefill"]["ranks"] == [f"prefill TP{k}" for k in range(4)]
    assert servers["decode"]["ranks"] == ["decode TP0"]
    assert servers["prefill"]["verdict"] == servers["decode"]["verdict"] == SUCCEEDED


def test_pd_divergence_deadlocks_the_prefill_server_in_the_waiting_queue_bootstrap_poll(pd_results):
    _, by = pd_results
    r = by["divergence"]
    assert r.verdict.verdict == DEADLOCKED, r.verdict.reason
    v = json.loads((r.evidence / "verdict.json").read_text())
    assert v["diverged_server"] == "prefill"
    # every rank of both servers captured, named apart
    for role, n in (("prefill", 4), ("decode", 1)):
        stacks = r.evidence / "servers" / role / "stacks"
        assert sorted(f.name for f in stacks.glob("rank*-1.txt")) == [f"rank{k}-1.txt" for k in range(n)], role
    report = (r.evidence / "REPORT.md").read_text()
    assert "resolve_waiting_queue_bootstrap" in report and "poll_and_all_reduce_attn_cp_tp_group" in report
    assert "The prefill server diverged" in report
    pre = json.loads((r.evidence / "servers" / "prefill" / "analysis.json").read_text())
    assert pre  # the prefill server's own analysis
    assert (r.evidence / "servers" / "prefill" / "ledger.json").is_file()


def test_pd_stack_left_nothing_running(pd_results):
    root, _ = pd_results
    assert processes_mentioning(root) == []
