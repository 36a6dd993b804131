"""The injector features `repro hunt` relies on, in real subprocesses: observe mode with caller recording (one
``seen`` event per distinct call place, with the enclosing ``for`` loops) and ``return_value`` with ``offset``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from repro.injection_records import read_injector_dir

REPO = Path(__file__).resolve().parent.parent
INJECTORS = REPO / "injectors"

TARGET = """
class Pool:
    def free(self):
        return 7

def admit(pool, queue):
    n = pool.free()            # before the loop
    taken = []
    for req in queue:
        if len(taken) >= pool.free():   # inside the loop
            break
        taken.append(req)
    return n, taken

def outer(pool):
    for batch in range(2):
        admit(pool, [1, 2])
"""


def _plan(tmp: Path, action: dict) -> Path:
    gate = {"called_from": [], "not_called_from": [], "max_depth": 16, "inside_loop": None, "ranks": [],
            "rank_group": None, "occurrence": {"mode": "every", "nth": 1, "max_fires": 0}}
    plan = {"version": 1, "scenario": "t", "variant": "v", "out_dir": str(tmp / "out"), "arm_file": str(tmp / "arm"),
            "arm_poll_s": 0.05, "faulthandler_signal": "",
            "injections": [{"id": "p", "site": {"alternatives": ["hunt_target:Pool.free"], "aliases": []}, "gate": gate,
                            "action": action}]}
    (tmp / "hunt_target.py").write_text(textwrap.dedent(TARGET))
    (tmp / "arm").write_text("p\n")
    path = tmp / "plan.json"
    path.write_text(json.dumps(plan))
    return path


def _run(tmp: Path, plan: Path, code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("REPRO_PLAN", "PYTHONPATH")}
    env["PYTHONPATH"] = os.pathsep.join([str(INJECTORS), str(tmp)])
    env["REPRO_PLAN"] = str(plan)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=tmp, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_observe_mode_records_each_call_place_once_with_its_enclosing_loops(tmp_path: Path) -> None:
    plan = _plan(tmp_path, {"kind": "none", "record_callers": True})
    _run(tmp_path, plan, "import hunt_target as t\nt.outer(t.Pool())\nprint(t.admit(t.Pool(), [1]))\n")
    seen = []
    for f in (tmp_path / "out").glob("fires-*.jsonl"):
        seen += [json.loads(line) for line in f.read_text().splitlines() if '"seen"' in line]
    seen = [s for s in seen if s["event"] == "seen"]
    # two call places in admit (before the loop, inside it) reached from outer's loop, each recorded once although
    # called many times; the same two places reached from the module's top level are other places (own events)
    from_outer = [s for s in seen if s["stack"][1:2] == ["hunt_target:outer"]]
    assert len(from_outer) == 2 and len(seen) == 4, seen
    by_loop = {tuple(s["loops"][0]): s for s in from_outer}
    assert set(by_loop) == {(), ("req",)}
    inside = by_loop[("req",)]
    assert inside["caller"] == "hunt_target:admit"
    assert inside["stack"][:2] == ["hunt_target:admit", "hunt_target:outer"]
    assert inside["loops"][1] == ["batch"]  # the caller's caller is inside its own loop
    rep = read_injector_dir(tmp_path / "out")
    assert rep.counts_by_rank("p")["fired"] in ({}, {None: 0}) or not any(rep.counts_by_rank("p")["fired"].values())


def test_return_value_offset_drifts_the_original_result(tmp_path: Path) -> None:
    plan = _plan(tmp_path, {"kind": "return_value", "value": None, "call_original": True, "offset": -1})
    out = _run(tmp_path, plan, "import hunt_target as t\nprint(repr(t.Pool().free()), repr(t.Pool().free()))\n")
    assert out.split() == ["6", "6"]  # every call (occurrence every), int stays int


def test_a_drift_on_a_result_that_is_no_number_returns_it_unchanged_and_is_no_fire(tmp_path: Path) -> None:
    # a discovered point may be a function returning an enum or a batch object: `minus_one` there would raise a
    # TypeError inside the engine (a crash, not a desync); it leaves the value alone and is not counted as fired
    plan = _plan(tmp_path, {"kind": "return_value", "value": None, "call_original": True, "offset": -1})
    (tmp_path / "hunt_target.py").write_text(textwrap.dedent(TARGET) + textwrap.dedent("""
        class Verdict:
            CONTINUE = "continue"

        def judge():
            return Verdict.CONTINUE
        """))
    plan_data = json.loads(plan.read_text())
    plan_data["injections"][0]["site"]["alternatives"] = ["hunt_target:judge"]
    plan.write_text(json.dumps(plan_data))
    out = _run(tmp_path, plan, "import hunt_target as t\nprint(t.judge(), t.judge())\n")
    assert out.split() == ["continue", "continue"]
    rep = read_injector_dir(tmp_path / "out")
    assert not any(rep.counts_by_rank("p")["fired"].values())
    events = []
    for f in (tmp_path / "out").glob("fires-*.jsonl"):
        events += [json.loads(line) for line in f.read_text().splitlines()]
    assert [e["returned"] for e in events if e["event"] == "fire_inapplicable"] == ["str", "str"]


def test_skip_with_return_arg_hands_back_the_argument_without_calling_the_original(tmp_path: Path) -> None:
    plan = _plan(tmp_path, {"kind": "skip", "value": None, "return_arg": 1})
    (tmp_path / "hunt_target.py").write_text(textwrap.dedent(TARGET) + textwrap.dedent("""
        class Coord:
            def all_reduce(self, t):
                raise AssertionError("the original must not run")
        """))
    plan_data = json.loads(plan.read_text())
    plan_data["injections"][0]["site"]["alternatives"] = ["hunt_target:Coord.all_reduce"]
    plan.write_text(json.dumps(plan_data))
    out = _run(tmp_path, plan, "import hunt_target as t\nx = [1]\nprint(t.Coord().all_reduce(x) is x)\n")
    assert out.split() == ["True"]
