"""SGLang adapter: command line, environment, request/response shapes, titles → ranks, testbed profile (no server)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from repro import testbed
from repro.procs import ProcInfo
from repro.targets.base import Adapter, LaunchSpec, StreamUpdate
from repro.targets.sglang import SGLangAdapter, parse_scheduler_title

A = SGLangAdapter()


def spec(**kw) -> LaunchSpec:
    base = dict(python="/venv/bin/python", model="/models/tiny", tp_size=2, port=30001, nccl_port=30002)
    base.update(kw)
    return LaunchSpec(**base)


def test_adapter_satisfies_protocol():
    assert isinstance(A, Adapter)


def test_launch_command_runs_launch_server_with_spec_then_extra_args():
    cmd = A.launch_command(spec(args=["--max-running-requests", "4"], host="0.0.0.0"))
    assert cmd[:3] == ["/venv/bin/python", "-m", "sglang.launch_server"]
    pairs = dict(zip(cmd[3::2], cmd[4::2]))
    assert pairs["--model-path"] == "/models/tiny"
    assert pairs["--tp-size"] == "2"
    assert pairs["--host"] == "0.0.0.0"
    assert pairs["--port"] == "30001"
    assert pairs["--nccl-port"] == "30002"
    assert cmd[-2:] == ["--max-running-requests", "4"]


def test_launch_command_refuses_unresolved_ports():
    with pytest.raises(ValueError, match="start_server"):
        A.launch_command(spec(port=0))


def test_launch_spec_rejects_bad_values():
    with pytest.raises(ValueError, match="tp_size"):
        spec(tp_size=0)
    with pytest.raises(ValueError, match="port"):
        spec(port=70000)


def test_launch_env_prepends_pythonpath_and_keeps_the_rest():
    s = spec(pythonpath_prepend=["/repo/injectors", "/repo/stub"], env={"A": "1"})
    env = A.launch_env(s, {"PYTHONPATH": "/user/lib:/repo/stub", "HOME": "/root", "A": "0"})
    assert env["PYTHONPATH"].split(os.pathsep) == ["/repo/injectors", "/repo/stub", "/user/lib"]
    assert env["A"] == "1" and env["HOME"] == "/root"
    assert env["PYTHONUNBUFFERED"] == "1"


def test_launch_env_spec_pythonpath_replaces_inherited_one():
    env = A.launch_env(spec(pythonpath_prepend=["/x"], env={"PYTHONPATH": "/mine"}), {"PYTHONPATH": "/inherited"})
    assert env["PYTHONPATH"] == os.pathsep.join(["/x", "/mine"])


def test_generate_body_is_greedy_and_ignores_eos():
    b = A.generate_body([1, 2, 3], 7, stream=True)
    assert b["input_ids"] == [1, 2, 3]
    assert b["stream"] is True
    assert b["sampling_params"] == {"max_new_tokens": 7, "temperature": 0.0, "ignore_eos": True}
    json.dumps(b)
    with pytest.raises(ValueError):
        A.generate_body([], 4, stream=False)
    with pytest.raises(ValueError):
        A.generate_body([1], 0, stream=False)


# Shapes as sglang 0.5.23 answers /generate with --skip-tokenizer-init (recorded from the CPU testbed).
FINAL = {"output_ids": [59, 101, 59, 101], "meta_info": {"finish_reason": {"type": "length", "length": 4},
                                                         "prompt_tokens": 4, "completion_tokens": 4}}


def test_parse_response_counts_ids_and_reads_finish_reason():
    assert A.parse_response(FINAL) == StreamUpdate(output_ids=4, finish_reason="length", done=True, error=None)
    assert A.parse_response([FINAL]).output_ids == 4


def test_parse_response_reports_errors_and_aborts():
    u = A.parse_response({"error": {"message": "boom"}})
    assert u.error == "boom" and u.done
    ab = A.parse_response({"output_ids": [1], "meta_info": {"finish_reason": {"type": "abort", "message": "oom"}}})
    assert ab.finish_reason == "abort" and ab.error == "oom"
    assert A.parse_response("nonsense").error


def test_parse_stream_lines():
    chunk = {"output_ids": [315, 11], "meta_info": {"finish_reason": None, "completion_tokens": 2}}
    u = A.parse_stream_line(b"data: " + json.dumps(chunk).encode())
    assert u == StreamUpdate(output_ids=2, finish_reason=None, done=False, error=None)
    last = A.parse_stream_line("data: " + json.dumps(FINAL))
    assert last.done and last.finish_reason == "length" and last.output_ids == 4
    end = A.parse_stream_line(b"data: [DONE]")
    assert end.done and end.output_ids is None
    assert A.parse_stream_line(b"") is None
    assert A.parse_stream_line(b": keep-alive") is None
    assert A.parse_stream_line(b"data: {not json").error


@pytest.mark.parametrize(
    "title, rank",
    [
        ("sglang::scheduler_TP0", 0),
        ("sglang::scheduler_TP1", 1),
        ("sglang::scheduler", 0),
        ("sglang::scheduler_DP0_TP3", 3),
        ("sglang::scheduler_PP1_TP2", 2),
        ("sglang::scheduler_DP1_PP0_ATTN_CP1_MOE_DP0_TP5_EP5", 5),
        ("sglang::detokenizer", None),
        ("python -m sglang.launch_server --tp-size 2", None),
        ("sglang::scheduler_TPx", None),
        ("sglang::schedulerX", None),
        ("", None),
    ],
)
def test_rank_of_title(title, rank):
    assert A.rank_of_title(title) == rank


def test_parse_title_keeps_every_dimension():
    t = parse_scheduler_title("sglang::scheduler_DP1_PP2_ATTN_CP3_MOE_DP4_TP5_EP6")
    assert (t.dp, t.pp, t.attn_cp, t.moe_dp, t.tp, t.ep) == (1, 2, 3, 4, 5, 6)


def _p(pid: int, title: str) -> ProcInfo:
    return ProcInfo(pid=pid, create_time=1.0, name="python", cmdline=[title])


def test_rank_pids_maps_schedulers_only():
    procs = [_p(10, "python -m sglang.launch_server"), _p(12, "sglang::scheduler_TP1"),
             _p(11, "sglang::scheduler_TP0"), _p(13, "sglang::detokenizer")]
    assert A.rank_pids(procs) == {0: 11, 1: 12}


def test_rank_pids_with_pipeline_stages_gives_global_ranks():
    procs = [_p(20 + i, f"sglang::scheduler_PP{pp}_TP{tp}") for i, (pp, tp) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)])]
    assert A.rank_pids(procs) == {0: 20, 1: 21, 2: 22, 3: 23}


def test_rank_pids_rejects_ambiguous_replicas():
    with pytest.raises(ValueError, match="rank 0"):
        A.rank_pids([_p(1, "sglang::scheduler_DP0_TP0"), _p(2, "sglang::scheduler_DP1_TP0")])


def _flags(args: list[str]) -> list[str]:
    return [a for a in args if a.startswith("--")]


def test_testbed_profile_adds_cpu_flags_env_and_stand_in():
    args, env, prepend = A.testbed_profile(spec(), [])
    for f in ("--device", "--attention-backend", "--disable-cuda-graph", "--sleep-on-idle", "--load-format",
              "--skip-tokenizer-init", "--watchdog-timeout", "--random-seed", "--disable-overlap-schedule"):
        assert f in args, f
    assert args[args.index("--device") + 1] == "cpu"
    assert float(args[args.index("--watchdog-timeout") + 1]) >= 3600
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert not Path(env["SGLANG_NCCL_SO_PATH"]).exists()
    assert len(env["SGLANG_CPU_OMP_THREADS_BIND"].split("|")) == 2
    assert prepend == [str(testbed.stub_dir())]
    assert (testbed.stub_dir() / "sgl_kernel" / "__init__.py").is_file()
    assert "REPRO_TESTBED_COMPAT" not in env
    assert "--hicache-io-backend" not in args


def test_testbed_profile_does_not_repeat_scenario_flags():
    args, _, _ = A.testbed_profile(spec(), ["--max-running-requests", "2", "--context-length=512"])
    assert "--max-running-requests" not in args
    assert not any(a.startswith("--context-length") for a in args)
    assert len(_flags(args)) == len(set(_flags(args)))


def test_testbed_profile_without_spec_covers_any_tp_size():
    _, env, _ = A.testbed_profile(None, [])
    assert len(env["SGLANG_CPU_OMP_THREADS_BIND"].split("|")) >= 8


def test_testbed_profile_hicache_adds_cpu_flags_compat_and_owned_storage_dir():
    args, env, _ = A.testbed_profile(spec(), ["--enable-hierarchical-cache", "--hicache-storage-backend", "file"])
    try:
        assert args[args.index("--hicache-io-backend") + 1] == "direct"
        assert args[args.index("--hicache-mem-layout") + 1] == "layer_first"
        extra = json.loads(args[args.index("--hicache-storage-backend-extra-config") + 1])
        assert extra["prefetch_threshold"] == 16
        assert env["REPRO_TESTBED_COMPAT"] == "1"
        assert Path(env["REPRO_TESTBED_COMPAT_DIR"]) == testbed.compat_dir()
        storage = Path(env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"])
        assert storage.is_dir()
        assert A.owned_dirs(env) == [storage]
    finally:
        for d in A.owned_dirs(env):
            d.rmdir()


def test_user_storage_dir_is_never_owned(tmp_path: Path):
    _, env, _ = A.testbed_profile(spec(), ["--enable-hierarchical-cache"], storage_dir=str(tmp_path))
    assert env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] == str(tmp_path)
    assert A.owned_dirs(env) == []


def test_tick_function_names_the_scheduler_method():
    mod, qual = A.tick_function.split(":")
    assert mod == "sglang.srt.managers.scheduler" and qual == "Scheduler.get_next_batch_to_run"


def test_tick_function_follows_the_disaggregation_mode():
    assert A.tick_function_for([]) == A.tick_function
    assert A.tick_function_for(["--disaggregation-mode", "prefill"]).endswith(
        "SchedulerDisaggregationPrefillMixin.get_next_disagg_prefill_batch_to_run")
    assert A.tick_function_for(["--disaggregation-mode=decode"]).startswith("sglang.srt.disaggregation.decode:")
    assert A.tick_function_for(["--disaggregation-mode", "null"]) == A.tick_function


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_testbed_profile_pd_roles_get_mooncake_over_tcp_and_the_compat_layer(mode):
    args, env, _ = A.testbed_profile(spec(), ["--disaggregation-mode", mode, "--disaggregation-transfer-backend", "mooncake"])
    assert (env["MOONCAKE_PROTOCOL"], env["MC_FORCE_TCP"], env["SGLANG_HOST_IP"]) == ("tcp", "1", "127.0.0.1")
    assert env[testbed.COMPAT_ENV] == "1" and env[testbed.COMPAT_DIR_ENV] == str(testbed.compat_dir())
    backup = args[args.index("--disaggregation-decode-retraction-backup") + 1] if mode == "decode" else None
    assert ("--disaggregation-decode-retraction-backup" in args) == (mode == "decode")
    assert backup in (None, "cpu_tensor")
    assert "--hicache-io-backend" not in args  # HiCache flags only with HiCache


def test_testbed_profile_keeps_a_scenarios_own_retraction_backup_and_leaves_plain_servers_alone():
    args, _, _ = A.testbed_profile(spec(), ["--disaggregation-mode", "decode",
                                            "--disaggregation-decode-retraction-backup", "host_pool"])
    assert args.count("--disaggregation-decode-retraction-backup") == 0
    _, env, _ = A.testbed_profile(spec(), [])
    assert not any(k in env for k in ("MOONCAKE_PROTOCOL", "MC_FORCE_TCP", "SGLANG_HOST_IP"))
