"""The collective ledger end to end on real SGLang TP=2 (CPU testbed): one server, driven by
``repro.runner.run_many`` through the smoke scenario's ``control`` variant (healthy: the ledgers must agree), its
``extra_collective`` variant (deadlock: proven by the live ledger proof, and REPORT.md's Diagnosis must name the
injected collective as the first divergence, with the rank, the group and both call sites), then, on the restarted
server, ``desync_control`` (success) and ``desync_reduce_op`` (DESYNCED: gloo completed MAX against MIN). Marked ``hang``: it hangs real rank processes
and owns its server; the run tears the tree down and the test checks nothing of it is left.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from repro.evidence import read_json
from repro.injection_records import read_injector_dir
from repro.ledger import check_consistent, load_ledgers
from repro.procs import alive, load_procs

REPO = Path(__file__).resolve().parent.parent
SMOKE = REPO / "scenarios" / "sglang" / "smoke_extra_allreduce.toml"


@pytest.mark.hang
def test_control_ledgers_agree_and_the_smoke_deadlock_report_names_the_injected_collective(tmp_path):
    from repro.runner import RunOptions, run_many

    names = ["control", "extra_collective", "desync_control", "desync_reduce_op", "state_leak"]
    results = dict(zip(names, run_many(RunOptions(scenario_path=SMOKE, evidence_root=tmp_path), names)))
    session = Path(read_json(results["control"].evidence / "session.json")["session"])
    procs = load_procs(session / "processes.json")
    assert procs and not [p for p in procs if alive(p)], "server processes left running"

    # control: > 0 records per rank and per group, equal totals and op sequences, nothing dropped
    control = results["control"]
    assert control.verdict.verdict == "ALL REQUESTS SUCCEEDED", control.verdict.reason
    pids = [int(v) for v in read_json(control.evidence / "session.json")["rank_pids"].values()]
    leds = load_ledgers(control.evidence / "injector", pids)
    assert sorted(leds) == [0, 1]
    assert check_consistent(leds) == []
    for led in leds.values():
        assert led.dropped == 0 and led.records
        labels = {led.groups[r.group].label for r in led.records}
        assert {"tp:0/cpu", "tp:0/device"} <= labels
        assert any(r.op == "all_reduce" and r.api == "GroupCoordinator.all_reduce" for r in led.records)
        assert any(r.site and r.site[0] == "sglang.srt.utils.common:broadcast_pyobj" for r in led.records)
        assert max(r.tick for r in led.records) > 0
        # values of small integer CPU tensors only: never the model's (float) all_reduce inputs
        assert not [r for r in led.records if r.vin is not None and not str(r.dtypes[0]).startswith(("int", "uint", "bool"))]
    # broadcast_pyobj's size (a 1-element long on the TP CPU group): what rank 0 sent is what every rank got
    size = {rank: {r.seq: r for r in led.records if r.op == "broadcast" and r.vout is not None and r.site
                   and r.site[0] == "sglang.srt.utils.common:broadcast_pyobj"} for rank, led in leds.items()}
    both = sorted(set(size[0]) & set(size[1]))
    assert both, size
    assert all(size[0][q].vout == size[1][q].vout == size[0][q].vin for q in both)
    assert any(size[0][q].vin != [0] for q in both)  # some tick carried requests
    ledger_json = read_json(control.evidence / "ledger.json")
    assert ledger_json["divergence"]["kind"] == "none" and ledger_json["consistency_problems"] == []
    for group, per_rank in ledger_json["records_per_group"].items():
        assert set(per_rank) == {"0", "1"} and all(n > 0 for n in per_rank.values()), group

    # the injector inside the real ranks (folded in from tests/test_injector_testbed.py, which owned a server of its
    # own): every scheduler process loaded it and patched the site; never a fire before arming (control: the site
    # unarmed, no fire anywhere); armed, entered on both ranks, exactly one fire, on rank 0, from
    # Scheduler.event_loop_normal, that never completed (rank 0 is still inside the extra all_reduce at the stop)
    site = "extra_allreduce_before_run_batch"
    assert not control.injector.fires() and not any(control.injector.counts_by_rank(site)["fired"].values())
    dead = results["extra_collective"]
    rep = read_injector_dir(dead.evidence / "injector")
    marks = {m.rank: m for m in rep.markers if m.rank is not None}
    assert sorted(marks) == [0, 1] and rep.ranks_loaded([0, 1]) == [0, 1], rep.markers
    for m in marks.values():
        assert m.sites[site].patched and m.sites[site].resolved == "sglang.srt.managers.scheduler:Scheduler.run_batch", m
    assert rep.ranks_armed([0, 1]) == [0, 1] and rep.fired_ranks(site) == [0]
    assert rep.counts_by_rank(site)["entered"].get(1, 0) >= 1
    (fire,) = rep.fires(site)
    assert fire.rank == 0 and fire.caller == "sglang.srt.managers.scheduler:Scheduler.event_loop_normal"
    assert fire.completed is None

    # the deadlock: the injected all_reduce on the TP CPU group, rank 0 only; rank 1 waits in the model's all_reduce
    assert dead.verdict.verdict == "DEADLOCKED", dead.verdict.reason
    div = read_json(dead.evidence / "ledger.json")["divergence"]
    assert div["kind"] == "missing" and div["group_label"] == "tp:0/cpu" and div["missing"] == [1]
    r0 = div["entered"]["0"]
    assert r0["op"] == "all_reduce" and r0["inj"] == "extra_allreduce_before_run_batch" and r0["t_exit"] is None
    assert r0["site"][0] == "sglang.srt.managers.scheduler:Scheduler.run_batch"
    w1 = div["waits"]["1"]
    assert w1["op"] == "all_reduce" and w1["site"][0].endswith("VocabParallelEmbedding.forward")
    report = (dead.evidence / "REPORT.md").read_text()
    lines = report.splitlines()
    assert lines[0].startswith("# DEADLOCKED") and lines[2] == "## Diagnosis"
    sentence = next(l for l in lines if l.startswith("**Collective ledger:**"))
    assert "rank 0 entered the injected all_reduce #" in sentence and "on the TP CPU group from Scheduler.run_batch" in sentence
    assert "rank 1 never did and waits in all_reduce #" in sentence and "on the TP device group from " \
        "VocabParallelEmbedding.forward" in sentence
    assert "![per-rank collective timeline](timeline.svg)" in report
    svg = (dead.evidence / "timeline.svg").read_text()
    assert ET.fromstring(svg).tag.endswith("svg") and "first divergence: missing at tp:0/cpu" in svg

    # the ledger proved it (a closed set of waits across the CPU and device groups), at once; stacks still captured
    v = read_json(dead.evidence / "verdict.json")
    proof = v["proof"]
    assert proof["kind"] == "missing_partner" and proof["ranks"] == [0, 1], v["reason"]
    assert {(e["rank"], e["waits_for"]) for e in proof["edges"]} == {(0, 1), (1, 0)}
    assert proof["inside"]["0"]["inj"] == "extra_allreduce_before_run_batch"
    assert v["reason"].startswith("Ledger proof of a deadlock") and "proof_latency_s" in v["timings"]
    assert read_json(dead.evidence / "proof.json") == proof and "ledger proof of the deadlock" in svg
    assert sorted(p.name for p in (dead.evidence / "stacks").glob("rank*-proof.txt")) == ["rank0-proof.txt", "rank1-proof.txt"]
    assert "wait edge: rank 0 in all_reduce #" in report

    # after the restart: MAX against MIN at one (group, seq) completes on gloo — only the ledgers say DESYNCED
    ctl, ds = results["desync_control"], results["desync_reduce_op"]
    assert ctl.verdict.verdict == "ALL REQUESTS SUCCEEDED", ctl.verdict.reason
    assert ds.verdict.verdict == "DESYNCED" and ds.exit_code == 0, ds.verdict.reason  # variant expects desync
    d = read_json(ds.evidence / "verdict.json")["desync"]
    assert d["fields"] == ["red"] and d["outcome"] == "completed" and d["label"] == "tp:0/cpu"
    assert {k: r["red"] for k, r in d["records"].items()} == {"0": "MAX", "1": "MIN"}
    assert ds.requests_ok == ds.requests_total > 0

    # last on the same server (issue 32): rank 0 leaks req_to_token_pool slots, no collective touched: the per-tick
    # lockstep digest names the first divergent state (tick, probe, each rank's value) before any collective parts
    leak = results["state_leak"]
    assert leak.verdict.verdict in ("DESYNCED", "DEADLOCKED"), leak.verdict.reason
    st = read_json(leak.evidence / "verdict.json")["state_divergence"]
    assert st["status"] == "diverged" and st["tick"] is not None and st["tick"] >= 0, st
    avail = st["fields"]["req_to_token_pool.available"]
    assert avail["0"] == 1 and avail["1"] > 1, st
    assert "**First divergent state:** at scheduler tick" in (leak.evidence / "REPORT.md").read_text()
    # and the clean runs before it agreed at every tick they compared
    for name in ("control", "desync_control"):
        cst = read_json(results[name].evidence / "verdict.json")["state_divergence"]
        assert cst["status"] == "equal" and cst["compared_ticks"], (name, cst)


@pytest.mark.sglang
def test_ledger_patches_the_installed_sglang_without_a_server(tmp_path):
    """In the testbed interpreter (no server): GroupCoordinator's methods, the adapter's tick function and the
    ``from torch.distributed import all_reduce, barrier`` copies in sglang modules are the ledger's wrappers."""
    import json
    import os
    import subprocess

    from repro import testbed

    py = testbed.testbed_python()
    assert py, "the CPU testbed is not installed (scripts/cpu_testbed/setup.sh)"
    plan = {"version": 1, "scenario": "t", "variant": "v", "out_dir": str(tmp_path / "out"), "arm_file": str(tmp_path / "arm"),
            "injections": [], "ledger": {"enabled": True, "max_records": 100,
                                         "tick_function": "sglang.srt.managers.scheduler:Scheduler.get_next_batch_to_run"}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    code = (
        "import torch.distributed as d\n"
        "from sglang.srt.distributed.parallel_state import GroupCoordinator as G\n"
        "import sglang.srt.managers.scheduler as s\n"
        "import sglang.srt.managers.scheduler_components.request_receiver as rr\n"
        "print(d.all_reduce.__code__.co_name, G.all_reduce.__code__.co_name, G.broadcast_object.__code__.co_name,\n"
        "      s.Scheduler.get_next_batch_to_run.__code__.co_name, rr.all_reduce.__code__.co_name,\n"
        "      rr.barrier.__code__.co_name, s.barrier.__code__.co_name)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(PYTHONPATH=str(REPO / "injectors") + os.pathsep + str(REPO / "scripts" / "cpu_testbed" / "stub"),
               REPRO_PLAN=str(tmp_path / "plan.json"), SGLANG_USE_CPU_ENGINE="1")
    r = subprocess.run([str(py), "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == [
        "repro_ledger[torch.distributed.all_reduce]", "repro_ledger[GroupCoordinator.all_reduce]",
        "repro_ledger[GroupCoordinator.broadcast_object]", "repro_tick[Scheduler.get_next_batch_to_run]",
        "repro_ledger[torch.distributed.all_reduce]", "repro_ledger[torch.distributed.barrier]",
        "repro_ledger[torch.distributed.barrier]"], r.stdout + r.stderr[-2000:]
