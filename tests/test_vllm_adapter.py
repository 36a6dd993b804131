"""The vLLM adapter through the engine seam (repro/targets/vllm/), fast: no server. Titles as vLLM 0.32.0 sets them
(``VLLM::Worker[_DP d][_PP p][_PCP c][_TP t][_DCP c][_EP e]``, ``VLLM::EngineCore``), the launch command and
environment, the completions API shapes, the files a server leaves behind (only the ids its own log names), the
frame rules and the spin-wait rule (a hot rank in a known spin-wait is blocked; any other hot rank stays busy)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from repro.analysis import analyze, is_spin_wait, rank_state
from repro.procs import ProcInfo
from repro.scenario import load_scenario
from repro.stacks import Frame, RankCapture, ThreadStack
from repro.targets import registry
from repro.targets.base import LaunchSpec
from repro.targets.vllm import VLLMAdapter
from repro.targets.vllm import testbed as vtb
from repro.verdict import judge_stall

REPO = Path(__file__).resolve().parent.parent
SMOKE = REPO / "scenarios" / "vllm" / "smoke_extra_allreduce.toml"


def test_registered_by_name_and_scenarios_select_it():
    a = registry.get_adapter("vllm")
    assert isinstance(a, VLLMAdapter)
    assert "vllm" in registry.known_adapters()
    sc = load_scenario(SMOKE)
    assert sc.server.adapter == "vllm"
    assert registry.get_adapter(sc.server.adapter).ref_location.package == "vllm"


def test_pyproject_declares_the_entry_point():
    text = (REPO / "pyproject.toml").read_text()
    assert 'vllm = "repro.targets.vllm:VLLMAdapter"' in text


@pytest.mark.parametrize("title, tp, pp, dp, extra", [
    ("VLLM::Worker_TP0", 0, None, None, {}),
    ("VLLM::Worker_TP1", 1, None, None, {}),
    ("VLLM::Worker", 0, None, None, {}),                       # TP=1, or before the groups exist
    ("VLLM::Worker_PP1_TP3", 3, 1, None, {}),
    ("VLLM::Worker_DP1_PP0_PCP1_TP2_DCP0_EP5", 2, 0, 1, {"PCP": 1, "DCP": 0, "EP": 5}),
])
def test_worker_titles_are_ranks(title, tp, pp, dp, extra):
    t = VLLMAdapter().parse_title(title)
    assert (t.tp, t.pp, t.dp, dict(t.extra), t.role) == (tp, pp, dp, extra, "worker")
    assert registry.parse_title_any(title)[0] == "vllm"


@pytest.mark.parametrize("title", ["VLLM::EngineCore", "VLLM::EngineCore_DP1", "VLLM::APIServer_0",
                                   "python -m vllm.entrypoints.openai.api_server --model m", "VLLM::WorkerX_TP1",
                                   "sglang::scheduler_TP0"])
def test_other_processes_are_not_ranks(title):
    assert VLLMAdapter().parse_title(title) is None


def test_engine_core_is_its_own_role_and_a_known_engine_process():
    a = VLLMAdapter()
    procs = [ProcInfo(pid=10, create_time=0.0, name="python", cmdline=["python -m vllm.entrypoints.openai.api_server"]),
             ProcInfo(pid=11, create_time=0.0, name="python", cmdline=["VLLM::EngineCore"]),
             ProcInfo(pid=12, create_time=0.0, name="python", cmdline=["VLLM::Worker_TP1"]),
             ProcInfo(pid=13, create_time=0.0, name="python", cmdline=["VLLM::Worker_TP0"])]
    assert a.rank_pids(procs) == {0: 13, 1: 12}
    assert a.engine_core_pids(procs) == [11]
    assert registry.is_engine_title("VLLM::EngineCore")


def test_launch_command_env_and_testbed_profile():
    a = VLLMAdapter()
    spec = LaunchSpec(python="/py", model="/m", tp_size=2, port=8123, nccl_port=8124, args=["--x", "1"])
    cmd = a.launch_command(spec)
    assert cmd[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2" and cmd[cmd.index("--port") + 1] == "8123"
    assert cmd[-2:] == ["--x", "1"]
    env = a.launch_env(spec, {"PATH": "/bin"})
    assert int(env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"]) >= 86400  # raised far above any budget_s
    mine = LaunchSpec(python="/py", model="/m", env={"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "5"})
    assert a.launch_env(mine, {})["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] == "5"
    args, tenv, prepend = a.testbed_profile(spec, ["--max-model-len", "256"])
    assert "--enforce-eager" in args and args[args.index("--distributed-executor-backend") + 1] == "mp"
    assert "--max-model-len" not in args  # the scenario's own value wins
    assert tenv["VLLM_CPU_OMP_THREADS_BIND"].count("|") == 1 and tenv["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert prepend == []
    with pytest.raises(ValueError, match="concrete port"):
        a.launch_command(LaunchSpec(python="/py", model="/m"))


def test_tiny_model_is_accepted_by_cpu_attention():
    cfg = json.loads((VLLMAdapter().testbed_model() / "config.json").read_text())
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == cfg["head_dim"] == 32
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"], cfg["vocab_size"]) \
        == (4, 2, 2, 1024)


def test_completion_request_and_answers():
    a = VLLMAdapter()
    body = a.generate_body([5, 6, 7], 4, stream=True)
    assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 4 and body["ignore_eos"] is True
    assert body["temperature"] == 0.0 and body["stream_options"]["continuous_usage_stats"] is True
    assert "stream_options" not in a.generate_body([1], 1, stream=False)
    with pytest.raises(ValueError):
        a.generate_body([], 1, stream=False)
    whole = {"object": "text_completion", "choices": [{"index": 0, "text": "", "token_ids": [1, 2, 3, 4],
                                                        "finish_reason": "length"}],
             "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}
    u = a.parse_response(whole)
    assert (u.output_ids, u.finish_reason, u.done, u.error) == (4, "length", True, None)
    chunk = 'data: {"choices":[{"index":0,"text":"","token_ids":[9],"finish_reason":null}],' \
            '"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}'
    u = a.parse_stream_line(chunk)
    assert (u.output_ids, u.finish_reason, u.done) == (2, None, False)
    last = a.parse_stream_line(b'data: {"choices":[{"index":0,"token_ids":[3],"finish_reason":"length"}],'
                               b'"usage":{"completion_tokens":4}}')
    assert (last.output_ids, last.finish_reason, last.done) == (4, "length", True)
    assert a.parse_stream_line("data: [DONE]").done and a.parse_stream_line(": ping") is None
    err = a.parse_response({"object": "error", "message": "max_tokens too large", "code": 400})
    assert err.error == "max_tokens too large" and err.done


def test_leftover_files_are_only_those_the_log_names(tmp_path):
    mine, other = uuid.uuid4().hex, uuid.uuid4().hex
    shm = tmp_path / "shm"
    shm.mkdir()
    store = tmp_path / f"vllm_dist_{mine}"
    store.write_text("")
    keep_store = tmp_path / f"vllm_dist_{other}"
    keep_store.write_text("")
    seg = [shm / f"vllm_dist_{mine}-tp:0-[0-1]-cpushm", shm / f"vllm_dist_{mine}-pp:0-[0]-cpushm_1"]
    for p in seg:
        p.write_text("")
    keep = shm / f"vllm_dist_{other}-tp:0-[0-1]-cpushm"
    keep.write_text("")
    log = (f"(EngineCore pid=1) INFO world_size=2 rank=0 local_rank=0 distributed_init_method=file://{store} "
           "backend=gloo\n")
    found = vtb.dist_files(log, shm_dir=shm)
    assert sorted(found) == sorted([store, *seg])
    assert vtb.dist_ids(log) == [mine]
    (tmp_path / "server.log").write_text(log)
    removed = vtb.remove_dist_files(tmp_path / "server.log", shm_dir=shm)
    assert sorted(removed) == sorted(str(p) for p in [store, *seg])
    assert keep.exists() and keep_store.exists()
    assert vtb.dist_files("no init method here", shm_dir=shm) == []


# ---- frame rules and the spin-wait rule --------------------------------------------------------------------
def _f(function: str, path: str, line: int = 1, native: bool = False) -> Frame:
    return Frame(function=function, module_or_file=path, line=None if native else line, native=native)


SP = ""  # py-spy paths as the readers keep them: site-packages prefix removed
SHM_SPIN = [
    _f("_CPUSHMDistributed.all_reduce", SP + "vllm/distributed/device_communicators/cpu_communicator.py", 275),
    _f("CpuCommunicator.all_reduce", SP + "vllm/distributed/device_communicators/cpu_communicator.py", 96),
    _f("GroupCoordinator._all_reduce_out_place", SP + "vllm/distributed/parallel_state.py", 750),
    _f("GroupCoordinator.all_reduce", SP + "vllm/distributed/parallel_state.py", 745),
    _f("tensor_model_parallel_all_reduce", SP + "vllm/distributed/communication_op.py", 14),
    _f("VocabParallelEmbedding.forward", SP + "vllm/model_executor/layers/vocab_parallel_embedding.py", 490),
]
BUSY = [_f("LlamaMLP.forward", SP + "vllm/model_executor/models/llama.py", 120),
        _f("LlamaDecoderLayer.forward", SP + "vllm/model_executor/models/llama.py", 300)]
IDLE = [_f("MessageQueue.acquire_read", SP + "vllm/distributed/device_communicators/shm_broadcast.py", 600),
        _f("MessageQueue.dequeue", SP + "vllm/distributed/device_communicators/shm_broadcast.py", 700),
        _f("WorkerProc.worker_busy_loop", SP + "vllm/v1/executor/multiproc_executor.py", 1041)]
GLOO = [_f("all_reduce", SP + "torch/distributed/distributed_c10d.py", 2900),
        _f("wrapper", SP + "torch/distributed/c10d_logger.py", 80),
        _f("WorkerWrapperBase.execute_model", SP + "vllm/v1/worker/worker_base.py", 370)]


def _cap(rank: int, frames, active=True) -> RankCapture:
    return RankCapture(rank=rank, pid=100 + rank, ok=True, threads=[
        ThreadStack(thread_id=str(100 + rank), name="MainThread", is_main=True, frames=list(frames), active=active)])


def test_shm_collective_is_a_collective_and_a_spin_wait():
    s = rank_state(_cap(1, SHM_SPIN))
    assert s.state == "collective" and s.op == "all_reduce" and s.spin_wait
    assert "VocabParallelEmbedding.forward" in s.caller_chain[0]
    assert is_spin_wait(ThreadStack(thread_id="1", frames=[_f("shm_allreduce", "", native=True), *SHM_SPIN]))
    assert not rank_state(_cap(0, GLOO)).spin_wait  # gloo waits off the CPU: not a spin-wait


def test_idle_worker_waits_in_the_message_queue():
    s = rank_state(_cap(1, IDLE, active=False))
    assert s.state == "idle-wait" and s.wait == "message queue wait" and not s.spin_wait


def test_hot_rank_in_a_known_spin_wait_is_blocked_not_busy():
    caps = [_cap(0, GLOO, active=False), _cap(1, SHM_SPIN)]
    a1, a2 = analyze(caps), analyze(caps)
    j = judge_stall(a1, a2, True, {0: 0.5, 1: 99.0}, [0, 1])
    assert j.deadlocked, j.reason
    # the same hot rank whose frames moved between the captures is not judged blocked
    j = judge_stall(a1, a2, False, {0: 0.5, 1: 99.0}, [0, 1])
    assert not j.deadlocked and 1 in j.busy_ranks


def test_other_hot_ranks_stay_busy():
    # rank 1 is hot in the model's own code (not a spin-wait): not a deadlock, rank 1 named busy
    a = analyze([_cap(0, GLOO, active=False), _cap(1, BUSY)])
    j = judge_stall(a, a, True, {0: 0.5, 1: 99.0}, [0, 1])
    assert not j.deadlocked and 1 in j.busy_ranks
    # a hot rank in a collective that is not a known spin-wait (gloo) stays hot too
    a = analyze([_cap(0, GLOO), _cap(1, SHM_SPIN)])
    j = judge_stall(a, a, True, {0: 60.0, 1: 99.0}, [0, 1])
    assert not j.deadlocked and j.busy_ranks == (0,)


# ---- real py-spy dumps of a hung vLLM TP=2 CPU server (the smoke's extra_collective variant, vllm-cpu 0.32.0):
# TP0 in the injected gloo all_reduce at ~0-5 % CPU, TP1 spinning in the shm all_reduce at 80-95 % CPU ------------
FIXTURE = REPO / "tests" / "fixtures" / "dumps" / "vllm_tp2_cpu_hang"
MEASURED_CPU = {0: 5.0, 1: 79.96}  # capture-proof.json of that run (percent of one core)


def _real(tag: str = "") -> list[RankCapture]:
    from repro.analysis import load_captures

    caps = load_captures([FIXTURE / f"rank0{tag}.txt", FIXTURE / f"rank1{tag}.txt"])
    return [c.model_copy(update={"cpu_percent": MEASURED_CPU[c.rank]}) for c in caps]


def test_real_hang_dumps_read_as_a_spinning_shm_rank_and_an_injected_gloo_rank():
    a = analyze(_real())
    by = {r.rank: r for r in a.ranks}
    assert by[0].state == "collective" and by[0].injected and not by[0].spin_wait
    assert by[1].state == "collective" and by[1].op == "all_reduce" and by[1].spin_wait
    assert by[1].caller_chain[0].startswith("VocabParallelEmbedding.forward")
    assert a.diverged


def test_real_hang_is_deadlocked_by_the_stack_rule_despite_the_hot_rank():
    first, second = analyze(_real()), analyze(_real("-b"))
    j = judge_stall(first, second, True, MEASURED_CPU, [0, 1])
    assert j.deadlocked, j.reason


# ---- the launcher removes what the server left behind (a small program stands in for the server) -------------
class _PrintingVLLM(VLLMAdapter):
    """The vLLM adapter launching a program that logs vLLM's init-method line and creates the files vLLM leaves."""

    def __init__(self, argv):
        self.argv = argv

    def launch_command(self, spec):
        return list(self.argv)


def test_stop_removes_the_servers_shm_segments_and_file_store_only(tmp_path):
    import sys
    import time

    from repro.launcher import start_server

    mine, other = uuid.uuid4().hex, uuid.uuid4().hex
    store = Path("/tmp") / f"vllm_dist_{mine}"
    seg = Path("/dev/shm") / f"vllm_dist_{mine}-tp:0-[0-1]-cpushm"
    keep = Path("/dev/shm") / f"vllm_dist_{other}-tp:0-[0-1]-cpushm"
    keep.write_text("")
    prog = (f"import time, pathlib; pathlib.Path({str(store)!r}).write_text(''); pathlib.Path({str(seg)!r})"
            f".write_text(''); print('INFO distributed_init_method=file://{store} backend=gloo', flush=True); "
            "time.sleep(60)")
    try:
        server = start_server(_PrintingVLLM([sys.executable, "-c", prog]),
                              LaunchSpec(python=sys.executable, model="/m"), tmp_path / "server.log")
        deadline = time.monotonic() + 30
        while not (seg.exists() and "distributed_init_method" in (tmp_path / "server.log").read_text()):
            assert time.monotonic() < deadline, "the stand-in server did not start"
            time.sleep(0.1)
        assert server.stop() == []
        assert not store.exists() and not seg.exists()
        assert keep.exists()  # another server's segment is never touched
    finally:
        for p in (store, seg, keep):
            p.unlink(missing_ok=True)


def test_cleanup_removes_the_files_a_killed_runs_server_left(tmp_path):
    from repro.cleanup import _remove_owned_dirs

    mine = uuid.uuid4().hex
    store, seg = Path("/tmp") / f"vllm_dist_{mine}", Path("/dev/shm") / f"vllm_dist_{mine}-tp:0-[0-1]-cpushm"
    try:
        store.write_text("")
        seg.write_text("")
        (tmp_path / "server.log").write_text(f"distributed_init_method=file://{store}\n")
        removed = _remove_owned_dirs(tmp_path)
        assert sorted(removed) == sorted([str(store), str(seg)]) and not store.exists() and not seg.exists()
    finally:
        store.unlink(missing_ok=True)
        seg.unlink(missing_ok=True)


class _EngineOnlyInItsTestbed:
    """A stand-in adapter whose engine package (``reprofakeengine``) only its own testbed interpreter imports."""

    def __init__(self, tb_python: Path) -> None:
        from repro.targets.base import RefLocation

        self.ref_location = RefLocation(package="reprofakeengine", checkout_subdir="", version_key="reprofakeengine")
        self._tb = tb_python

    def testbed_python(self) -> Path:
        return self._tb

    def testbed_setup_command(self) -> str:
        return "set up the fake testbed"


def _fake_testbed(tmp_path: Path) -> tuple[Path, Path]:
    import stat
    import sys

    site = tmp_path / "site"
    (site / "reprofakeengine").mkdir(parents=True)
    (site / "reprofakeengine" / "__init__.py").write_text("")
    py = tmp_path / "python"
    py.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    py.chmod(py.stat().st_mode | stat.S_IXUSR)
    return py, site / "reprofakeengine"


def test_compare_and_hunt_refs_locate_the_package_in_the_scenarios_adapters_testbed(tmp_path, monkeypatch):
    # repro compare / hunt --ref of a vLLM scenario: with no --python, `installed` and `patch:` are the package of
    # the scenario's adapter's testbed interpreter (the vLLM venv), not the default adapter's (SGLang's) testbed.
    from repro import compare
    from repro.hunt import loop as hunt_loop

    py, pkg = _fake_testbed(tmp_path)
    ad = _EngineOnlyInItsTestbed(py)
    m = compare.materialize(compare.parse_ref("installed"), None, ad)
    try:
        assert m.package_dir == str(pkg) and str(py) in m.description
    finally:
        m.close()
    (tmp_path / "fix.patch").write_text("--- a/reprofakeengine/__init__.py\n+++ b/reprofakeengine/__init__.py\n"
                                        "@@ -0,0 +1 @@\n+X = 1\n")
    m = hunt_loop._materialize(f"patch:{tmp_path / 'fix.patch'}", None, ad)
    try:
        assert m.pythonpath_prepend and (Path(m.pythonpath_prepend[0]) / "reprofakeengine" / "__init__.py").read_text() == "X = 1\n"
    finally:
        m.close()


# ---- a patched site's wrapper that passed the call through is not an injection -----------------------------
_TAIL = [_f("tensor_model_parallel_all_reduce", SP + "vllm/distributed/communication_op.py", 14),
         _f("VocabParallelEmbedding.forward", SP + "vllm/model_executor/layers/vocab_parallel_embedding.py", 562)]
# as captured on the testbed (vllm-cpu 0.32.0, AVX2 build: gloo fallback), site = GroupCoordinator.all_reduce
FIRED = [_f("all_reduce", SP + "torch/distributed/distributed_c10d.py", 3252),
         _f("_exception_logger.<locals>.wrapper", SP + "torch/distributed/c10d_logger.py", 83),
         _f("repro_ledger[torch.distributed.all_reduce]", "repro_injector/_ledger.py", 564),
         _f("Site._collective", "repro_injector/_runtime.py", 279),
         _f("Site.run", "repro_injector/_runtime.py", 299),
         _f("repro_injected[GroupCoordinator.all_reduce]", "repro_injector/_runtime.py", 665), *_TAIL]
PASSED = [_f("all_reduce", SP + "torch/distributed/distributed_c10d.py", 3252),
          _f("_exception_logger.<locals>.wrapper", SP + "torch/distributed/c10d_logger.py", 83),
          _f("repro_ledger[torch.distributed.all_reduce]", "repro_injector/_ledger.py", 538),
          _f("CpuCommunicator.all_reduce", SP + "vllm/distributed/device_communicators/cpu_communicator.py", 85),
          _f("repro_ledger[CpuCommunicator.all_reduce]", "repro_injector/_ledger.py", 640),
          _f("GroupCoordinator._all_reduce_out_place", SP + "vllm/distributed/parallel_state.py", 750),
          _f("GroupCoordinator.all_reduce", SP + "vllm/distributed/parallel_state.py", 745),
          _f("repro_ledger[GroupCoordinator.all_reduce]", "repro_injector/_ledger.py", 658),
          _f("repro_injected[GroupCoordinator.all_reduce]", "repro_injector/_runtime.py", 656), *_TAIL]


def test_only_the_rank_whose_injected_action_issued_the_collective_is_injected():
    fired, passed = rank_state(_cap(0, FIRED, active=False)), rank_state(_cap(1, PASSED, active=False))
    assert fired.state == passed.state == "collective" and fired.op == passed.op == "all_reduce"
    assert fired.injected and fired.injected_site == "GroupCoordinator.all_reduce"
    assert not passed.injected and not passed.spin_wait  # gloo waits off the CPU
