"""The engine seam: a FAKE engine adapter registered through the registry (repro/targets/registry.py) brings its own
process titles, tick function, frame rules, injector profile and watch defaults, and the harness's title parsing,
ledger tick counting (a real gloo job under the real injector), stack analysis and watch discovery use them — with
no change anywhere but the fake adapter below. Also: the ``repro.adapters`` entry-point group, and the scenario's
``server.adapter`` validated against the registered names."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from importlib import metadata
from pathlib import Path
from typing import Optional

import pytest

from repro.analysis import analyze, comm_layer, load_captures
from repro.scenario import ScenarioError, load_scenario
from repro.stacks import Frame, RankCapture, parse_dump, rank_from_title
from repro.targets import registry
from repro.targets.base import (
    AdapterBase,
    CommRule,
    FrameRules,
    InjectorProfile,
    RankTitle,
    RefLocation,
    Topology,
    WatchDefaults,
)

REPO = Path(__file__).resolve().parent.parent
INJECTORS = REPO / "injectors"
PROG = REPO / "tests" / "gloo_programs" / "ledger_sched.py"
TOKEN = uuid.uuid4().hex[:8]  # this test's processes only: never another test's or server's
NS = f"fake{TOKEN}::"
WAIT_S = 90.0  # generous bound for slow CI; not a speed assertion


class FakeEngineAdapter(AdapterBase):
    """An engine the harness has never heard of: ``fake<token>::worker-<k>[-stage<p>]`` rank titles, a tick function
    picked by ``--fake-loop``, its own idle wait, object broadcast and communicator layer."""

    name = "fakeeng"
    title_namespace = NS
    tick_function = "ledger_sched:Scheduler.get_next_batch_to_run"
    frame_rules = FrameRules(
        idle_waits=(("fake_engine/inbox.py", "wait_for_work", "fake inbox wait"),),
        object_comm=(CommRule("fake_object_bcast", function_suffix=("fake_bcast_obj",)),),
        comm_layers=(CommRule("FakeComm", function_prefix=("FakeComm.",)),),
        request_broadcast_layers=frozenset({"fake_object_bcast"}),
        request_broadcast_callers=frozenset({"pull_requests"}),
        idle_loop_callers=frozenset({"nap_when_idle"}),
    )
    injector_profile = InjectorProfile(coordinators=("ledger_sched:GroupCoordinator",), alias_prefixes=("ledger_sched",))
    ref_location = RefLocation(package="fake_engine_pkg")
    watch_defaults = WatchDefaults(title_match=f"{NS}worker", title_example=f"{NS}worker-<k>")
    _TITLE = re.compile(rf"(?<![\w:]){re.escape(NS)}worker-(\d+)(?:-stage(\d+))?(?!\w)")

    def parse_title(self, title: str) -> Optional[RankTitle]:
        m = self._TITLE.search(title or "")
        if not m:
            return None
        return RankTitle(tp=int(m.group(1)), pp=int(m.group(2)) if m.group(2) else None, role="worker")

    def tick_function_for(self, args) -> str:
        return "ledger_sched:Scheduler.run_batch" if "--fake-loop=batch" in args else self.tick_function

    def launch_command(self, spec):  # pragma: no cover - nothing is launched here
        raise NotImplementedError

    def generate_body(self, input_ids, max_new_tokens, stream):
        return {"tokens": list(input_ids), "max_tokens": max_new_tokens, "stream": stream}


@pytest.fixture
def fake():
    registry.register("fakeeng", FakeEngineAdapter)
    try:
        yield registry.get_adapter("fakeeng")
    finally:
        registry.unregister("fakeeng")


SCENARIO = """
name = "fake_engine"
stall_s = 8
budget_s = 60

[server]
adapter = "{adapter}"
tp_size = 2
args = {args}

[[variants]]
name = "control"
expect = "success"

[[variants.injections]]
id = "observe"
site = "ledger_sched:Scheduler.run_batch"
action = {{ kind = "none" }}
"""


def _scenario(tmp: Path, adapter: str, args: list[str] = ()) -> Path:
    p = tmp / f"{adapter}.toml"
    p.write_text(SCENARIO.format(adapter=adapter, args=json.dumps(list(args))))
    return p


# ---- the registry ---------------------------------------------------------------------------------------------
def test_registry_knows_sglang_and_a_registered_engine_and_names_both_when_one_is_unknown(fake, tmp_path):
    assert {"sglang", "fakeeng"} <= set(registry.known_adapters())
    assert isinstance(fake, FakeEngineAdapter) and fake.topology(load_scenario(_scenario(tmp_path, "fakeeng")).server) \
        == Topology.single(2)
    with pytest.raises(registry.UnknownAdapterError, match=r"unknown adapter 'nope'.*fakeeng.*sglang"):
        registry.get_adapter("nope")
    with pytest.raises(ScenarioError, match=r"server\.adapter.*unknown adapter 'nope'.*expected one of: .*fakeeng.*sglang"):
        load_scenario(_scenario(tmp_path, "nope"))
    registry.unregister("fakeeng")
    with pytest.raises(ScenarioError, match=r"server\.adapter"):
        load_scenario(_scenario(tmp_path, "fakeeng"))


def test_an_entry_point_in_the_repro_adapters_group_registers_an_engine(monkeypatch):
    ep = metadata.EntryPoint(name="viaentrypoint", value=f"{__name__}:FakeEngineAdapter", group=registry.ENTRY_POINT_GROUP)
    seen: list[str] = []

    def entry_points(group: str):
        seen.append(group)
        return [ep] if group == registry.ENTRY_POINT_GROUP else []

    monkeypatch.setattr(registry.metadata, "entry_points", entry_points)
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    try:
        assert "viaentrypoint" in registry.known_adapters() and seen == [registry.ENTRY_POINT_GROUP]
        assert isinstance(registry.get_adapter("viaentrypoint"), FakeEngineAdapter)
    finally:
        registry.unregister("viaentrypoint")


# ---- title parsing --------------------------------------------------------------------------------------------
def test_title_parsing_everywhere_uses_the_registered_engines_parser(fake, tmp_path):
    from repro.injection_records import _rank_from_title

    title = f"{NS}worker-3"
    assert fake.parse_title(title) == RankTitle(tp=3, role="worker")
    assert registry.parse_title_any(title) == ("fakeeng", RankTitle(tp=3, role="worker"))
    assert registry.parse_title_any("sglang::scheduler_TP1")[0] == "sglang"  # the built-in one still reads its own
    assert rank_from_title(title) == 3 and _rank_from_title(title) == 3
    assert fake.rank_pids([_proc(11, f"{NS}worker-1-stage1"), _proc(10, f"{NS}worker-0-stage1"),
                           _proc(9, f"{NS}worker-1"), _proc(8, f"{NS}worker-0"), _proc(7, f"{NS}router")]) == \
        {0: 8, 1: 9, 2: 10, 3: 11}
    # `repro analyze` on dumps whose only rank evidence is the fake title (file names say nothing)
    for k, name in ((0, "b.txt"), (1, "a.txt")):
        (tmp_path / name).write_text(_pyspy(100 + k, f"{NS}worker-{k}", ["run (fake_engine/loop.py:3)"]))
    caps = load_captures([tmp_path])
    assert [(c.rank, c.pid) for c in caps] == [(0, 100), (1, 101)]


def _proc(pid: int, title: str):
    from repro.procs import ProcInfo

    return ProcInfo(pid=pid, create_time=1.0, name="python", cmdline=[title])


# ---- stack analysis -------------------------------------------------------------------------------------------
def _pyspy(pid: int, title: str, frames: list[str]) -> str:
    body = "\n".join("    " + f for f in frames)
    return (f"Process {pid}: {title}\nPython v3.11.9 (/usr/bin/python3.11)\n\n"
            f'Thread {pid} (idle): "MainThread"\n{body}\n')


def _idle_server_captures() -> list[RankCapture]:
    texts = [
        _pyspy(100, f"{NS}worker-0", ["wait (threading.py:320)", "wait_for_work (fake_engine/inbox.py:10)",
                                      "nap_when_idle (fake_engine/loop.py:20)", "event_loop (fake_engine/loop.py:30)"]),
        _pyspy(101, f"{NS}worker-1", ["broadcast (torch/distributed/distributed_c10d.py:2000)",
                                      "fake_bcast_obj (fake_engine/comm.py:40)", "pull_requests (fake_engine/loop.py:50)",
                                      "event_loop (fake_engine/loop.py:30)"]),
    ]
    caps = []
    for k, text in enumerate(texts):
        (d,) = parse_dump(text)
        caps.append(RankCapture(rank=k, pid=d.pid, ok=True, method="file", text=text, threads=d.threads, title=d.title))
    return caps


def test_stack_analysis_reads_the_engines_idle_wait_layers_and_idle_handshake():
    # without the fake engine: one rank in a plain broadcast, the other waiting — a divergence by the generic rules
    before = analyze(_idle_server_captures())
    assert before.diverged and before.ranks[1].via != "fake_object_bcast"
    registry.register("fakeeng", FakeEngineAdapter)
    try:
        a = analyze(_idle_server_captures())
        r0, r1 = a.ranks
        assert (r0.state, r0.wait) == ("idle-wait", "fake inbox wait")
        assert (r1.state, r1.op, r1.via) == ("collective", "broadcast", "fake_object_bcast")
        assert not a.diverged, a.summary  # the fake engine's idle tick: its handshake rule says so
        assert "(fake_object_bcast ← pull_requests)" in a.summary
        assert comm_layer(Frame(function="FakeComm.all_reduce", module_or_file="fake_engine/comm.py", line=9)) == "FakeComm"
    finally:
        registry.unregister("fakeeng")
    assert comm_layer(Frame(function="FakeComm.all_reduce", module_or_file="fake_engine/comm.py", line=9)) is None


# ---- ledger tick counting (a real gloo job under the real injector) ----------------------------------------------
def _run_ledger_job(python: str, tmp: Path, plan: dict, ticks: int = 4) -> dict:
    from repro.ledger import load_ledgers

    out = Path(plan["out_dir"])
    (tmp / "plan.json").write_text(json.dumps(plan))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "REPRO_PLAN")}
    env.update(PYTHONPATH=str(INJECTORS), REPRO_PLAN=str(tmp / "plan.json"), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([python, str(PROG), str(r), "2", str(tmp / "init"), str(out), "--mode", "ok",
                               "--ticks", str(ticks), "--lifetime-s", "120"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True) for r in range(2)]
    try:
        for p in procs:
            p.wait(timeout=WAIT_S)
    finally:
        errs = []
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            errs.append(p.communicate()[1])
    assert all(p.returncode == 0 for p in procs), errs
    return load_ledgers(out)


@pytest.mark.parametrize("args, bcast_ticks", [([], [1, 1, 2, 2, 3, 3, 4, 4]),
                                               (["--fake-loop=batch"], [0, 0, 1, 1, 2, 2, 3, 3])])
def test_ledger_counts_ticks_with_the_engines_tick_function_for_the_servers_args(fake, torch_python, tmp_path, args,
                                                                                  bcast_ticks):
    from repro.runner import session_plan

    scen = load_scenario(_scenario(tmp_path, "fakeeng", args))
    (tmp_path / "out").mkdir()
    plan = session_plan(fake, scen, scen.variants, tmp_path / "out", tmp_path / "ARM")
    assert plan["ledger"]["tick_function"] == fake.tick_function_for(args)
    assert plan["ledger"]["coordinators"] == ["ledger_sched:GroupCoordinator"]
    assert plan["ledger"]["alias_prefixes"] == ["ledger_sched"]
    plan["ledger"]["enabled"] = True
    leds = _run_ledger_job(torch_python, tmp_path, plan)
    for led in leds.values():
        cpu = [r for r in led.records if led.groups[r.group].label == "tp/cpu" and r.op == "broadcast"]
        dev = [r for r in led.records if led.groups[r.group].label == "tp/device"]
        # the broadcast runs in get_next_batch_to_run, before run_batch: which function ticks decides its tick
        assert [r.tick for r in cpu] == bcast_ticks
        assert [r.tick for r in dev] == [1, 2, 3, 4]
        # the coordinator class came from the fake engine's injector profile in the plan
        assert {r.api for r in dev} == {"GroupCoordinator.all_reduce"}


# ---- watch discovery ------------------------------------------------------------------------------------------
def _closed_port_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


def test_watch_discovery_finds_the_engines_ranks_by_its_titles_and_default_title(fake):
    from repro.watch import discover_ranks

    code = ("import subprocess, sys, time\n"
            f"kids = [subprocess.Popen(['bash', '-c', 'exec -a {NS}worker-%d sleep 60' % k]) for k in (1, 0)]\n"
            f"kids.append(subprocess.Popen(['bash', '-c', 'exec -a {NS}detok sleep 60']))\n"
            "print(' '.join(str(k.pid) for k in kids), flush=True)\n"
            "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        kids = [int(x) for x in parent.stdout.readline().split()]
        deadline = time.time() + 10
        while time.time() < deadline and not all(Path(f"/proc/{k}/cmdline").read_bytes().startswith(NS.encode())
                                                 for k in kids):
            time.sleep(0.02)
        url = _closed_port_url()
        by_root = discover_ranks(fake, url, pid_root=parent.pid)
        assert by_root.method == "pid-root" and by_root.rank_pids == {0: kids[1], 1: kids[0]}
        # no --pid-root, no --match, nothing listening: the engine's default title finds its ranks on this host
        by_default = discover_ranks(fake, url)
        assert by_default.method == "default-title" and by_default.rank_pids == {0: kids[1], 1: kids[0]}
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)


def test_watch_cli_takes_the_engine_from_adapter_and_refuses_an_unknown_one(fake, tmp_path):
    from typer.testing import CliRunner

    from repro.cli import app

    url = _closed_port_url()
    res = CliRunner().invoke(app, ["watch", "--url", url, "--adapter", "fakeeng", "--once",
                                   "--evidence-dir", str(tmp_path / "ev")])
    events = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    start = next(e for e in events if e["event"] == "start")
    assert start["adapter"] == "fakeeng" and start["engine"] == "fakeeng" and start["engine_assumed"] is False
    assert res.exit_code == 6, res.stdout  # nothing listens: unreachable, not a hang
    assert "assumed" not in res.stderr

    # without --adapter the watch assumes the default engine, and says so (the start event and one line)
    res = CliRunner().invoke(app, ["watch", "--url", url, "--once", "--evidence-dir", str(tmp_path / "ev")])
    start = next(json.loads(line) for line in res.stdout.splitlines() if line.startswith("{") and '"start"' in line)
    assert start["engine"] == "sglang" and start["engine_assumed"] is True
    assert "engine: sglang (assumed: no --adapter given; known: " in " ".join(res.stderr.split())

    bad = CliRunner().invoke(app, ["watch", "--url", url, "--adapter", "nosuchengine", "--once"])
    assert bad.exit_code == 2
    msg = bad.stderr  # human lines go to stderr (repro/cli.py console)
    assert "unknown adapter 'nosuchengine'" in msg and "fakeeng" in msg and "sglang" in msg
