"""Issue 29 item 1: `repro analyze` is bounded in ranks, output lines and memory on huge inputs.

The small synthetic files here stand for the 50 MB ones of benchmarks/analyze_memory.py (measured numbers in
benchmarks/RESULTS.md): the bounds are lowered with monkeypatch so the same code paths run in milliseconds.
"""

from __future__ import annotations

from typer.testing import CliRunner

import repro.cli as cli
from repro.analysis import analyze_paths
from repro.readers import assemble, parse_dump

HEADER = "Process 4242: python3 -m sglang.launch_server\nPython v3.11.7 (/usr/bin/python3)\n\n"
HEADED = "Process {pid}: python3 job.py\nPython v3.11.7 (/usr/bin/python3)\n\n"
BLOCK = ('Thread {tid} (idle): "MainThread"\n    all_reduce (torch/distributed/distributed_c10d.py:2501)\n'
         "    event_loop_normal (sglang/srt/managers/scheduler.py:900)\n\n")


def test_one_header_with_its_block_repeated_is_one_rank_with_a_note():
    text = HEADER + BLOCK.format(tid="0x7F00DEADBEEF") * 500
    dumps = parse_dump(text, "one.txt")
    assert len(dumps) == 1 and dumps[0].pid == 4242 and len(dumps[0].threads) == 1
    assert any("499 repeated thread block(s)" in n for n in dumps[0].notes), dumps[0].notes


def test_processes_past_the_bound_are_counted_not_kept(monkeypatch):
    monkeypatch.setattr(assemble, "MAX_PROCESSES", 4)
    text = "".join(HEADED.format(pid=1000 + k) + BLOCK.format(tid=1000 + k) for k in range(10))
    dumps = parse_dump(text, "many.txt")
    assert len(dumps) == 4
    assert any("6 more process block(s) beyond the first 4 not read" in w for w in dumps[-1].warnings), dumps[-1].warnings


def test_analyze_output_is_bounded_and_says_what_was_left_out(tmp_path, monkeypatch):
    monkeypatch.setattr(assemble, "MAX_PROCESSES", 300)
    monkeypatch.setattr(cli, "MAX_TABLE_RANKS", 5)
    f = tmp_path / "many.txt"
    f.write_text("".join(HEADED.format(pid=1000 + k) + BLOCK.format(tid=1000 + k) for k in range(400)))
    assert len(analyze_paths([f]).ranks) == 300
    r = CliRunner().invoke(cli.app, ["analyze", str(f)])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 0, r.output
    assert len(lines) <= 200, len(lines)
    assert "295 more ranks" in r.output and "more inputs" in r.output and "more warnings" in r.output
    assert "100 more process block(s) beyond the first 300 not read" in " ".join(r.output.split())


# ---- issue 29 item 1, done when: a one-header dump is one rank, output ≤ 200 lines; ranks and memory are bounded
from pathlib import Path  # noqa: E402

import repro.analysis.load as analysis_load  # noqa: E402
import repro.readers as readers_mod  # noqa: E402

SGLANG_RANK1 = Path(__file__).resolve().parent / "fixtures" / "dumps" / "sglang_tp2_cpu_hang" / "rank1.txt"


def _threads(text: str) -> list[str]:
    blocks: list[str] = []
    for line in text.splitlines():
        if line.startswith("Thread "):
            blocks.append(line + "\n")
        elif blocks and line.strip():
            blocks[-1] += line + "\n"
    return blocks


def _one_header_dump(size: int) -> str:
    """A real py-spy dump of one SGLang rank (header once), then its main thread again and again under other thread
    ids, and its background threads under new ids, a blank line between threads: one process (issue 29's 50 MB
    files, small; benchmarks/analyze_one_header.py writes the 50 MB ones)."""
    text = SGLANG_RANK1.read_text()
    head = "".join(text.splitlines(keepends=True)[:3])
    main, *others = _threads(text)
    out, k = [head, main, "\n"], 0
    n = sum(map(len, out))
    while n < size:
        src = main if k % 2 else others[k % len(others)]
        b = src.replace(src.split(" ", 2)[1], str(30000 + k), 1) + "\n"
        out.append(b)
        n, k = n + len(b), k + 1
    return "".join(out)


def test_a_one_header_dump_of_megabytes_is_one_rank_in_under_200_lines(tmp_path):
    f = tmp_path / "big.txt"
    f.write_text(_one_header_dump(2 << 20))
    r = CliRunner().invoke(cli.app, ["analyze", str(f)])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    out = " ".join(r.output.split())
    assert r.exit_code == 0, r.output[-2000:]
    assert len(lines) <= 200, len(lines)
    assert "Only rank 1 was captured" in out and "py-spy text (1 process)" in out, out[:2000]
    assert "threads named 'MainThread' in one process (pid 9283)" in out, out[-2000:]
    assert "thread(s) of this process not kept beyond the readers' bound (512 per process" in out, out[-2000:]


def test_rank_prefixes_past_the_bound_are_counted_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(readers_mod, "MAX_SOURCES", 8, raising=False)
    monkeypatch.setattr(assemble, "MAX_PROCESSES", 8)
    body = SGLANG_RANK1.read_text().split("\n", 2)[2]
    f = tmp_path / "prefixed.txt"
    f.write_text("".join(f"[rank{k}]: {ln}\n" for k in range(50) for ln in body.splitlines()))
    assert [r.rank for r in analyze_paths([f]).ranks] == list(range(8))
    r = CliRunner().invoke(cli.app, ["analyze", str(f)])
    out = " ".join(r.output.split())
    assert r.exit_code == 0 and len([ln for ln in r.output.splitlines() if ln.strip()]) <= 200, r.output
    assert out.count("more sources (line prefixes) beyond the first 8 not read") == 1, out[-1500:]


def test_ranks_past_the_bound_across_files_are_counted_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(analysis_load, "MAX_RANKS", 3)
    text = SGLANG_RANK1.read_text()
    files = []
    for k in range(5):
        files.append(tmp_path / f"rank{k}.txt")
        files[-1].write_text(text.replace("sglang::scheduler_TP1", f"sglang::scheduler_TP{k}"))
    a = analyze_paths(files)
    assert [r.rank for r in a.ranks] == [0, 1, 2]
    assert sum("2 more ranks beyond the first 3 not read" in w for w in a.warnings) == 1, a.warnings


def test_ever_new_frames_past_the_bound_are_not_kept_and_said(monkeypatch):
    monkeypatch.setattr(assemble, "MAX_DISTINCT_FRAMES", 100, raising=False)
    text = "".join(f"Process {100 + k}: python job.py\n\nThread {100 + k} (idle): \"MainThread\"\n"
                   + "".join(f"    f{k}_{i} (m.py:{i})\n" for i in range(30)) for k in range(10))
    dumps = parse_dump(text, "new.txt")
    assert len(dumps) == 10
    kept = {id(fr) for d in dumps for t in d.threads for fr in t.frames}
    assert len(kept) == 100, len(kept)
    assert any("200 frame(s) not kept beyond the first 100 distinct frames" in w for w in dumps[-1].warnings)


def test_the_rank_table_fits_its_line_budget_as_the_terminal_wraps_it(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "MAX_TABLE_LINES", 10, raising=False)
    text = SGLANG_RANK1.read_text()
    files = []
    for k in range(8):  # 8 real ranks; a narrow terminal folds each row into several lines: the budget is in lines
        files.append(tmp_path / f"rank{k}.txt")
        files[-1].write_text(text.replace("sglang::scheduler_TP1", f"sglang::scheduler_TP{k}"))
    r = CliRunner().invoke(cli.app, ["analyze", *map(str, files)])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    table = [ln for ln in lines if ln[:1] in "┏┃┡│└"]
    assert 0 < len(table) <= 10, len(table)
    assert "more ranks" in " ".join(r.output.split()), r.output
