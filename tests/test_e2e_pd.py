"""PD disaggregation end to end on the CPU testbed: a real prefill server (TP=4, HiCache), decode server (TP=1) and
SGLang's router, Mooncake moving the KV over TCP. ONE stack serves every case of this file: the control first, the
mass abort (no fault) next — both leave the stack clean and re-armable — and the hanging case last (marked ``pd``;
`bash scripts/test.sh pd`)."""

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
    return run_pd_variants(tmp_path_factory, "pd-evidence", ["control", "mass_abort", "divergence"])


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


def test_pd_mass_abort_with_no_fault_gives_a_verdict_and_counts_the_aborts_per_rank_of_both_servers(pd_results):
    _, by = pd_results
    r = by["mass_abort"]
    # not INCONCLUSIVE: the aborts reached the decode server (its FINISH_ABORT site, required, was entered)
    assert r.verdict.verdict in (SUCCEEDED, DEADLOCKED, "DESYNCED"), r.verdict.reason
    events = [json.loads(x) for x in (r.evidence / "requests.jsonl").read_text().splitlines()]
    cut = [e for e in events if e.get("event") == "abort"]
    assert len(cut) == 1 and len(cut[0]["requests"]) == 4
    firsts = [e["t"] for e in events if e.get("event") == "first_token"]
    assert not firsts or cut[0]["t"] < min(firsts)  # the clients left before any first token
    aborted = {e["request"] for e in events if e.get("event") == "aborted"}
    assert aborted == set(cut[0]["requests"])
    if r.verdict.verdict == SUCCEEDED:
        assert r.requests_ok == 4  # the other four still answered in full
    # per rank, the counted sites (aborts handled, AbortReqs, bootstrap pops) in the run's report and each server's
    top = (r.evidence / "REPORT.md").read_text()
    assert "## After the mass abort" in top
    lines = {ln.split(":", 1)[0][2:]: ln for ln in top.splitlines() if ln.startswith("- ") and "`aborts_handled`" in ln
             or ln.startswith("- ") and "`prefill_aborts_handled`" in ln}
    assert set(lines) == {"decode TP0", *(f"prefill TP{k}" for k in range(4))}, top[-2000:]
    assert "`abort_requests`" in lines["decode TP0"] and "`count_bootstrap_pops`" in lines["prefill TP0"]
    handled = int(lines["decode TP0"].split("`aborts_handled` ", 1)[1].split(",")[0])
    assert handled >= 1
    assert "aborts_handled" in (r.evidence / "servers" / "decode" / "REPORT.md").read_text()
    assert "prefill_aborts_handled" in (r.evidence / "servers" / "prefill" / "REPORT.md").read_text()


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
