"""Parsing of py-spy text/--native/--json and faulthandler dumps, log prefixes, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from repro.stacks import (
    Frame,
    ThreadStack,
    detect_format,
    load_dump_file,
    parse_dump,
    parse_faulthandler,
    parse_pyspy_json,
    parse_pyspy_text,
    rank_from_filename,
    rank_from_title,
    render_pyspy_text,
    shorten_path,
    split_log_prefixes,
)

STACKS = Path(__file__).resolve().parent / "fixtures" / "stacks"


def test_pyspy_text_reads_process_title_threads_and_frames(dumps_dir):
    (d,) = load_dump_file(dumps_dir / "sglang_tp2_cpu_hang" / "rank1.txt")
    assert d.fmt == "py-spy"
    assert d.pid == 9283 and d.title == "sglang::scheduler_TP1" and d.python_version == "3.11.7"
    assert [t.name for t in d.threads] == ["MainThread", "Thread-1 (_watchdog_thread)", "tqdm_monitor"]
    main = d.main_thread
    assert main is not None and main.is_main and main.thread_id == "9283"
    assert main.frames[0] == Frame(function="all_reduce", module_or_file="torch/distributed/distributed_c10d.py",
                                   line=3913, native=False)
    assert main.frames[2].function == "GroupCoordinator.all_reduce"
    assert main.frames[-1].function == "<module>" and main.frames[-1].module_or_file == "<string>"
    assert d.warnings == []


def test_json_and_text_of_the_same_dump_give_the_same_frames(dumps_dir):
    for k in range(3):
        (t,) = load_dump_file(dumps_dir / "gloo3_extra_allreduce" / f"rank{k}.txt")
        (j,) = load_dump_file(dumps_dir / "gloo3_extra_allreduce" / f"rank{k}.json")
        assert j.fmt == "py-spy-json" and t.fmt == "py-spy"
        assert j.pid == t.pid
        assert j.main_thread.frames == t.main_thread.frames


def test_native_frames_are_marked_and_python_frames_kept():
    (d,) = load_dump_file(STACKS / "gloo3_native_rank0.txt")
    main = d.main_thread
    natives = [f for f in main.frames if f.native]
    assert any(f.function == "c10d::Work::wait" and f.module_or_file == "libtorch_cpu.so" for f in natives)
    assert natives[0].line is None
    # the huge pybind11 symbol full of parentheses is one native frame
    assert any(f.function.startswith("pybind11::cpp_function::initialize<") for f in natives)
    assert [f.function for f in main.python_frames][:3] == [
        "all_reduce", "_exception_logger.<locals>.wrapper", "check_prefetch_progress"]
    assert d.warnings == []


def test_native_json_frames_use_module_as_native_flag():
    data = [{"pid": 5, "thread_id": 1, "thread_name": "MainThread", "os_thread_id": 5, "active": False,
             "frames": [
                 {"name": "pthread_cond_wait", "filename": "/usr/lib/libc.so.6", "module": "/usr/lib/libc.so.6",
                  "short_filename": "libc.so.6", "line": 0},
                 {"name": "all_reduce", "filename": "/v/site-packages/torch/distributed/distributed_c10d.py",
                  "module": None, "short_filename": "torch/distributed/distributed_c10d.py", "line": 3913}]}]
    (d,) = parse_pyspy_json(data)
    f0, f1 = d.main_thread.frames
    assert f0.native and f0.line is None and not f1.native and f1.line == 3913


def test_faulthandler_dump_from_a_real_gloo_job():
    (d,) = load_dump_file(STACKS / "gloo3_faulthandler_rank0.txt")
    assert d.fmt == "faulthandler"
    assert d.pid == 9816 and "desync.py 0 3" in d.title
    main = d.main_thread
    assert main.is_main and d.threads[0] is main
    assert [f.function for f in main.frames[:3]] == ["all_reduce", "wrapper", "check_prefetch_progress"]
    assert main.frames[0].module_or_file == "torch/distributed/distributed_c10d.py"
    guard = [t for t in d.threads if not t.is_main]
    assert guard and guard[0].frames[-1].function == "_bootstrap"


def test_faulthandler_file_with_two_dumps_uses_the_last():
    one = (STACKS / "gloo3_faulthandler_rank1.txt").read_text()
    body = one.split("\n", 2)[2]  # without Process/comment header
    second = body.replace("line 70 in recv_requests", "line 71 in recv_requests")
    (d,) = parse_faulthandler(body + "\n" + second)
    assert any("used the last one" in w for w in d.warnings)
    assert any(f.line == 71 for f in d.main_thread.frames)


def test_compose_log_prefixes_are_stripped_and_services_split(dumps_dir):
    a = (dumps_dir / "sglang_tp2_cpu_hang" / "rank0.txt").read_text().splitlines()
    b = (dumps_dir / "sglang_tp2_cpu_hang" / "rank1.txt").read_text().splitlines()
    lines = [f"sglang-tp0  | {x}" for x in a] + [f"sglang-tp1  | {x}" for x in b]
    lines.insert(5, "sglang-tp1  | ")  # interleaved
    dumps = parse_dump("\n".join(lines))
    assert [d.label for d in dumps] == ["sglang-tp0", "sglang-tp1"]
    assert [rank_from_title(d.title) for d in dumps] == [0, 1]
    assert dumps[1].main_thread.frames[2].function == "GroupCoordinator.all_reduce"


def test_bracket_prefix_with_timestamp_is_stripped(dumps_dir):
    a = (dumps_dir / "sglang_tp2_cpu_idle" / "rank0.txt").read_text().splitlines()
    text = "\n".join(f"[pod/tp0] 2026-11-30T05:00:0{i % 10}.123Z {x}" for i, x in enumerate(a))
    (label, part), = split_log_prefixes(text)
    assert label == "pod/tp0"
    (d,) = parse_dump(text)
    assert d.title == "sglang::scheduler_TP0" and d.main_thread.frames[0].function == "broadcast"


def test_garbage_lines_are_reported_and_the_rest_parsed(dumps_dir):
    lines = (dumps_dir / "sglang_tp2_cpu_hang" / "rank0.txt").read_text().splitlines()
    lines.insert(6, "%%% garbage &&& not a frame")
    lines.insert(9, "\x00\x01binary junk")
    (d,) = parse_dump("\n".join(lines))
    assert d.main_thread.frames[0].function == "all_reduce"
    assert any("ignored 2 line(s)" in w for w in d.warnings)


def test_truncated_dump_keeps_what_was_read(dumps_dir):
    text = (dumps_dir / "sglang_tp2_cpu_hang" / "rank1.txt").read_text()
    cut = text[: text.index("VocabParallelEmbedding.forward") + 10]  # cut mid-line
    (d,) = parse_dump(cut)
    main = d.main_thread
    assert main.frames[0].function == "all_reduce"
    assert main.frames[-1].function == "tensor_model_parallel_all_reduce"
    assert any("ignored 1 line" in w for w in d.warnings)
    (d2,) = parse_dump("Process 1: x\nPython v3.11.7 (/usr/bin/python3)\n\nThread 1 (idle): \"MainThread\"\n")
    assert any("no frames (truncated dump?)" in w for w in d2.warnings)


def test_non_python_dump_gives_a_clear_message():
    (d,) = parse_dump("Error: Failed to find python version from target process\n")
    assert d.threads == []
    assert any("py-spy reported: Error: Failed to find python version" in w for w in d.warnings)
    assert any("is this a dump of a Python process?" in w for w in d.warnings)
    (e,) = parse_dump("\x7fELF\x02\x01 random bytes", source="core.bin")
    assert e.threads == [] and all(w.startswith("core.bin: ") for w in e.warnings)


def test_invalid_json_gives_a_message_not_an_exception():
    (d,) = parse_pyspy_json('[{"pid": 1, "frames": [')
    assert d.threads == [] and "not complete JSON" in d.warnings[0] and "truncated" in d.warnings[0]
    (d,) = parse_pyspy_json('[{"pid": 1, "frames": [}]')
    assert d.threads == [] and "not valid JSON" in d.warnings[0] and "truncated" not in d.warnings[0]


@pytest.mark.parametrize("cut", [0.5, 0.9])
def test_analyze_of_a_truncated_pyspy_json_names_the_file_and_says_it_is_incomplete(tmp_path: Path, cut: float):
    """A py-spy --json dump cut short (a paste, a copy of a file still being written) was refused only with
    "expected py-spy text or --json, ...": nothing said which file or that its JSON was incomplete."""
    from typer.testing import CliRunner

    from repro.cli import app

    threads = [{"pid": 100 + r, "thread_id": 1, "thread_name": "MainThread", "os_thread_id": 100 + r,
                "active": False, "owns_gil": False,
                "frames": [{"name": f"f{i}", "filename": f"/x/m{i}.py", "short_filename": f"m{i}.py", "line": i,
                            "locals": None} for i in range(1, 40)]} for r in (0, 1)]
    import json

    for r in (0, 1):
        text = json.dumps([threads[r]], indent=2)
        (tmp_path / f"rank{r}.json").write_text(text[:int(len(text) * cut)])
    res = CliRunner().invoke(app, ["analyze", str(tmp_path / "rank0.json"), str(tmp_path / "rank1.json")])
    flat = " ".join(res.output.split())
    assert res.exit_code == 2, res.output
    assert "rank0.json: not complete JSON" in flat and "rank1.json: not complete JSON" in flat and "truncated" in flat, flat
    assert "Traceback" not in res.output


def test_locals_lines_are_skipped():
    text = ('Process 7: python x.py\nPython v3.11.7 (/usr/bin/python3)\n\nThread 7 (active): "MainThread"\n'
            '    f (x.py:3)\n        Arguments:\n            a: 1\n        Locals:\n            b: "x (y.py:2)"\n'
            '    <module> (x.py:9)\n')
    (d,) = parse_pyspy_text(text)
    assert [f.function for f in d.main_thread.frames] == ["f", "<module>"]
    assert d.main_thread.active is True and d.warnings == []


def test_format_detection(dumps_dir):
    assert detect_format((dumps_dir / "gloo3_extra_allreduce" / "rank0.json").read_text()) == "py-spy-json"
    assert detect_format((dumps_dir / "gloo3_extra_allreduce" / "rank0.txt").read_text()) == "py-spy"
    assert detect_format((STACKS / "gloo3_faulthandler_rank0.txt").read_text()) == "faulthandler"
    assert detect_format("hello") == "unknown"


@pytest.mark.parametrize(
    "title,rank",
    [("sglang::scheduler_TP3", 3), ("sglang::scheduler_DP1_TP2", 2), ("sglang::scheduler_PP1_TP0", 0),
     # plain sglang::scheduler is a TP=1 server's only rank (one title parser, the adapter's: repro/targets/sglang/adapter.py)
     ("sglang::scheduler", 0), ("sglang::detokenizer", None), ("python desync.py 0 3", None)],
)
def test_rank_from_title(title, rank):
    assert rank_from_title(title) == rank


def test_rank_from_filename():
    assert rank_from_filename("rank3.txt") == 3
    assert rank_from_filename("/x/rank_12-2.json") == 12
    assert rank_from_filename("tp1.log") == 1
    assert rank_from_filename("detokenizer.txt") is None


def test_shorten_path():
    assert shorten_path("/v/lib/python3.11/site-packages/torch/distributed/x.py") == "torch/distributed/x.py"
    assert shorten_path("/usr/lib/python3.11/threading.py") == "threading.py"
    assert shorten_path("<string>") == "<string>"


def test_render_roundtrips_through_the_text_parser(dumps_dir):
    (d,) = load_dump_file(dumps_dir / "sglang_tp2_cpu_idle" / "rank0.txt")
    (back,) = parse_pyspy_text(render_pyspy_text(d.threads, d.pid, d.title))
    assert back.pid == d.pid and back.title == d.title
    assert [t.frames for t in back.threads] == [t.frames for t in d.threads]
    assert isinstance(back.threads[0], ThreadStack)
