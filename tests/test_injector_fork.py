"""The injector's fork-ranks opt-in (``REPRO_FORK_RANKS=1``, ``repro_injector._fork``) on a real multiprocessing
program (tests/gloo_programs/fork_ranks.py, no SGLang): the switch from spawn to fork happens only under the opt-in,
only for the spawn call the plan names (the SGLang adapter's profile: sglang's launcher) on a CPU device, and a forked
rank has its own records and live injector threads. A plan that names no caller (an engine without one) leaves it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from repro.injection_records import read_injector_dir
from repro.targets.sglang import SGLangAdapter

REPO = Path(__file__).resolve().parent.parent
INJECTORS = REPO / "injectors"
PROG = REPO / "tests" / "gloo_programs" / "fork_ranks.py"

TARGET = """
class Worker:
    def step(self, i):
        return i
"""


def _launch(torch_python: str, tmp: Path, fork_env: str | None, *args: str,
            fork_ranks: dict | None = None) -> tuple[dict, dict, subprocess.CompletedProcess]:
    (tmp / "fork_target.py").write_text(TARGET)
    out = tmp / "out"
    plan = {"version": 1, "scenario": "t", "variant": "v", "out_dir": str(out), "arm_file": str(tmp / "arm"),
            "arm_poll_s": 0.1, "faulthandler_signal": "SIGUSR2",
            "injections": [{"id": "noop", "site": {"alternatives": ["fork_target:Worker.step"], "aliases": []},
                            "gate": {"called_from": [], "not_called_from": [], "max_depth": 16, "inside_loop": None,
                                     "ranks": [], "rank_group": None,
                                     "occurrence": {"mode": "every", "nth": 1, "max_fires": 0}},
                            "action": {"kind": "none"}}],
            "ledger": {"enabled": True, "max_records": 1000},
            "fork_ranks": SGLangAdapter().injector_profile.fork_plan() if fork_ranks is None else fork_ranks}
    (tmp / "plan.json").write_text(json.dumps(plan))
    env = {k: v for k, v in os.environ.items() if k not in ("REPRO_PLAN", "PYTHONPATH", "REPRO_FORK_RANKS")}
    env["PYTHONPATH"] = os.pathsep.join([str(INJECTORS), str(tmp)])
    env["REPRO_PLAN"] = str(tmp / "plan.json")
    if fork_env is not None:
        env["REPRO_FORK_RANKS"] = fork_env
    r = subprocess.run([torch_python, str(PROG), str(tmp), str(tmp / "arm"), *args], env=env, cwd=tmp,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads((tmp / "parent.json").read_text()), json.loads((tmp / "rank.json").read_text()), r


def _events(out: Path, pid: int) -> list[dict]:
    return [json.loads(ln) for ln in (out / f"fires-{pid}.jsonl").read_text().splitlines() if ln.strip()]


def test_opt_in_forks_the_rank_which_gets_its_own_records_and_live_injector_threads(torch_python: str, tmp_path: Path):
    parent, rank, _ = _launch(torch_python, tmp_path, "1")
    out = tmp_path / "out"
    assert parent["start_method"] == "fork"
    assert rank["ppid"] == parent["pid"] and rank["pid"] == parent["child"]
    # what a spawned rank has: spawn as its own default, SIGQUIT back to the default, the site patched once
    forked = [e for e in _events(out, rank["pid"]) if e.get("event") in ("forked_rank", "error")]
    assert rank["start_method"] == "spawn" and rank["sigquit_default"] is True, (rank, forked)
    assert rank["wrappers"] == 1 and rank["step"] == 3
    assert {"repro-injector", "repro-ledger"} <= set(rank["threads"])
    assert "launcher-side-thread" not in rank["threads"]
    # spawn's one resource tracker, the parent's, also serves the forked rank (no tracker of the rank's own)
    assert [ppid for _pid, ppid in rank["trackers"]] == [parent["pid"]]
    # its own marker (pid, parent), its own fires log with the armed event its polling thread wrote, its own ledger
    assert rank["armed_seen"] is True and rank["ledger_written"] is True
    rep = read_injector_dir(out)
    markers = {m.pid: m for m in rep.markers}
    assert {parent["pid"], rank["pid"]} <= set(markers)
    others = set(markers) - {parent["pid"], rank["pid"]}  # the resource tracker, an interpreter of its own
    assert [p for p, _pp in rank["trackers"]] == sorted(others)
    assert markers[rank["pid"]].sites["noop"].patched
    raw = json.loads((out / f"loaded-{rank['pid']}.json").read_text())
    assert raw["forked_from"] == parent["pid"]
    assert (out / f"ledger-{rank['pid']}.jsonl").exists() and not (out / f"ledger-{parent['pid']}.jsonl").exists()
    # the parent recorded the switch and the threads alive at the fork point
    pev = _events(out, parent["pid"])
    sm = [e for e in pev if e["event"] == "start_method"]
    assert sm and sm[0]["used"] == "fork"
    (fp,) = [e for e in pev if e["event"] == "fork_point"]
    names = {t["name"] for t in fp["python_threads"]}
    assert {"MainThread", "repro-injector", "repro-ledger", "launcher-side-thread"} <= names
    assert len(fp["native_threads"]) >= len(fp["python_threads"])
    (fr,) = [e for e in _events(out, rank["pid"]) if e["event"] == "forked_rank"]
    assert fr["parent"] == parent["pid"] and "SIGQUIT" in fr["signals_restored"]


@pytest.mark.parametrize("fork_env,args", [
    (None, ()),                          # off by default
    ("0", ()),                           # explicitly off
    ("1", ("--caller", "other")),        # not sglang's call: left alone
    ("1", ("--method", "forkserver")),   # only a spawn request is switched
])
def test_start_method_is_left_alone_without_the_opt_in_or_outside_sglangs_spawn_call(
        torch_python: str, tmp_path: Path, fork_env, args):
    parent, rank, _ = _launch(torch_python, tmp_path, fork_env, *args)
    want = "forkserver" if "forkserver" in args else "spawn"
    assert parent["start_method"] == want
    assert rank["pid"] == parent["child"] and rank["start_method"] == want
    assert rank["ledger_written"] is True  # a spawned rank has its records too (its own interpreter's injector)
    if want == "spawn":
        assert [ppid for _pid, ppid in rank["trackers"]] == [parent["pid"]]  # what the fork path must match
    assert not any(e["event"] == "start_method" for e in _events(tmp_path / "out", parent["pid"])
                   if (tmp_path / "out" / f"fires-{parent['pid']}.jsonl").exists())


def test_a_plan_without_a_fork_caller_leaves_the_start_method_alone(torch_python: str, tmp_path: Path):
    """The engine's adapter names the call (the plan's ``fork_ranks``); the injector itself names none."""
    parent, rank, _ = _launch(torch_python, tmp_path, "1", fork_ranks={})
    assert parent["start_method"] == "spawn" and rank["start_method"] == "spawn"
    assert not any(e["event"] in ("start_method", "fork_ranks_refused") for e in _events(tmp_path / "out", parent["pid"])
                   if (tmp_path / "out" / f"fires-{parent['pid']}.jsonl").exists())


def test_a_gpu_device_keeps_spawn_and_says_why(torch_python: str, tmp_path: Path):
    parent, rank, r = _launch(torch_python, tmp_path, "1", "--device", "cuda")
    assert parent["start_method"] == "spawn" and rank["start_method"] == "spawn"
    assert "REPRO_FORK_RANKS=1 needs --device cpu" in r.stderr
    assert "keeps spawn" in (tmp_path / "out" / "errors.log").read_text()
    (ev,) = [e for e in _events(tmp_path / "out", parent["pid"]) if e["event"] == "fork_ranks_refused"]
    assert "'cuda'" in ev["reason"]
