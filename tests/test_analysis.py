"""Rank states, grouping and odd rank(s) out, checked against every dump fixture as EXPECTED.md says."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from repro.analysis import (
    AnalyzeInputError,
    analyze,
    analyze_paths,
    changed_ranks,
    comm_layer,
    frames_unchanged,
    load_captures,
    read_thread,
)
from repro.stacks import Frame, RankCapture, ThreadStack, parse_dump

STACKS = Path(__file__).resolve().parent / "fixtures" / "stacks"


def _cap(rank: int, text: str) -> RankCapture:
    (d,) = parse_dump(text)
    return RankCapture(rank=rank, pid=d.pid, ok=True, method="file", text=text, threads=d.threads)


def test_gloo3_extra_allreduce_rank0_is_the_odd_rank_out(dumps_dir):
    a = analyze_paths([dumps_dir / "gloo3_extra_allreduce"])
    assert a.diverged and a.odd_ranks == [0] and not a.even_split
    assert a.reason == "different collective"
    r0, r1, r2 = a.ranks
    assert (r0.state, r0.op, r0.blocked_frame) == ("collective", "all_reduce", "check_prefetch_progress (desync.py:13)")
    assert r0.caller_chain[:2] == ["check_prefetch_progress", "scheduler_loop"]
    for r in (r1, r2):
        assert (r.state, r.op) == ("collective", "broadcast") and r.caller_chain[0] == "scheduler_loop"
    assert [g.ranks for g in a.groups] == [[1, 2], [0]]
    assert "odd rank out: 0" in a.summary and "rank 0 is in all_reduce" in a.summary
    assert all(r.process_group is None for r in a.ranks)  # py-spy shows no process groups


def test_gloo3_json_dumps_give_the_same_diagnosis_as_text(dumps_dir, tmp_path):
    for k in range(3):
        shutil.copy(dumps_dir / "gloo3_extra_allreduce" / f"rank{k}.json", tmp_path / f"rank{k}.json")
    a = analyze_paths([tmp_path])
    b = analyze_paths([dumps_dir / "gloo3_extra_allreduce"])
    assert a.diverged and a.odd_ranks == [0]
    assert [r.location_key for r in a.ranks] == [r.location_key for r in b.ranks]


def test_sglang_tp2_hang_is_a_one_against_one_split_naming_both_sides(dumps_dir):
    a = analyze_paths([dumps_dir / "sglang_tp2_cpu_hang"])
    assert a.diverged and a.even_split and a.odd_ranks == []
    assert a.reason == "same collective, different call sites"
    r0, r1 = a.ranks
    assert r0.op == r1.op == "all_reduce"
    assert r0.injected and r0.caller_chain[:2] == ["[injected] _patch.<locals>.wrapped", "Scheduler.event_loop_normal"]
    assert r0.blocked_frame.startswith("Scheduler.event_loop_normal (")
    assert r1.via == "GroupCoordinator" and r1.layers[0] == "GroupCoordinator"
    assert r1.blocked_frame.startswith("VocabParallelEmbedding.forward")
    assert "Scheduler.run_batch" in r1.caller_chain or len(r1.caller_chain) == 8
    # the blocked threads are the main threads, not the watchdog or tqdm
    assert r0.thread == r1.thread == "MainThread"
    assert "rank 0 is in all_reduce" in a.summary and "rank 1 is in all_reduce via GroupCoordinator" in a.summary
    assert "1 against 1" in a.summary


def test_idle_ranks_in_broadcast_are_not_a_deadlock(dumps_dir):
    a = analyze_paths([dumps_dir / "sglang_tp2_cpu_idle"])
    assert not a.diverged and a.odd_ranks == [] and len(a.groups) == 1
    for r in a.ranks:
        assert (r.state, r.op, r.via) == ("collective", "broadcast", "broadcast_pyobj")
        assert r.caller_chain[:2] == ["SchedulerRequestReceiver._broadcast_reqs_across_ranks",
                                      "SchedulerRequestReceiver.recv_requests"]
    assert a.summary.startswith("Not diverged") and "not a hang by itself" in a.summary


def test_tp4_prefetch_rank0_alone_in_the_cache_all_reduce(dumps_dir):
    a = analyze_paths([dumps_dir / "sglang_tp4_prefetch_synthetic"])
    assert a.diverged and a.odd_ranks == [0]
    assert a.ranks[0].caller_chain[:4] == ["HiRadixCache._all_reduce_attn_groups", "HiRadixCache.can_terminate_prefetch",
                                           "HiRadixCache.check_prefetch_progress", "Scheduler._get_new_batch_prefill_raw"]
    for r in a.ranks[1:]:
        assert (r.op, r.via) == ("broadcast", "broadcast_pyobj") and "SchedulerRequestReceiver.recv_requests" in r.caller_chain
    assert [g.ranks for g in a.groups] == [[1, 2, 3], [0]]


def test_tp4_disagg_two_against_two_collective_vs_idle_wait(dumps_dir):
    a = analyze_paths([dumps_dir / "sglang_tp4_disagg_synthetic"])
    assert a.diverged and a.even_split and a.odd_ranks == []
    assert a.reason == "collective vs idle-wait"
    assert sorted(g.ranks for g in a.groups) == [[0, 1], [2, 3]]
    for r in a.ranks[:2]:
        assert r.state == "collective" and r.caller_chain[:2] == ["HiRadixCache.check_hicache_events",
                                                                  "Scheduler.get_new_batch_prefill"]
    for r in a.ranks[2:]:
        assert r.state == "idle-wait" and r.wait == "zmq poll/recv" and r.caller_chain[0] == "Scheduler.on_idle"
        assert r.op is None
    assert "2 against 2" in a.summary


def test_faulthandler_and_native_dumps_give_the_same_states_as_py_spy():
    fh = analyze([_cap(k, (STACKS / f"gloo3_faulthandler_rank{k}.txt").read_text()) for k in (0, 1)])
    nat = analyze([_cap(k, (STACKS / f"gloo3_native_rank{k}.txt").read_text()) for k in (0, 1)])
    for a in (fh, nat):
        assert a.diverged and a.even_split
        assert [(r.state, r.op) for r in a.ranks] == [("collective", "all_reduce"), ("collective", "broadcast")]
    assert nat.ranks[0].layers == ["torch.distributed", "native-wait"]
    assert [r.location_key for r in fh.ranks] == [r.location_key for r in nat.ranks]


def test_collective_held_by_a_non_main_thread_is_recognised():
    main = ThreadStack(thread_id="1", name="MainThread", is_main=True, frames=[
        Frame(function="Thread._wait_for_tstate_lock", module_or_file="threading.py", line=1132),
        Frame(function="Thread.join", module_or_file="threading.py", line=1112),
        Frame(function="Scheduler.event_loop_overlap", module_or_file="sglang/srt/managers/scheduler.py", line=10)])
    fwd = ThreadStack(thread_id="2", name="forward-thread", frames=[
        Frame(function="all_reduce", module_or_file="torch/distributed/distributed_c10d.py", line=3913),
        Frame(function="GroupCoordinator.all_reduce", module_or_file="sglang/srt/distributed/parallel_state.py", line=699),
        Frame(function="LlamaModel.forward", module_or_file="llama.py", line=475),
        Frame(function="Thread.run", module_or_file="threading.py", line=982),
        Frame(function="Thread._bootstrap", module_or_file="threading.py", line=1002)])
    watchdog = ThreadStack(thread_id="3", name="Thread-1 (_watchdog_thread)", frames=[
        Frame(function="WatchdogRaw._watchdog_once", module_or_file="utils/watchdog.py", line=147)])
    a = analyze([RankCapture(rank=0, ok=True, threads=[main, fwd, watchdog])])
    r = a.ranks[0]
    assert (r.state, r.op, r.via, r.thread, r.main_thread) == ("collective", "all_reduce", "GroupCoordinator",
                                                                "forward-thread", False)
    assert r.caller_chain == ["LlamaModel.forward"]
    # a busy main thread beside it keeps the rank busy, with a note
    busy_main = main.model_copy(update={"frames": [Frame(function="Scheduler.process_batch_result",
                                                         module_or_file="scheduler.py", line=5)]})
    b = analyze([RankCapture(rank=0, ok=True, threads=[busy_main, fwd])]).ranks[0]
    assert b.state == "busy" and "forward-thread is in all_reduce" in b.error


def test_a_busy_rank_means_not_diverged_yet(dumps_dir):
    hang = (dumps_dir / "sglang_tp2_cpu_hang" / "rank1.txt").read_text()
    busy = ("Process 10: sglang::scheduler_TP0\n\nThread 10 (active): \"MainThread\"\n"
            "    _delay (repro_injector/actions.py:40)\n    wrapped (sitecustomize.py:22)\n"
            "    Scheduler.event_loop_normal (scheduler.py:2039)\n")
    a = analyze([_cap(0, busy), _cap(1, hang)])
    assert not a.diverged and a.busy_ranks == [0]
    assert a.ranks[0].state == "busy" and a.ranks[0].injected
    assert a.reason == "some rank busy" and "rank 0 busy in" in a.summary


def test_comm_layers_and_idle_kinds():
    def f(func, file, native=False):
        return Frame(function=func, module_or_file=file, line=None if native else 1, native=native)

    assert comm_layer(f("PyNcclCommunicator.all_reduce", "sglang/srt/distributed/device_communicators/pynccl.py")) == "pynccl"
    assert comm_layer(f("monitored_barrier", "torch/distributed/distributed_c10d.py")) == "monitored_barrier"
    assert comm_layer(f("c10d::ProcessGroupNCCL::WorkNCCL::wait", "libtorch_cuda.so", True)) == "native-wait"
    assert comm_layer(f("broadcast_pyobj", "sglang/srt/utils/common.py")) == "broadcast_pyobj"
    t = ThreadStack(thread_id="1", is_main=True, frames=[
        f("ncclAllReduce", "libnccl.so.2", True),
        f("PyNcclCommunicator.all_reduce", "sglang/srt/distributed/device_communicators/pynccl.py"),
        f("GroupCoordinator._all_reduce_in_place", "sglang/srt/distributed/parallel_state.py"),
        f("GroupCoordinator.all_reduce", "sglang/srt/distributed/parallel_state.py"),
        f("RowParallelLinear.forward", "sglang/srt/layers/linear.py")])
    r = read_thread(t)
    assert (r.state, r.op, r.via) == ("collective", "all_reduce", "GroupCoordinator")
    assert r.layers == ["GroupCoordinator", "pynccl", "native-wait"]
    q = read_thread(ThreadStack(thread_id="1", is_main=True, frames=[
        f("Queue.get", "queue.py"), f("Worker.loop", "worker.py")]))
    assert (q.state, q.wait) == ("idle-wait", "queue get")


def test_frames_unchanged_compares_the_deciding_thread(dumps_dir):
    caps = load_captures([dumps_dir / "sglang_tp2_cpu_hang"])
    again = load_captures([dumps_dir / "sglang_tp2_cpu_hang"])
    assert frames_unchanged(caps, again)
    moved_text = caps[1].text.replace("vocab_parallel_embedding.py:533", "vocab_parallel_embedding.py:540")
    moved = [again[0], _cap(1, moved_text)]
    assert not frames_unchanged(caps, moved) and changed_ranks(caps, moved) == [1]
    # a changed background (watchdog) thread does not count
    wd = caps[0].text.replace("utils/watchdog.py:147", "utils/watchdog.py:150")
    assert frames_unchanged(caps, [_cap(0, wd), again[1]])
    assert not frames_unchanged(caps, again[:1])  # rank 1 missing


def test_evidence_folder_with_two_tagged_captures(dumps_dir, tmp_path):
    stacks = tmp_path / "ev" / "stacks"
    stacks.mkdir(parents=True)
    for k in range(2):
        shutil.copy(dumps_dir / "sglang_tp2_cpu_hang" / f"rank{k}.txt", stacks / f"rank{k}.txt")
        shutil.copy(dumps_dir / "sglang_tp2_cpu_idle" / f"rank{k}.txt", stacks / f"rank{k}-2.txt")
    (stacks / "capture.json").write_text("{}")
    assert analyze_paths([tmp_path / "ev"]).diverged
    assert not analyze_paths([tmp_path / "ev"], tag="-2").diverged
    with pytest.raises(AnalyzeInputError, match="no capture with tag"):
        analyze_paths([tmp_path / "ev"], tag="-9")


def test_loose_files_get_ranks_from_titles_and_missing_paths_are_named(dumps_dir, tmp_path):
    shutil.copy(dumps_dir / "sglang_tp4_prefetch_synthetic" / "rank0.txt", tmp_path / "a.txt")
    shutil.copy(dumps_dir / "sglang_tp4_prefetch_synthetic" / "rank2.txt", tmp_path / "b.txt")
    a = analyze_paths([tmp_path / "b.txt", tmp_path / "a.txt"])
    assert [r.rank for r in a.ranks] == [0, 2] and a.even_split
    with pytest.raises(AnalyzeInputError, match="no such file or folder"):
        analyze_paths([tmp_path / "nope"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(AnalyzeInputError, match="no dump files"):
        analyze_paths([empty])


def test_unreadable_rank_is_reported_and_the_others_analysed(dumps_dir, tmp_path):
    shutil.copy(dumps_dir / "gloo3_extra_allreduce" / "rank0.txt", tmp_path / "rank0.txt")
    shutil.copy(dumps_dir / "gloo3_extra_allreduce" / "rank1.txt", tmp_path / "rank1.txt")
    (tmp_path / "rank2.txt").write_text("Error: Failed to find python version from target process\n")
    a = analyze_paths([tmp_path])
    assert a.unknown_ranks == [2] and a.ranks[2].state == "unknown"
    assert "Failed to find python version" in a.ranks[2].error
    assert a.diverged and "no readable stack from rank 2" in a.summary


def test_markdown_has_the_summary_table_and_raw_stacks(dumps_dir):
    caps = load_captures([dumps_dir / "sglang_tp2_cpu_hang"])
    md = analyze(caps).to_markdown(caps)
    assert md.startswith("**Diagnosis:** DIVERGED")
    assert "| rank | state | blocked in | via | call site | caller chain |" in md
    assert md.count("<details>") == 2 and "sglang::scheduler_TP1" in md


def test_cli_analyze_prints_table_summary_json_and_markdown(dumps_dir, tmp_path):
    from typer.testing import CliRunner

    from repro.cli import EXIT_USAGE, app

    runner = CliRunner()
    md = tmp_path / "comment.md"
    res = runner.invoke(app, ["analyze", str(dumps_dir / "gloo3_extra_allreduce"), "--markdown", str(md)])
    assert res.exit_code == 0, res.output
    assert "Where each rank is blocked" in res.output and "odd rank out: 0" in res.output
    # no scenario: the engine is assumed (a plain torch.distributed job's titles name none) and said so
    assert "engine: any of: sglang, vllm (assumed: no title names an engine" in " ".join(res.output.split())
    assert md.read_text().startswith("**Diagnosis:** DIVERGED")
    res = runner.invoke(app, ["analyze", "--json", str(dumps_dir / "sglang_tp2_cpu_idle" / "rank0.txt"),
                              str(dumps_dir / "sglang_tp2_cpu_idle" / "rank1.txt")])
    assert res.exit_code == 0
    data = json.loads(res.stdout)
    assert data["diverged"] is False and [r["rank"] for r in data["ranks"]] == [0, 1]
    assert data["engine"] == {"name": "sglang", "from": "the rank titles"}
    res = runner.invoke(app, ["analyze", str(tmp_path / "missing")])
    assert res.exit_code == EXIT_USAGE and "no such file or folder" in " ".join(res.output.split())


def test_evidence_folder_without_untagged_capture_uses_the_newest(dumps_dir, tmp_path):
    import os
    import time

    stacks = tmp_path / "stacks"
    stacks.mkdir()
    for k in range(2):
        shutil.copy(dumps_dir / "sglang_tp2_cpu_idle" / f"rank{k}.txt", stacks / f"rank{k}-1.txt")
        shutil.copy(dumps_dir / "sglang_tp2_cpu_hang" / f"rank{k}.txt", stacks / f"rank{k}-1b.txt")
    old = time.time() - 100
    for k in range(2):
        os.utime(stacks / f"rank{k}-1.txt", (old, old))
    assert analyze_paths([tmp_path]).diverged  # -1b is newest
    assert not analyze_paths([tmp_path], tag="-1").diverged


def test_idle_sleep_beside_the_request_broadcast_is_not_a_divergence(dumps_dir):
    """Seen on a real idle sglang 0.5.23 TP=2 server with --sleep-on-idle: TP0 sleeps in IdleSleeper's zmq poll
    while TP1 already waits in the request broadcast for it."""
    idle1 = (dumps_dir / "sglang_tp2_cpu_idle" / "rank1.txt").read_text()
    sleeping0 = ("Process 8557: sglang::scheduler_TP0\n\nThread 8557 (idle): \"MainThread\"\n"
                 "    Poller.poll (zmq/sugar/poll.py:106)\n"
                 "    IdleSleeper.maybe_sleep (scheduler_components/idle_sleeper.py:37)\n"
                 "    Scheduler.maybe_sleep_on_idle (scheduler.py:6162)\n"
                 "    Scheduler.on_idle (scheduler.py:5328)\n"
                 "    Scheduler.event_loop_normal (scheduler.py:2052)\n")
    a = analyze([_cap(0, sleeping0), _cap(1, idle1)])
    assert [r.state for r in a.ranks] == ["idle-wait", "collective"]
    assert not a.diverged and a.odd_ranks == [] and a.reason == "idle: waiting for the next request"
    assert "an idle server, not a hang" in a.summary
    # the same idle sleep beside a collective that is not the request broadcast still diverges
    hang1 = (dumps_dir / "sglang_tp2_cpu_hang" / "rank1.txt").read_text()
    assert analyze([_cap(0, sleeping0), _cap(1, hang1)]).diverged


def test_subprocesses_dump_keeps_only_the_scheduler_ranks(dumps_dir, tmp_path):
    http = ('Process 900: /opt/venv/bin/python -m sglang.launch_server --tp-size 2\nPython v3.11.7 (/usr/bin/python3)\n\n'
            'Thread 900 (idle): "MainThread"\n    select (selectors.py:468)\n    <module> (launch_server.py:11)\n')
    parts = [http] + [(dumps_dir / "sglang_tp2_cpu_hang" / f"rank{k}.txt").read_text() for k in (0, 1)]
    parts.append('Process 903: sglang::detokenizer\n\nThread 903 (idle): "MainThread"\n    poll (zmq/sugar/poll.py:106)\n')
    f = tmp_path / "all.txt"
    f.write_text("\n".join(parts))
    caps = load_captures([f])
    assert [c.rank for c in caps] == [0, 1]
    assert any("skipped pid 900" in w for w in caps[0].warnings)
    assert any("sglang::detokenizer" in w for w in caps[0].warnings)
    assert analyze(caps).diverged


def test_a_run_of_injector_frames_shows_once_before_the_call_site():
    text = ("Process 1: sglang::scheduler_TP0\n\nThread 1 (idle): \"MainThread\"\n"
            "    all_reduce (torch/distributed/distributed_c10d.py:3913)\n"
            "    _exception_logger.<locals>.wrapper (torch/distributed/c10d_logger.py:83)\n"
            "    Site._collective (repro_injector/_runtime.py:245)\n"
            "    Site.run (repro_injector/_runtime.py:265)\n"
            "    Runtime._make_wrapper.<locals>.repro_injected (repro_injector/_runtime.py:534)\n"
            "    Scheduler.event_loop_normal (scheduler.py:2048)\n")
    a = analyze([_cap(0, text)])
    r = a.ranks[0]
    assert r.injected and r.blocked_frame == "Scheduler.event_loop_normal (scheduler.py:2048)"
    assert r.caller_chain == ["[injected] Site._collective", "Scheduler.event_loop_normal"]
    assert json.loads(a.to_json()) == a.to_dict()


def test_a_single_rank_is_not_said_to_agree_with_itself(dumps_dir):
    a = analyze_paths([dumps_dir / "gloo3_extra_allreduce" / "rank0.txt"])
    assert [r.rank for r in a.ranks] == [0] and not a.diverged
    assert a.summary.startswith("Only rank 0 was captured: one rank cannot diverge from itself")
    assert "Not diverged" not in a.summary and "all_reduce" in a.summary


SMOKE_HANG = Path(__file__).resolve().parent / "fixtures" / "reproduce" / "smoke_watch_hang"


def test_json_and_text_of_one_capture_are_one_dump_not_a_warning(tmp_path):
    """The harness writes py-spy --json and text of each capture (stacks/rank<k>-<tag>.json and .txt): reading its
    own evidence folder said 'rank 0: 2 dumps found' for every rank. The JSON is used, silently."""
    stacks = tmp_path / "stacks"
    stacks.mkdir()
    for k in (0, 1):
        for ext in ("json", "txt"):
            shutil.copy(SMOKE_HANG / f"rank{k}.{ext}", stacks / f"rank{k}-proof.{ext}")
    caps = load_captures([tmp_path])
    assert [c.rank for c in caps] == [0, 1]
    assert all(c.fmt == "py-spy-json" for c in caps)
    assert not [w for c in caps for w in c.warnings if "dumps found" in w]


def test_two_different_captures_of_one_rank_still_warn(dumps_dir):
    """Two dumps of rank 0 from different processes (pids 4242 and 9282) compete: the warning stays."""
    caps = load_captures([SMOKE_HANG / "rank0.json", SMOKE_HANG / "rank0.txt",
                          dumps_dir / "sglang_tp2_cpu_hang" / "rank0.txt"])
    (c,) = caps
    assert any(w.startswith("rank 0: 3 dumps found") for w in c.warnings)
