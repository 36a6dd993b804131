"""The collective ledger on real gloo jobs (tests/gloo_programs/ledger_sched.py under the injector): records on
both ranks, nested coordinator calls counted once, scheduler ticks, a hung rank's record on disk while it is blocked
(the writer thread runs while gloo holds no GIL), the injected collective named at its site, reduce-op mismatch,
rotation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from repro.ledger import align, check_consistent, load_ledgers, per_tick_counts

REPO = Path(__file__).resolve().parent.parent
INJECTORS = REPO / "injectors"
PROG = REPO / "tests" / "gloo_programs" / "ledger_sched.py"
WAIT_S = 90.0  # generous bound for slow CI; not a speed assertion


def _plan(tmp: Path, max_records: int = 1000, inject: bool = False, armed_quiet: bool = False) -> Path:
    out = tmp / "out"
    out.mkdir()
    injections = []
    if inject:
        injections = [{
            "id": "extra", "site": {"alternatives": ["ledger_sched:Scheduler.run_batch"], "aliases": []},
            "gate": {"called_from": [], "not_called_from": [], "max_depth": 8, "inside_loop": None, "ranks": [0],
                     "rank_group": None, "occurrence": {"mode": "nth", "nth": 4, "max_fires": 1}},
            "action": {"kind": "extra_collective", "op": "all_reduce", "group": "tp_cpu_group", "method": None,
                       "when": "before"}}]
        (tmp / "arm").write_text("extra\n")
    if armed_quiet:  # armed from the start, at a site the job never calls: nothing fires, the ledger sees the arming
        injections = [{
            "id": "quiet", "site": {"alternatives": ["ledger_sched:Scheduler.explode"], "aliases": []},
            "gate": {"called_from": [], "not_called_from": [], "max_depth": 8, "inside_loop": None, "ranks": [0],
                     "rank_group": None, "occurrence": {"mode": "first", "nth": 1, "max_fires": 1}},
            "action": {"kind": "none"}}]
        (tmp / "arm").write_text("quiet\n")
    plan = {"version": 1, "scenario": "gloo", "variant": "v", "out_dir": str(out), "arm_file": str(tmp / "arm"),
            "arm_poll_s": 0.1, "injections": injections,
            "ledger": {"enabled": True, "max_records": max_records,
                       "tick_function": "ledger_sched:Scheduler.get_next_batch_to_run",
                       "coordinators": ["ledger_sched:GroupCoordinator"]}}
    p = tmp / "plan.json"
    p.write_text(json.dumps(plan))
    return p


def _start(python: str, tmp: Path, plan: Path, mode: str, world: int = 2, ticks: int = 5, odd: int = 0) -> list:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "REPRO_PLAN")}
    env.update(PYTHONPATH=str(INJECTORS), REPRO_PLAN=str(plan), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    return [subprocess.Popen([python, str(PROG), str(r), str(world), str(tmp / "init"), str(tmp / "out"), "--mode", mode,
                              "--ticks", str(ticks), "--odd-rank", str(odd), "--lifetime-s", "120"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
            for r in range(world)]


def _end(procs: list) -> list[str]:
    errs = []
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        _, err = p.communicate()
        errs.append(err)
    return errs


def _finish(procs: list) -> None:
    try:
        for p in procs:
            p.wait(timeout=WAIT_S)
    finally:
        errs = _end(procs)
    for p, err in zip(procs, errs):
        assert p.returncode == 0, err[-3000:]


def test_healthy_job_ledgers_agree_with_ticks_and_coordinator_calls_counted_once(torch_python: str, tmp_path: Path):
    procs = _start(torch_python, tmp_path, _plan(tmp_path), "ok", ticks=6)
    _finish(procs)
    leds = load_ledgers(tmp_path / "out")
    assert sorted(leds) == [0, 1]
    assert check_consistent(leds) == [] and align(leds).kind == "none"
    led = leds[0]
    labels = {g.label for g in led.groups.values()}
    assert {"tp/cpu", "tp/device"} <= labels
    by_label = {led.groups[r.group].label: r for r in led.records}
    # 6 ticks: 2 broadcasts each on tp/cpu (+ all_gather_object on ticks 3, 6), one coordinator all_reduce on tp/device
    dev = [r for r in led.records if led.groups[r.group].label == "tp/device"]
    cpu = [r for r in led.records if led.groups[r.group].label == "tp/cpu"]
    assert [r.op for r in dev] == ["all_reduce"] * 6 and {r.api for r in dev} == {"GroupCoordinator.all_reduce"}
    assert [r.op for r in cpu].count("broadcast") == 12 and [r.op for r in cpu].count("all_gather_object") == 2
    assert [r.seq for r in cpu] == list(range(1, 15))
    assert dev[0].shapes == ((4,),) and dev[0].dtypes == ("float32",) and dev[0].red == "SUM"
    assert cpu[0].site[0] == "ledger_sched:broadcast_pyobj" and dev[0].site[0] == "ledger_sched:Scheduler.run_batch"
    assert [r.tick for r in dev] == [1, 2, 3, 4, 5, 6] and by_label
    assert per_tick_counts(leds, "tp/device") == {0: {t: 1 for t in range(1, 7)}, 1: {t: 1 for t in range(1, 7)}}
    assert all(r.t_exit is not None and r.t_exit >= r.t_enter for r in led.records)


def test_small_cpu_tensors_values_are_recorded_in_and_out_of_reductions_and_broadcasts(torch_python: str,
                                                                                         tmp_path: Path):
    """The per-rank answer each rank put into a MIN reduction and what every rank got back, from the ledger alone;
    the coordinator's nested torch call gives its values to the coordinator's record; a large tensor and an async
    call's result are not read."""
    procs = _start(torch_python, tmp_path, _plan(tmp_path), "values", ticks=3)
    _finish(procs)
    leds = load_ledgers(tmp_path / "out")
    assert check_consistent(leds) == [] and align(leds).kind == "none"
    for rank, led in leds.items():
        cpu = [r for r in led.records if led.groups[r.group].label == "tp/cpu"]
        mins = [r for r in cpu if r.red == "MIN"]
        assert [(r.tick, r.vin, r.vout) for r in mins] == [(t, 10 * (rank + 1) + t, 10 + t) for t in (1, 2, 3)]
        sums = [r for r in cpu if r.op == "all_reduce" and r.red == "SUM"]
        assert [(r.shapes, r.dtypes, r.vin, r.vout) for r in sums] == [
            (((32,),), ("float32",), None, None), (((2,),), ("int64",), [1, 1], None),  # async: no values after it
            (((2,),), ("float32",), None, None), (((65,),), ("int32",), None, None)] * 3
        sizes = [r for r in cpu if r.op == "broadcast" and r.shapes == ((1,),)]
        assert [(r.vin, r.vout) for r in sizes] == [([3] if rank == 0 else [0], [3])] * 3
        dev = [r for r in led.records if led.groups[r.group].label == "tp/device"]
        assert {r.api for r in dev} == {"GroupCoordinator.all_reduce"}
        assert [(r.vin, r.vout) for r in dev] == [(None, None), ([rank, 1], [1, 1])] * 3  # floats: none; ints: both
    # read back as a natural nemesis's evidence: the first reduction from tick 2 on whose inputs differed
    from repro.natural_effect import reduction_inputs

    t2 = min(r.t_enter for r in leds[1].records if r.tick == 2)
    i = reduction_inputs(leds, 1, since_time=t2, window_s=60.0, thread="MainThread")
    assert i is not None and i.collective.startswith("all_reduce MIN @ Scheduler.run_batch") and i.tick == 2
    assert (i.inputs, i.outputs, i.before) == ({0: 12, 1: 22}, {0: 12, 1: 12}, (1, 1)) and i.reconciled


def _wait_for(pred, what: str):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_hung_injected_collective_is_on_disk_while_blocked_and_is_the_first_divergence(torch_python: str,
                                                                                         tmp_path: Path):
    procs = _start(torch_python, tmp_path, _plan(tmp_path, inject=True), "inject", ticks=3)
    try:
        _wait_for(lambda: all((tmp_path / "out" / f"ready-{r}").exists() for r in (0, 1)), "both ranks ready")

        last: list = [None, 0.0]

        def hung():  # both ranks blocked and the files unchanged for longer than the writer thread's period
            leds = load_ledgers(tmp_path / "out")  # (0.5 s > SELF_WRITE_S + WRITER_PERIOD_S: no write is still to come)
            key = [(r, len(l.records), len(l.open_records())) for r, l in sorted(leds.items())]
            if key != last[0]:
                last[0], last[1] = key, time.monotonic()
            stable = time.monotonic() - last[1] >= 0.5
            return leds if stable and len(leds) == 2 and all(l.open_records() for l in leds.values()) else None

        leds = _wait_for(hung, "both ranks' open records on disk")
        assert all(p.poll() is None for p in procs)  # still blocked: the writer thread flushed during the collective
        d = align(leds)
        assert d.kind == "missing" and d.group.label == "tp/cpu" and list(d.entered) == [0] and d.missing == (1,)
        inj = d.entered[0]
        assert inj.inj == "extra" and inj.op == "all_reduce" and inj.site[0] == "ledger_sched:Scheduler.run_batch"
        assert inj.shapes == ((1,),) and inj.dtypes == ("int32",) and inj.tick == 4
        w = d.waits[1]
        assert leds[1].groups[w.group].label == "tp/device" and w.op == "all_reduce" and w.inj is None
        assert w.api == "GroupCoordinator.all_reduce" and w.site[0] == "ledger_sched:Scheduler.run_batch"
        assert d.summary.startswith("rank 0 entered the injected all_reduce #")
        assert "rank 1 never did and waits in all_reduce #4 on the TP device group from Scheduler.run_batch" in d.summary
        fires = [json.loads(l) for f in (tmp_path / "out").glob("fires-*.jsonl") for l in f.read_text().splitlines()]
        assert [f["rank"] for f in fires if f["event"] == "fire"] == [0]
    finally:
        _end(procs)


def test_reduce_op_mismatch_completes_but_the_ledger_names_the_culprit(torch_python: str, tmp_path: Path):
    procs = _start(torch_python, tmp_path, _plan(tmp_path), "mismatch-red", world=3, ticks=3, odd=2)
    _finish(procs)
    leds = load_ledgers(tmp_path / "out")
    d = align(leds)
    assert d.kind == "mismatch" and d.fields == ("red",) and d.culprits == (2,) and d.group.label == "tp/device"
    assert d.seq == 2 and d.entered[2].red == "MIN" and d.entered[0].red == "SUM"


def test_rotation_keeps_the_newest_records_and_says_how_many_were_dropped(torch_python: str, tmp_path: Path):
    procs = _start(torch_python, tmp_path, _plan(tmp_path, max_records=20), "ok", ticks=30)
    _finish(procs)
    out = tmp_path / "out"
    assert len(list(out.glob("ledger-*.1.jsonl"))) == 2
    leds = load_ledgers(out)
    for led in leds.values():
        assert led.dropped > 0 and 10 <= len(led.records) <= 20
        assert led.records[-1].tick == 30
    assert align(leds).kind == "none"
    assert any("dropped" in p for p in check_consistent(leds))


def test_rotation_keeps_the_two_parts_from_the_arming_on_every_rank(torch_python: str, tmp_path: Path):
    """A long run after the arming (a stall ticking on) rotates many parts: the part current at the arming and the
    next one are kept as .3 / .2 on both ranks, so the records right after the arming survive beside the newest."""
    procs = _start(torch_python, tmp_path, _plan(tmp_path, max_records=20, armed_quiet=True), "ok", ticks=40)
    _finish(procs)
    out = tmp_path / "out"
    for part in (3, 2, 1):
        assert len(list(out.glob(f"ledger-*.{part}.jsonl"))) == 2, part
    leds = load_ledgers(out)
    for led in leds.values():
        ticks = [r.tick for r in led.records]
        assert ticks[0] <= 3 and ticks[-1] == 40  # the first ticks (the arming's) and the newest ones
        gap = [b for a, b in zip(ticks, ticks[1:]) if b - a > 1]
        assert len(gap) == 1  # one gap: between the kept parts and .1
        # every record counted once: 2 broadcasts + 1 all_reduce per tick, an all_gather_object every 3rd, the barrier
        assert led.dropped > 0 and led.dropped + len(led.records) == 40 * 3 + 40 // 3 + 1
    assert align(leds).kind == "none"
    by = {r: {(x.group, x.seq) for x in led.records} for r, led in leds.items()}
    assert by[0] == by[1]  # the same records kept on both ranks


def test_coordinator_call_that_never_reaches_torch_is_on_disk_while_it_blocks(torch_python: str, tmp_path: Path):
    procs = _start(torch_python, tmp_path, _plan(tmp_path), "bypass-hang", ticks=3)
    try:
        def blocked():
            leds = load_ledgers(tmp_path / "out")
            r0 = leds.get(0)
            return r0 if r0 is not None and any(r.bypass for r in r0.open_records()) else None

        r0 = _wait_for(blocked, "rank 0's pending coordinator record on disk")
        assert procs[0].poll() is None
        rec = next(r for r in r0.open_records() if r.bypass)
        assert rec.op == "barrier" and rec.api == "GroupCoordinator.barrier" and r0.groups[rec.group].label == "tp/cpu"
        assert rec.site[0] == "ledger_sched:main" and rec.tick == 3
    finally:
        _end(procs)


IDLE_PROG = r'''
import json, os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from repro_injector import _runtime
rt = _runtime.activate()
led = rt.ledger
out = {}
time.sleep(0.3)  # the writer thread reaches its idle wait
w0 = led.wakes
time.sleep(1.2)
out["idle_wakes"] = led.wakes - w0  # nothing queued: the writer thread slept through
t = torch.ones(2)
dist.all_reduce(t)  # the first collective: its thread writes the queue at the entry (no write for 50 ms)
files = [f for f in os.listdir(rt.out_dir) if f.startswith("ledger-")]
out["enter_on_disk_at_return"] = any('"e":"enter"' in open(os.path.join(rt.out_dir, f)).read() for f in files)
time.sleep(0.6)
out["exit_on_disk_after"] = any('"e":"exit"' in open(os.path.join(rt.out_dir, f)).read() for f in files)
w0, t0 = led.wakes, time.time()
while time.time() - t0 < 1.0:  # a busy rank: a collective every ~1 ms
    dist.all_reduce(t)
    time.sleep(0.001)
out["busy_wakes_per_s"] = (led.wakes - w0) / (time.time() - t0)
out["busy_records"] = led.total
print(json.dumps(out))
'''


def _run_plan_prog(torch_python: str, prog: str, tmp_path: Path) -> dict:
    """Run ``prog`` (one process, the injector loaded from ``tmp_path/plan.json``) in its own process group, ended
    by group on a timeout; returns the JSON object of its last stdout line."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "REPRO_PLAN")}
    env.update(PYTHONPATH=str(INJECTORS), REPRO_PLAN=str(tmp_path / "plan.json"), OMP_NUM_THREADS="1")
    p = subprocess.Popen([torch_python, "-c", prog, str(tmp_path / "init")], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        so, se = p.communicate(timeout=WAIT_S)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode == 0, se[-2000:]
    return json.loads(so.strip().splitlines()[-1])


def test_writer_thread_sleeps_while_nothing_is_queued_and_a_busy_rank_writes_its_own_records(torch_python: str,
                                                                                                tmp_path: Path):
    """The writer thread does not wake in an idle process; a collective's record is on disk when the call returns
    (the calling thread wrote it); on a busy rank the writer wakes at most every WRITER_PERIOD_S (150 ms)."""
    plan = json.loads(_plan(tmp_path).read_text())
    plan["ledger"].update(tick_function="", coordinators=[])
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out = _run_plan_prog(torch_python, IDLE_PROG, tmp_path)
    assert out["idle_wakes"] == 0
    assert out["enter_on_disk_at_return"] and out["exit_on_disk_after"]
    assert out["busy_records"] > 100 and out["busy_wakes_per_s"] <= 1 / 0.15 + 1


ALTERNATE_PROG = r'''
import json, os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from repro_injector import _runtime
rt = _runtime.activate()
led = rt.ledger
w = led.alternate_s
t = torch.ones(2)
calls, even_calls, t0 = 0, 0, time.time()
while time.time() - t0 < 1.3:  # six windows of 0.2 s: a collective and a tick every ~5 ms
    led.tick += 1
    led.log_tick()
    even_calls += 0 if int(time.time() / w) & 1 else 1
    dist.all_reduce(t)
    calls += 1
    time.sleep(0.005)
time.sleep(0.4)
led.log_tick()  # the first tick after a 0.3 s gap writes the ticks held so far
led.drain()
recs = [json.loads(l) for f in os.listdir(rt.out_dir) if f.startswith("ledger-")
        for l in open(os.path.join(rt.out_dir, f))]
enters = [r for r in recs if r.get("e") == "enter"]
ticks = open(os.path.join(rt.out_dir, "ticks-%d.txt" % os.getpid())).read().split("\n")
print(json.dumps({"w": w, "calls": calls, "even_calls": even_calls, "enters": len(enters),
                  # decided at the call's entry, stamped after the group and site lookups: on a loaded box a record
                  # of a call that entered just before an odd window can carry a time a few ms into it
                  "odd_enters": sum(1 for r in enters if int(r["t"] / w) & 1 and int((r["t"] - 0.05) / w) & 1),
                  "tick_lines": [l.split() for l in ticks if l]}))
'''


def test_benchmark_alternation_records_only_in_even_windows_and_logs_every_tick(torch_python: str, tmp_path: Path):
    """``bench_alternate_s`` (benchmarks/ledger_proof.py ``alternate`` only): collectives are recorded in even
    windows of that many wall seconds and passed straight through in odd ones; every tick's start is logged in both
    (``ticks-<pid>.txt``), written at the latest by the first tick after a gap (the other tests here run without
    the key and see every collective)."""
    plan = json.loads(_plan(tmp_path).read_text())
    plan["ledger"].update(tick_function="", coordinators=[], bench_alternate_s=0.2)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out = _run_plan_prog(torch_python, ALTERNATE_PROG, tmp_path)
    assert out["w"] == 0.2 and out["odd_enters"] == 0
    assert 0 < out["enters"] < out["calls"] and abs(out["enters"] - out["even_calls"]) <= 2
    lines = out["tick_lines"]  # tick, start, ticking thread's CPU, hot-path s, writer CPU s, writer wake-ups, gc s, full gcs
    assert {len(r) for r in lines} == {8}
    assert [int(r[0]) for r in lines] == list(range(1, out["calls"] + 1))  # all on disk after the gap's tick
    for i in (1, 2, 3, 4, 5, 6, 7):
        col = [float(r[i]) for r in lines]
        assert col == sorted(col)
    assert float(lines[-1][1]) - float(lines[0][1]) >= 1.2 and float(lines[-1][3]) > 0.0


TICK_PROG = r'''
import json, os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from repro_injector import _runtime
rt = _runtime.activate()
led = rt.ledger
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import tickmod
s = tickmod.Scheduler()
t = torch.ones(2)

def on_disk():
    return sum(l.count('"e":"enter"') for f in os.listdir(rt.out_dir) if f.startswith("ledger-")
               for l in open(os.path.join(rt.out_dir, f)))

calls, behind, t0, last_tick, max_gap = 0, 0, time.time(), None, 0.0
while time.time() - t0 < 1.2:  # a busy rank: a tick every ~10 ms, three collectives each
    now = time.time()
    max_gap = max(max_gap, now - last_tick) if last_tick else 0.0
    last_tick = now
    s.get_next_batch_to_run()
    behind = max(behind, calls - on_disk())  # every record of the previous ticks is on disk at a tick's start
    for _ in range(3):
        dist.all_reduce(t)
        calls += 1
    time.sleep(0.01)
busy_writer_drains = led.writer_drains
for _ in range(3):
    dist.all_reduce(t)  # then no tick: a rank stuck between ticks (or blocked in a collective)
calls += 3
time.sleep(0.4)
print(json.dumps({"calls": calls, "ticks": led.tick, "behind": behind, "busy_writer_drains": busy_writer_drains,
                  "max_gap": max_gap,
                  "on_disk_after_pause": on_disk(), "writer_drains": led.writer_drains}))
'''


def test_the_ticking_thread_writes_at_each_tick_and_the_writer_thread_only_for_a_rank_between_ticks(
        torch_python: str, tmp_path: Path):
    """With a tick function the ticking thread writes the queue at every tick's start (the same tick on every rank,
    so the ranks' write delays overlap instead of adding up); the writer thread leaves a ticking rank's queue alone
    and writes records that waited SELF_WRITE_S + WRITER_PERIOD_S (250 ms) without a tick."""
    (tmp_path / "tickmod.py").write_text("class Scheduler:\n    def get_next_batch_to_run(self):\n        return None\n")
    plan = json.loads(_plan(tmp_path).read_text())
    plan["ledger"].update(tick_function="tickmod:Scheduler.get_next_batch_to_run", coordinators=[])
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out = _run_plan_prog(torch_python, TICK_PROG, tmp_path)
    assert out["ticks"] > 30 and out["calls"] == 3 * out["ticks"] + 3
    # nothing waited for the writer thread, unless this process itself stalled between ticks for SELF_WRITE_S
    # (100 ms; a loaded CI box), when the writer thread rightly wrote for it
    if out["max_gap"] < 0.09:
        assert out["behind"] == 0
        assert out["busy_writer_drains"] <= 1  # at most its first wake-up, before the first tick wrote
    assert out["on_disk_after_pause"] == out["calls"] and out["writer_drains"] > out["busy_writer_drains"]


SINGLE_PROG = r'''
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from repro_injector import _runtime
rt = _runtime.activate()
out = torch.empty(2)
dist.all_gather_single(out, torch.ones(2))
rt.ledger.drain()
recs = [json.loads(l) for f in os.listdir(rt.out_dir) if f.startswith("ledger-")
        for l in open(os.path.join(rt.out_dir, f))]
print(json.dumps([[r["op"], r["api"], r["shapes"]] for r in recs if r.get("e") == "enter"]))
'''


def test_torch_2_14_all_gather_single_is_recorded_as_its_wire_op(torch_python: str, tmp_path: Path):
    """sglang 0.5.23's ``GroupCoordinator.all_gather`` on CPU calls torch 2.14's ``all_gather_single`` (imported in
    ``sglang/srt/distributed/utils.py``): a torch-level record with the wire op, not a coordinator bypass record."""
    plan = json.loads(_plan(tmp_path).read_text())
    plan["ledger"].update(tick_function="", coordinators=[])
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out = _run_plan_prog(torch_python, SINGLE_PROG, tmp_path)
    assert out == [["all_gather_into_tensor", "torch.distributed.all_gather_single", [[2], [2]]]]


RAISE_PROG = r'''
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from repro_injector import _runtime
rt = _runtime.activate()
t = torch.ones(2)
dist.all_reduce(t)  # written at its entry (nothing was written yet); the next call comes well within 50 ms
err = None
try:
    dist.broadcast(t, src=5)  # no rank 5 in a world of 1: torch raises inside the wrapped call
except Exception as e:
    err = type(e).__name__
# no drain, no waiting: what is on disk the instant the exception reached the caller (SGLang's scheduler would now
# tell its parent to end the tree)
recs = [json.loads(l) for f in os.listdir(rt.out_dir) if f.startswith("ledger-")
        for l in open(os.path.join(rt.out_dir, f))]
print(json.dumps({"err": err, "recs": [[r["e"], r.get("op"), r.get("seq"), bool(r.get("err"))] for r in recs
                                       if r.get("e") in ("enter", "exit")]}))
'''


def test_a_collective_that_raises_has_its_enter_and_failed_exit_on_disk_before_the_exception_returns(
        torch_python: str, tmp_path: Path):
    """A backend error raised into the caller (gloo's checks, a timeout) usually ends the rank at once: the ledger
    writes the failed call's records synchronously, not 150 ms later on the writer thread, so a crash on a
    mismatched collective leaves the record that shows it."""
    plan = json.loads(_plan(tmp_path).read_text())
    plan["ledger"].update(tick_function="", coordinators=[])
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out = _run_plan_prog(torch_python, RAISE_PROG, tmp_path)
    assert out["err"] is not None
    assert ["enter", "broadcast", 2, False] in out["recs"] and ["exit", None, 2, True] in out["recs"]
