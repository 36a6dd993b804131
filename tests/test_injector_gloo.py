"""Actions on a real 2-process gloo group: the extra collective really runs on the named group (by attribute path and
by calling a method of self), skip does not call the original, return_value replaces the result; ranks gate."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest

from repro.injection_records import read_injector_dir

REPO = Path(__file__).resolve().parent.parent
INJECTORS = REPO / "injectors"
GLOO_TIMEOUT_S = 60  # gloo's own timeout, so a broken injector fails the test instead of hanging it

MODULE = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist

    class Cache:
        def __init__(self, group):
            self.tp_group = group
            self.extra_ops = []

        def _all_reduce_attn_groups(self, tensor, op):
            dist.all_reduce(tensor, op=op, group=self.tp_group)
            self.extra_ops.append(int(tensor.item()))

    class Sched:
        def __init__(self):
            self.tp_cpu_group = dist.new_group(backend="gloo")
            self.cache = Cache(self.tp_cpu_group)
            self.original_calls = 0

        def step(self):
            self.original_calls += 1
            return "original"

    def loop(s):
        return s.step()
    """
)

PROGRAM = textwrap.dedent(
    """
    import datetime, json, sys
    import torch
    import torch.distributed as dist
    import gmod

    rank, world, init_file, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=%d))
    s = gmod.Sched()
    res = {"rank": rank}
    if rank == 0:
        res["step"] = gmod.loop(s)                  # rank 0 fires its extra collective here (if armed)
        t = torch.tensor([100], dtype=torch.int32)
        dist.all_reduce(t, group=s.tp_cpu_group)    # pairs with rank 1's second all_reduce
        res["after"] = int(t.item())
    else:
        partner = torch.tensor([10], dtype=torch.int32)
        if MODE_EXTRA:
            dist.all_reduce(partner, group=s.tp_cpu_group)  # the only partner of rank 0's extra all_reduce
        res["partner"] = int(partner.item())
        res["step"] = gmod.loop(s)
        t = torch.tensor([100], dtype=torch.int32)
        dist.all_reduce(t, group=s.tp_cpu_group)
        res["after"] = int(t.item())
    res["original_calls"] = s.original_calls
    res["extra_ops"] = s.cache.extra_ops
    with open(out, "w") as fh:
        json.dump(res, fh)
    dist.destroy_process_group()
    """
    % GLOO_TIMEOUT_S
)


def _plan(tmp: Path, action: dict, ranks=(0,), rank_group=None) -> Path:
    inj = {
        "id": "inj",
        "site": {"alternatives": ["gmod:Sched.step"], "aliases": []},
        "gate": {"called_from": ["gmod:loop"], "not_called_from": [], "max_depth": 4, "inside_loop": None,
                 "ranks": list(ranks), "rank_group": rank_group, "occurrence": {"mode": "first", "nth": 1, "max_fires": 0}},
        "action": action,
    }
    plan = {"version": 1, "scenario": "gloo", "variant": "v", "out_dir": str(tmp / "out"), "arm_file": str(tmp / "arm"),
            "arm_poll_s": 0.1, "injections": [inj], "faulthandler_signal": "SIGUSR2"}
    (tmp / "arm").write_text("inj\n")
    p = tmp / "plan.json"
    p.write_text(json.dumps(plan))
    return p


def _run_pair(python: str, tmp: Path, plan: Path, extra: bool) -> list[dict]:
    prog = tmp / "prog.py"
    prog.write_text(PROGRAM.replace("MODE_EXTRA", "True" if extra else "False"))
    (tmp / "gmod.py").write_text(MODULE)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "REPRO_PLAN")}
    env.update(PYTHONPATH=os.pathsep.join([str(INJECTORS), str(tmp)]), REPRO_PLAN=str(plan), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([python, str(prog), str(r), "2", str(tmp / "init"), str(tmp / f"res{r}.json")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for r in range(2)]
    errs = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=GLOO_TIMEOUT_S * 3)
            errs.append(err)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for p, err in zip(procs, errs):
        assert p.returncode == 0, err[-3000:]
    return [json.loads((tmp / f"res{r}.json").read_text()) for r in range(2)]


def _counts(tmp: Path) -> dict:
    rep = read_injector_dir(tmp / "out")
    assert rep.ranks_loaded([0, 1]) == [0, 1]
    assert rep.ranks_armed([0, 1]) == [0, 1]
    return rep.counts_by_rank("inj")


def test_extra_all_reduce_runs_on_the_named_group(torch_python: str, tmp_path: Path):
    plan = _plan(tmp_path, {"kind": "extra_collective", "op": "all_reduce", "group": "tp_cpu_group", "method": None, "when": "before"})
    r0, r1 = _run_pair(torch_python, tmp_path, plan, extra=True)
    assert r1["partner"] == 11  # rank 1's lone all_reduce met rank 0's injected 1-element int all_reduce (10 + 1)
    assert r0["after"] == r1["after"] == 200  # and the groups stay in step afterwards
    assert r0["step"] == r1["step"] == "original" and r0["original_calls"] == 1
    c = _counts(tmp_path)
    assert c["entered"] == {0: 1, 1: 1} and c["fired"] == {0: 1, 1: 0}
    rep = read_injector_dir(tmp_path / "out")
    assert rep.fired_ranks("inj") == [0] and rep.entered_on_all("inj", [0, 1]) and rep.matched_total("inj") == 1


def test_extra_collective_by_method_of_self(torch_python: str, tmp_path: Path):
    plan = _plan(tmp_path, {"kind": "extra_collective", "op": "all_reduce", "group": None, "method": "cache._all_reduce_attn_groups",
                            "when": "before"})
    r0, r1 = _run_pair(torch_python, tmp_path, plan, extra=True)
    assert r0["extra_ops"] == [10]  # MAX(1, 10) through the cache's own method
    assert r1["partner"] == 10 and r0["after"] == 200


def test_skip_does_not_call_the_original(torch_python: str, tmp_path: Path):
    # ranks counted in the group reached from self (here the same 2 ranks as the world)
    plan = _plan(tmp_path, {"kind": "skip", "value": ["skipped"]}, ranks=(1,), rank_group="tp_cpu_group")
    r0, r1 = _run_pair(torch_python, tmp_path, plan, extra=False)
    assert r1["step"] == ["skipped"] and r1["original_calls"] == 0
    assert r0["step"] == "original" and r0["original_calls"] == 1
    assert _counts(tmp_path)["fired"] == {0: 0, 1: 1}


def test_return_value_calls_the_original_and_replaces_its_result(torch_python: str, tmp_path: Path):
    plan = _plan(tmp_path, {"kind": "return_value", "value": 0, "call_original": True}, ranks=(0,))
    r0, r1 = _run_pair(torch_python, tmp_path, plan, extra=False)
    assert r0["step"] == 0 and r0["original_calls"] == 1
    assert r1["step"] == "original"
