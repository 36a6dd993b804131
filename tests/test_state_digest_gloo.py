"""The lockstep state digest on a real gloo job (tests/gloo_programs/ledger_sched.py under the injector, no
SGLang): every rank records its probes per tick into its ledger, a ``state`` action leaks one slot of the
scheduler-shaped ``req_to_token_pool`` on rank 0, and the analysis names the first divergent state: the probe,
both ranks' values and the tick; a failing probe is named and skipped, a missing path is absent, not an error."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from repro.ledger import diagnose
from repro.state_digest import StateStatus

REPO = Path(__file__).resolve().parent.parent
INJECTORS = REPO / "injectors"
PROG = REPO / "tests" / "gloo_programs" / "ledger_sched.py"
WAIT_S = 90.0  # generous bound for slow CI; not a speed assertion
PROBES = [
    {"name": "req_to_token_pool.available", "path": "req_to_token_pool.available_size()", "kind": "lockstep"},
    {"name": "waiting_queue.rids", "path": "waiting_queue[*].rid", "kind": "lockstep"},
    {"name": "ticks", "path": "ticks", "kind": "local"},
    {"name": "hicache.host_pool.available", "path": "tree_cache.cache_controller.mem_pool_host.available_size()",
     "kind": "lockstep"},
    {"name": "broken", "path": "explode()", "kind": "lockstep"},
]


def _run(python: str, tmp: Path, leak: bool, ticks: int = 6, max_records: int = 1000) -> Path:
    out = tmp / "out"
    out.mkdir()
    injections = []
    if leak:
        injections = [{
            "id": "leak", "site": {"alternatives": ["ledger_sched:Scheduler.run_batch"], "aliases": []},
            "gate": {"called_from": [], "not_called_from": [], "max_depth": 8, "inside_loop": None, "ranks": [0],
                     "rank_group": None, "occurrence": {"mode": "nth", "nth": 3, "max_fires": 1}},
            "action": {"kind": "state", "pool": "req_to_token_pool", "take": 1, "release_after_ticks": None}}]
        (tmp / "arm").write_text("leak\n")
    plan = {"version": 1, "scenario": "gloo", "variant": "v", "out_dir": str(out), "arm_file": str(tmp / "arm"),
            "arm_poll_s": 0.1, "injections": injections,
            "ledger": {"enabled": True, "max_records": max_records,
                       "tick_function": "ledger_sched:Scheduler.get_next_batch_to_run",
                       "coordinators": ["ledger_sched:GroupCoordinator"],
                       "digest": {"enabled": True, "probes": PROBES, "ring": 100}}}
    (tmp / "plan.json").write_text(json.dumps(plan))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "REPRO_PLAN")}
    env.update(PYTHONPATH=str(INJECTORS), REPRO_PLAN=str(tmp / "plan.json"), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([python, str(PROG), str(r), "2", str(tmp / "init"),
                               str(out), "--mode", "ok", "--ticks", str(ticks), "--lifetime-s", "120"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for r in range(2)]
    try:
        for p in procs:
            p.wait(timeout=WAIT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            _, err = p.communicate()
            assert p.returncode == 0, err[-3000:]
    return out


def test_a_slot_leaked_on_rank_0_is_the_first_divergent_state_with_both_values_and_the_tick(torch_python: str,
                                                                                            tmp_path: Path):
    out = _run(torch_python, tmp_path, leak=True)
    diag = diagnose(out)
    st = diag.state
    assert st.status == StateStatus.DIVERGED
    # taken in run_batch of tick 3 (the 3rd matching call): seen at the start of tick 4
    assert st.tick == 4 and list(st.fields) == ["req_to_token_pool.available"]
    assert st.fields["req_to_token_pool.available"] == {0: 7, 1: 8}
    assert "waiting_queue.rids" in st.probes_compared and "ticks" in st.probes_local
    assert "broken" in st.skipped and "RuntimeError" in st.skipped["broken"]
    assert st.ticks_before_collective is None  # no collective diverged: the job completed
    assert diag.divergence.kind == "none"
    assert "rank 0 = 7, rank 1 = 8" in st.summary and "tick 4" in st.summary
    md = "\n".join(diag.markdown_lines(None))
    assert md.index("First divergent state") < md.index("Collective ledger")
    fires = [json.loads(l) for f in out.glob("fires-*.jsonl") for l in f.read_text().splitlines()]
    taken = [f for f in fires if f["event"] == "state_taken"]
    assert [(f["rank"], f["available_before"], f["available_after"]) for f in taken] == [(0, 8, 7)]


def test_a_clean_job_records_equal_state_every_probe_resolved_and_changes_seen(torch_python: str, tmp_path: Path):
    out = _run(torch_python, tmp_path, leak=False, ticks=30, max_records=20)  # rotation: later parts start with a full digest
    assert len(list(out.glob("ledger-*.1.jsonl"))) == 2
    st = diagnose(out).state
    assert st.status == StateStatus.EQUAL and st.tick is None
    assert st.compared is not None and st.compared[1] == 30
    assert all(n > 0 for n in st.changes.values())  # the waiting queue changed every tick
    for rank in (0, 1):  # absent (no tree_cache) is not resolved, not an error
        assert st.resolved[rank] == ["req_to_token_pool.available", "ticks", "waiting_queue.rids"]
    assert set(st.skipped) == {"broken"}
    ring = [json.loads(l) for f in out.glob("digest-*.jsonl") for l in f.read_text().splitlines()]
    assert ring and all(r["probe"] == "waiting_queue.rids" for r in ring)


DIGEST_ALT_PROG = r'''
import json, os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from repro_injector import _runtime
rt = _runtime.activate()
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import tickmod
s = tickmod.Scheduler()
t = torch.ones(2)
t0, starts = time.time(), []
while time.time() - t0 < 1.2:  # a tick every ~10 ms; the probe's value moves every tick
    s.n += 1
    starts.append(time.time())
    s.get_next_batch_to_run()
    dist.all_reduce(t)
    time.sleep(0.01)
time.sleep(0.4)
rt.ledger.log_tick()
rt.ledger.drain()
recs = [json.loads(l) for f in os.listdir(rt.out_dir) if f.startswith("ledger-")
        for l in open(os.path.join(rt.out_dir, f))]
print(json.dumps({"ticks": rt.ledger.tick, "starts": starts,
                  "state_ticks": [r["tick"] for r in recs if r.get("e") == "state"],
                  "enters": sum(1 for r in recs if r.get("e") == "enter"),
                  "tick_lines": len(open(os.path.join(rt.out_dir, "ticks-%d.txt" % os.getpid())).read().split())}))
'''


def test_benchmark_digest_alternation_digests_only_in_even_windows_and_records_every_collective(torch_python: str,
                                                                                               tmp_path: Path):
    """``bench_digest_alternate_s`` (benchmarks/digest_overhead.py ``alternate`` only): the state digest is taken
    only at ticks that start in even windows of that many wall seconds; the ledger records every collective in both
    and every tick's start is logged (``ticks-<pid>.txt``)."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (tmp_path / "tickmod.py").write_text("class Scheduler:\n    n = 0\n    def get_next_batch_to_run(self):\n"
                                         "        return None\n")
    w = 0.2
    plan = {"version": 1, "scenario": "gloo", "variant": "v", "out_dir": str(out_dir), "arm_file": str(tmp_path / "arm"),
            "injections": [], "ledger": {"enabled": True, "max_records": 10000, "coordinators": [],
                                         "tick_function": "tickmod:Scheduler.get_next_batch_to_run",
                                         "bench_digest_alternate_s": w,
                                         "digest": {"enabled": True, "probes": [{"name": "n", "path": "n"}]}}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "REPRO_PLAN")}
    env.update(PYTHONPATH=str(INJECTORS), REPRO_PLAN=str(tmp_path / "plan.json"), OMP_NUM_THREADS="1")
    p = subprocess.Popen([torch_python, "-c", DIGEST_ALT_PROG, str(tmp_path / "init")], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        so, se = p.communicate(timeout=WAIT_S)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode == 0, se[-2000:]
    out = json.loads(so.strip().splitlines()[-1])
    n = out["ticks"]
    assert n > 30 and out["enters"] == n and out["tick_lines"] == 8 * n  # every collective, every tick's start
    starts = out["starts"]
    # the wrapper reads the clock just after the program's ``starts`` stamp: skip ticks within 20 ms of an edge
    odd = [k for k in range(1, n + 1) if int(starts[k - 1] / w) & 1 and int((starts[k - 1] + 0.02) / w) & 1]
    even = [k for k in range(1, n + 1) if not int(starts[k - 1] / w) & 1 and not int((starts[k - 1] + 0.02) / w) & 1]
    assert odd and even
    assert not set(odd) & set(out["state_ticks"])  # no digest in an odd window
    assert set(even) <= set(out["state_ticks"])  # the value moved every tick: a state line at every even tick
