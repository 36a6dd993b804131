"""PD disaggregation (prefill + decode + router) without SGLang: the topology, the router's readiness rule, the
per-server plans, and the stack's life-cycle on stand-in servers (tests/fake_servers/pd_fake.py, real processes)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from repro import evidence as ev
from repro import procs as _procs
from repro.launcher import LaunchError
from repro.pd import RoleRun, Stack, injection_roles, rank_name
from repro.scenario import load_scenario
from repro.targets.base import AdapterBase, LaunchSpec, ServerRole
from repro.targets.sglang import SGLangAdapter
from repro.targets.sglang.pd import pd_topology, router_args, workers_ready

REPO = Path(__file__).resolve().parent.parent
DISAGG = REPO / "scenarios" / "sglang" / "disagg_bootstrap_divergence.toml"
FAKE = Path(__file__).resolve().parent / "fake_servers" / "pd_fake.py"


def test_pd_topology_prefill_decode_router_with_the_scenarios_tp_sizes():
    sc = load_scenario(DISAGG)
    topo = SGLangAdapter().topology(sc.server)
    assert [r.name for r in topo.roles] == ["prefill", "decode", "router"] and topo.entry == "router"
    pre, dec, rt = topo.roles
    assert (pre.kind, pre.tp_size, dec.tp_size, rt.kind) == ("engine", 4, 1, "router")
    assert list(pre.args[:2]) == ["--disaggregation-mode", "prefill"] and "--enable-hierarchical-cache" in pre.args
    assert list(dec.args[:2]) == ["--disaggregation-mode", "decode"] and "--enable-hierarchical-cache" not in dec.args
    assert [e.name for e in topo.engines()] == ["prefill", "decode"]


def test_single_topology_stays_one_server_and_an_unknown_one_is_named():
    sc = load_scenario(REPO / "scenarios" / "sglang" / "smoke_extra_allreduce.toml")
    assert SGLangAdapter().topology(sc.server).is_single
    with pytest.raises(ValueError, match="'single' or 'pd'"):
        SGLangAdapter().topology(sc.server.model_copy(update={"topology": "ring"}))


def test_pd_topology_keeps_a_scenarios_own_transfer_backend():
    sc = load_scenario(DISAGG)
    server = sc.server.model_copy(update={"args": ["--disaggregation-transfer-backend", "nixl"]})
    pre = pd_topology(server).roles[0]
    assert list(pre.args).count("--disaggregation-transfer-backend") == 0  # the shared args carry it


def test_router_is_ready_only_when_it_lists_both_servers_healthy():
    p, d = "http://127.0.0.1:1", "http://127.0.0.1:2"
    assert workers_ready({"workers": []}, [p, d]) == (False, f"{p} not registered; {d} not registered")
    ok, why = workers_ready({"workers": [{"url": p, "is_healthy": True}, {"url": d + "/", "is_healthy": False}]}, [p, d])
    assert not ok and why == f"{d} not healthy"
    assert workers_ready({"workers": [{"url": p, "is_healthy": True}, {"url": d, "is_healthy": True}]}, [p, d]) == (True, "")
    assert workers_ready("<html>", [p])[0] is False
    assert router_args(p, 9000, d) == ["--pd-disaggregation", "--prefill", p, "9000", "--decode", d]


def test_each_router_gets_its_own_metrics_port_so_two_stacks_can_share_a_machine():
    from repro.targets.base import LaunchSpec
    from repro.targets.sglang import SGLangAdapter
    from repro.targets.sglang.pd import SGLangRouterAdapter

    a = SGLangRouterAdapter(SGLangAdapter())
    cmd = a.launch_command(LaunchSpec(model="", tp_size=1, python="py", port=31000, nccl_port=31001,
                                      args=tuple(router_args("http://h:1", 2, "http://h:3"))))
    assert cmd[cmd.index("--prometheus-port") + 1] == "31001"  # not the fixed default 29000
    own = a.launch_command(LaunchSpec(model="", tp_size=1, python="py", port=31000, nccl_port=31001,
                                      args=("--prometheus-port", "9100")))
    assert own.count("--prometheus-port") == 1 and own[own.index("--prometheus-port") + 1] == "9100"


def test_every_role_of_the_pd_topology_has_an_adapter_with_every_hook_the_harness_calls(tmp_path):
    """The harness calls the adapter hooks plainly (issue 30), on each role's adapter too: the router's must declare
    them (it answered ``leftover_files`` with an AttributeError at every stop before it had the base's defaults)."""
    from repro.targets.base import AdapterBase
    from repro.targets.sglang import SGLangAdapter

    a = SGLangAdapter()
    for role in a.topology(load_scenario(DISAGG).server).roles:
        ra = a.role_adapter(role)
        assert isinstance(ra, AdapterBase), role
        assert ra.leftover_files(tmp_path / "server.log") == [] and ra.owned_dirs({}) == [], role
        assert ra.router_workers("http://127.0.0.1:9", 0.1) is None and ra.testbed_python() in (None, a.testbed_python())


def test_injections_name_their_server_and_ranks_are_named_apart():
    sc = load_scenario(DISAGG)
    roles = injection_roles(sc)
    assert roles["pop_bootstrapped_empty_on_ranks_2_3"] == roles["observe_pop_bootstrapped"] == "prefill"
    assert roles["aborts_handled"] == roles["abort_requests"] == "decode"
    assert roles["prefill_aborts_handled"] == roles["count_bootstrap_pops"] == "prefill"
    assert rank_name("prefill", 2) == "prefill TP2" and rank_name("decode", 0) == "decode TP0"


@pytest.fixture
def prepared_roles():
    """prepare_roles without a launch, then what a stack's stop would remove: each spec's owned folders (the
    testbed profile makes a /tmp/repro-hicache-* storage folder per HiCache server; nothing else removes it)."""
    made: list = []

    def roles_of(p):
        from repro.pd import prepare_roles

        made.append((p.adapter, p.spec))
        roles = {r.name: r for r in prepare_roles(p)}
        made.extend((r.adapter, r.spec) for r in roles.values())
        return roles

    yield roles_of
    for adapter, spec in made:
        for d in adapter.owned_dirs(spec.env):
            shutil.rmtree(d, ignore_errors=True)


def test_prepare_gives_each_engine_server_its_own_plan_arm_file_and_injector_folder(tmp_path: Path, prepared_roles):
    from repro import testbed
    from repro.runner import RunOptions, prepare

    py = testbed.testbed_python()
    if py is None:
        pytest.fail(f"CPU testbed not set up at {testbed.testbed_dir()}: run `{testbed.setup_command()}`")
    p = prepare(RunOptions(DISAGG, variant="divergence", evidence_root=tmp_path, python=str(py)))
    roles = prepared_roles(p)
    pre, dec, rt = roles["prefill"], roles["decode"], roles["router"]
    assert pre.injection_ids == ["pop_bootstrapped_empty_on_ranks_2_3"] and dec.injection_ids == []
    assert pre.plan["out_dir"] != dec.plan["out_dir"] and pre.arm_file != dec.arm_file
    assert pre.plan["ledger"]["tick_function"].endswith("get_next_disagg_prefill_batch_to_run")
    assert dec.plan["ledger"]["tick_function"].endswith("get_next_disagg_decode_batch_to_run")
    assert pre.spec.tp_size == 4 and dec.spec.tp_size == 1
    assert pre.spec.env["REPRO_PLAN"] != dec.spec.env["REPRO_PLAN"] and "REPRO_PLAN" not in rt.spec.env
    assert pre.spec.env["MOONCAKE_PROTOCOL"] == "tcp" and dec.spec.env["MC_FORCE_TCP"] == "1"
    assert "--disaggregation-decode-retraction-backup" in dec.spec.args
    assert "--disaggregation-decode-retraction-backup" not in pre.spec.args


def test_a_variant_asked_for_several_times_is_loaded_once_so_repeats_share_one_stack(tmp_path: Path, prepared_roles):
    from repro import testbed
    from repro.runner import RunOptions, prepare

    py = testbed.testbed_python()
    if py is None:
        pytest.fail(f"CPU testbed not set up at {testbed.testbed_dir()}: run `{testbed.setup_command()}`")
    p = prepare(RunOptions(DISAGG, evidence_root=tmp_path, python=str(py)),
                variants=["control", "control", "mass_abort", "mass_abort", "divergence"])
    roles = prepared_roles(p)
    ids = roles["prefill"].injection_ids
    assert sorted(ids) == sorted(set(ids)) and "observe_pop_bootstrapped" in ids and "count_bootstrap_pops" in ids
    assert roles["decode"].injection_ids == ["aborts_handled", "abort_requests"]


def test_a_compare_overlay_reaches_both_engine_servers_and_not_the_router(tmp_path: Path, prepared_roles):
    # `repro compare --after patch:FILE` puts its sglang overlay first on the server's PYTHONPATH (RunOptions
    # .pythonpath_prepend): on a PD stack both servers must run the patched sglang.
    from repro import testbed
    from repro.runner import RunOptions, prepare

    overlay = tmp_path / "overlay"
    overlay.mkdir()
    p = prepare(RunOptions(DISAGG, variant="control", evidence_root=tmp_path / "ev", python=str(testbed.testbed_python()),
                           pythonpath_prepend=[str(overlay)]))
    roles = prepared_roles(p)
    for name in ("prefill", "decode"):
        env = roles[name].adapter.launch_env(roles[name].spec, {})
        assert str(overlay) in env["PYTHONPATH"].split(os.pathsep), name
    assert str(overlay) not in roles["router"].spec.pythonpath_prepend


# ---- the stack's life-cycle on stand-in servers ---------------------------------------------------------------------
class FakeAdapter(AdapterBase):
    name = "fake-pd"
    # the stand-in servers speak sglang's PD wiring (bootstrap port, router worker args, GET /workers)
    wire_roles = SGLangAdapter.wire_roles
    stack_ready = SGLangAdapter.stack_ready

    def __init__(self, extra=()):
        self.extra = list(extra)

    def launch_command(self, spec: LaunchSpec) -> list[str]:
        return [sys.executable, str(FAKE), "--port", str(spec.port), *spec.args, *self.extra]

    def parse_title(self, title):
        return None


def _stack(tmp_path: Path, router_extra=(), decode_extra=()) -> Stack:
    roles = []
    for name, kind, extra in (("prefill", "engine", ()), ("decode", "engine", decode_extra), ("router", "router", router_extra)):
        folder = tmp_path / "servers" / name
        folder.mkdir(parents=True)
        args = ["--disaggregation-mode", name] if kind == "engine" else []
        roles.append(RoleRun(ServerRole(name, kind, 1), FakeAdapter(extra),
                             LaunchSpec(python=sys.executable, model="m", tp_size=1, args=args), ev.EvidenceDir.open(folder)))
    return Stack(roles, "router")


def _pgids(stack: Stack) -> set[int]:
    return {os.getpgid(s.pid) for s in stack.servers.values()}


def test_stack_waits_for_the_routers_workers_then_stops_every_tree(tmp_path: Path):
    stack = _stack(tmp_path, router_extra=["--workers-after-s", "1.5"])
    try:
        stack.start()
        waited = stack.wait_healthy(30)
        assert waited >= 1.5 and stack.healthy_s["workers"] >= max(1.5, stack.healthy_s["router"])
        assert stack.url == stack.servers["router"].url
        procs = stack.procs()
        assert len(procs) == 6  # three roots + one child each
        assert len(_pgids(stack)) == 3 and all(s.pid in _pgids(stack) for s in stack.servers.values())
        bootstrap = stack.servers["prefill"].spec.args[-1]
        ports = {s.spec.port for s in stack.servers.values()} | {int(bootstrap)}
        assert len(ports) == 4  # HTTP ports and the bootstrap port all distinct
    finally:
        left = stack.stop()
    assert left == [] and not any(_procs.alive(p) for p in procs)


def test_a_role_that_lost_its_port_but_stays_alive_fails_the_wait_at_once(tmp_path: Path):
    """The prefill launcher's HTTP bind lost its port (uvicorn's "[Errno 98] … address already in use") and the
    process stayed alive: the wait ends with a port-race error, not after the whole start-up time-out."""
    stack = _stack(tmp_path, decode_extra=["--lose-port-once", str(tmp_path / "lost")])
    try:
        stack.start()
        with pytest.raises(LaunchError) as e:
            stack.wait_healthy(20)
        assert getattr(e.value, "port_race", False), str(e.value)
        assert "lost a port during start-up" in str(e.value) and "address already in use" in str(e.value)
        assert all(s.is_running() for s in stack.servers.values())  # it was alive: only its log told
    finally:
        assert stack.stop() == []


def test_start_healthy_starts_the_whole_stack_again_on_new_ports_after_a_lost_port(tmp_path: Path):
    from repro.pd import start_healthy

    stack0 = _stack(tmp_path, decode_extra=["--lose-port-once", str(tmp_path / "lost")])
    seen: list = []
    stacks: list = []
    stack = None
    try:
        stack, _ = start_healthy(stack0.roles, "router", 20, lambda e, d: seen.append((e, d)), stacks.append)
        assert len(stacks) == 2 and stacks[1] is stack
        assert [d["attempt"] for e, d in seen if e == "relaunch"] == [2]
        assert not any(s.is_running() for s in stacks[0].servers.values())  # the first stack was stopped
        log = stack.servers["decode"].log_path.read_text()
        assert log.count("# repro launch:") == 2 and "address already in use" in log  # both attempts kept
    finally:
        for s in stacks:
            assert s.stop() == []


def test_start_healthy_does_not_retry_other_failures(tmp_path: Path):
    from repro.pd import start_healthy

    stack0 = _stack(tmp_path, router_extra=["--workers-after-s", "600"])
    stacks: list = []
    try:
        with pytest.raises(LaunchError, match="does not list every server healthy"):
            start_healthy(stack0.roles, "router", 3, None, stacks.append)
        assert len(stacks) == 1
    finally:
        for s in stacks:
            assert s.stop() == []


def test_a_stack_under_the_fork_ranks_opt_in_starts_its_router_too(tmp_path: Path, monkeypatch):
    """REPRO_FORK_RANKS=1 (the pd stage of scripts/test.sh sets it) applies to the servers whose adapter declares a
    call to switch (the engines, ``--device cpu``); the router declares none and has no ``--device``: it starts, with
    the variable left in its environment, where before every PD launch was refused ("--device None")."""
    from repro.targets.base import InjectorProfile

    class ForkingEngine(FakeAdapter):
        injector_profile = InjectorProfile(fork_caller="engine:launch", fork_device="server_args.device")

    monkeypatch.setenv("REPRO_FORK_RANKS", "1")
    stack = _stack(tmp_path)
    for r in stack.roles:
        if r.is_engine:
            r.adapter = ForkingEngine()
            r.spec = dataclasses.replace(r.spec, args=[*r.spec.args, "--device", "cpu"])
    try:
        stack.start()
        stack.wait_healthy(30)
        assert all(s.env.get("REPRO_FORK_RANKS") == "1" for s in stack.servers.values())
    finally:
        assert stack.stop() == []
    # an engine that declares the call still needs --device cpu
    bad = _stack(tmp_path / "bad")
    bad.roles[0].adapter = ForkingEngine()
    with pytest.raises(LaunchError, match="REPRO_FORK_RANKS=1 is for CPU servers only"):
        bad.start()
    assert bad.procs() == []


def test_a_stacks_roles_are_stopped_at_once_not_one_after_another():
    """Stack.stop runs every role's stop at the same time (issue 36: one after another, a wedged PD stack's teardown
    was the sum of three roles' stops): each fake role's stop waits until all three are inside theirs."""
    import threading

    barrier = threading.Barrier(3, timeout=20)

    class _Role:
        def __init__(self, name):
            self.name, self.grace = name, None

        def stop(self, grace_s=10.0):
            self.grace = grace_s
            barrier.wait()  # BrokenBarrierError (after 20 s) when the roles are stopped one at a time
            return [f"{self.name}-left"]

    stack = Stack([], entry="router")
    stack.servers = {n: _Role(n) for n in ("prefill", "decode", "router")}
    left = stack.stop(grace_s=0)
    assert sorted(left) == ["decode-left", "prefill-left", "router-left"]
    assert all(r.grace == 0 for r in stack.servers.values())


def test_a_role_that_dies_during_start_up_is_named_and_nothing_is_left(tmp_path: Path):
    stack = _stack(tmp_path, router_extra=["--workers-after-s", "60"], decode_extra=["--die-after-s", "0.5"])
    try:
        stack.start()
        time.sleep(0.2)
        procs = stack.procs()
        with pytest.raises(LaunchError, match="decode server exited"):
            stack.wait_healthy(30)
        procs += stack.procs()
    finally:
        stack.stop()
    assert procs and not any(_procs.alive(p) for p in procs)


def test_a_role_still_loading_at_the_time_out_is_named_with_its_last_log_line_and_nothing_is_left(tmp_path: Path):
    stack = _stack(tmp_path, decode_extra=["--health-after-s", "600"])
    try:
        stack.start()
        with pytest.raises(LaunchError) as ei:
            stack.wait_healthy(3)
        procs = stack.procs()
    finally:
        stack.stop()
    msg = str(ei.value)
    assert msg.startswith("decode not healthy after 3 s: decode's last log line 'fake: loading'"), msg
    assert str(stack.servers["decode"].log_path) in msg and "prefill" not in msg and "startup_timeout_s" in msg
    assert procs and not any(_procs.alive(p) for p in procs)


def test_ctrl_c_while_waiting_for_the_stack_still_stops_every_tree(tmp_path: Path):
    stack = _stack(tmp_path, router_extra=["--workers-after-s", "60"])
    seen = []

    def observe(event, data):
        seen.append(stack.procs())
        raise KeyboardInterrupt

    try:
        stack.start()
        with pytest.raises(KeyboardInterrupt):
            stack.wait_healthy(30, observe)
    finally:
        stack.stop()
    assert seen and seen[0] and not any(_procs.alive(p) for snap in seen for p in snap)


class RankedFakeAdapter(FakeAdapter):
    """The stand-in's forked child of an engine server plays its one rank; the router has none."""

    watch_defaults = SGLangAdapter.watch_defaults

    def rank_pids(self, procs):
        kids = [p for p in procs[1:] if "--disaggregation-mode" in " ".join(p.cmdline)]
        return {i: p.pid for i, p in enumerate(kids)}

    def router_workers(self, url, timeout_s=2.0):
        from repro.targets.sglang.pd import router_workers

        return router_workers(url, timeout_s)


def test_watch_on_the_router_url_finds_the_ranks_of_both_servers_through_get_workers(tmp_path: Path):
    from repro.watch import discover_ranks

    stack = _stack(tmp_path)
    for r in stack.roles:
        r.adapter = RankedFakeAdapter(r.adapter.extra)
    try:
        stack.start()
        stack.wait_healthy(30)
        d = discover_ranks(RankedFakeAdapter(), stack.url)
        want = [stack.servers["prefill"].procs()[1].pid, stack.servers["decode"].procs()[1].pid]
    finally:
        stack.stop()
    assert d.method == "router-workers" and [d.rank_pids[k] for k in sorted(d.rank_pids)] == want
    assert "prefill TP0..0 = ranks 0..0" in d.note and "decode TP0..0 = ranks 1..1" in d.note
    assert d.servers == {"prefill": {0: want[0]}, "decode": {0: want[1]}}  # each server's own ranks, for the capture


def test_cleanup_of_a_pd_folder_ends_all_three_trees(tmp_path: Path):
    # What the PD session records (runner.save_server_procs on the Stack): every role's tree under one launch mark.
    from repro.cleanup import cleanup_run
    from repro.runner import save_server_procs

    stack = _stack(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    try:
        stack.start()
        stack.wait_healthy(30)
        evd = ev.EvidenceDir.open(run)
        save_server_procs(evd, stack)
        procs = stack.procs()
        res = cleanup_run(run, force=True)  # force: this test's process is the (live) harness
        alive_after = [p for p in procs if _procs.alive(p)]
    finally:
        stack.stop()
    assert len(procs) == 6
    assert res.exit_code == 0, res.message
    assert len(res.stopped) == 6 and alive_after == []


def test_watch_behind_a_router_captures_and_judges_each_server_on_its_own(tmp_path: Path, torch_python: str):
    # What `repro watch` does with a router's workers (Discovery.servers, as the router-workers discovery fills it):
    # each server's ranks captured into servers/<name>/stacks and judged as their own TP group. Here the "prefill"
    # server is a real 2-rank gloo job hung on an extra all_reduce, the "decode" server one process sleeping
    # outside any collective: DEADLOCKED, and the prefill server named.
    import json
    import subprocess
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    sys.path.insert(0, str(REPO / "tests"))
    from gloo_programs.job import GlooJob

    from repro.watch import Discovery, WatchOptions, Watcher

    release = threading.Event()

    class Hung(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):  # the router's /generate never answers: its workers are hung
            release.wait(30)

        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Hung)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    marker = tmp_path / "on_hang.txt"
    events: list[dict] = []
    try:
        with GlooJob(torch_python, 2, tmp_path / "job", mode="extra-allreduce", extra_rank=0) as job:
            job.wait_ready()
            servers = {"prefill": dict(job.pids), "decode": {0: sleeper.pid}}
            opts = WatchOptions(url=f"http://127.0.0.1:{srv.server_address[1]}", interval_s=0.2, probe_timeout_s=0.5,
                                health_timeout_s=0.5, evidence_root=tmp_path / "ev", confirm_gap_s=0.5, once=True,
                                on_hang=f"ls $REPRO_EVIDENCE_DIR/servers > {marker}").validate()
            w = Watcher(opts, events.append, adapter=SGLangAdapter())
            w.discover = lambda: Discovery({0: job.pids[0], 1: job.pids[1], 2: sleeper.pid}, "router-workers", [],
                                           "the router's workers", servers)
            code = w.run()
    finally:
        release.set()
        srv.shutdown()
        srv.server_close()
        os.killpg(sleeper.pid, 9)
        sleeper.wait(10)
    ev_ = [e for e in events if e["event"] == "evidence"]
    assert code == 3 and ev_ and ev_[0]["verdict"] == "DEADLOCKED", ev_
    evd = Path(ev_[0]["path"])
    for name, ranks in (("prefill", (0, 1)), ("decode", (0,))):
        for k in ranks:
            for tag in ("", "-2"):
                assert (evd / "servers" / name / "stacks" / f"rank{k}{tag}.txt").is_file(), (name, k, tag)
        assert json.loads((evd / "servers" / name / "analysis.json").read_text())["ranks"]
    hang = json.loads((evd / "hang.json").read_text())
    assert hang["diverged_server"] == "prefill" and hang["reason"].startswith("the prefill server deadlocked")
    assert hang["servers"]["prefill"]["deadlocked"] is True and hang["servers"]["decode"]["deadlocked"] is False
    top = json.loads((evd / "analysis.json").read_text())
    assert top["diverged"] is True and {r["rank"] for r in top["ranks"]} == {0, 1}  # the prefill server's ranks
    report = (evd / "REPORT.md").read_text()
    assert "**The prefill server diverged**" in report and "### decode server" in report
    assert marker.read_text().split() == ["decode", "prefill"]  # --on-hang ran after both servers' evidence


def test_a_rank_dead_before_the_stacks_stop_leaves_no_shm_file_it_mapped(tmp_path: Path):
    """The decode server's stand-in rank maps a /dev/shm file and dies while the stack runs (as a PD control trial's
    ranks did: sglang's idle invariant check raised): the stack's wait read the file once the role was healthy, so
    the stop removes it. Before, only ``Server.wait_healthy`` read it and a PD stack's wait is its own: the real
    sharded PD hunt left one ``sglang_loads_*.shm``."""
    shm, die = _procs.SHM_DIR / f"reprotest_pd_{tmp_path.name}.shm", tmp_path / "DIE"
    stack = _stack(tmp_path, decode_extra=["--shm", str(shm), "--die-file", str(die)])
    try:
        stack.start()
        stack.wait_healthy(30)
        assert shm.exists()
        rank = [p for p in stack.servers["decode"].procs() if p.pid != stack.servers["decode"].pid]
        die.touch()
        deadline = time.monotonic() + 10
        while any(_procs.alive(p) for p in rank) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rank and not any(_procs.alive(p) for p in rank), rank
        assert stack.stop() == []
        assert not shm.exists(), "the stopped stack left the dead rank's shm file"
    finally:
        stack.stop()
        shm.unlink(missing_ok=True)
