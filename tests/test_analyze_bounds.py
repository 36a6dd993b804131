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
