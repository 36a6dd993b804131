"""The engine's own dumps in ``repro analyze``: SGLang's soft-watchdog blocks, its consensus checker and its idle
leak error, read as per-rank records and compared across ranks with no Python stack (issue 33 item 3).

The real blocks (two ranks of the CPU testbed, sglang 0.5.23) are ``tests/fixtures/engine_dumps/``; the other
cases are written here line for line as sglang 0.5.23 prints them (``invariant_checker.py``, ``watchdog.py``,
``rank_consensus_checker.py``), for shapes the testbed cannot make (SWA / mamba pools, the checker's exit).
"""

from __future__ import annotations

import json
from pathlib import Path

from repro.engine_dumps import compare_records, read_engine_dumps
from repro.readers.engine_records import read_engine_records
from repro.targets.registry import engine_dump_rules_all

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "engine_dumps" / "sglang-0.5.23-soft-watchdog"


def _block(tp: int, available: int, rids=("a1", "b2"), t="03:21:00") -> list[str]:
    reqs = ", ".join(f"Req(rid={r}, input_ids=[1, 2], output_ids=[], self.grammar=None, "
                     "self.sampling_params=SamplingParams(max_new_tokens=8))" for r in rids)
    return [f"[2026-12-04 {t} TP{tp}] Scheduler debug info:",
            f"scheduler.cur_batch_for_debug.batch_size()={len(rids)}",
            f"scheduler.cur_batch_for_debug.reqs=[{reqs}]",
            f"[full] total=4096, available={available}, evictable=0, protected=0, session_held=0, uncached=32"]


def _read(lines):
    return compare_records(read_engine_records(lines, engine_dump_rules_all(), source="server.log").records)


def test_two_ranks_blocks_alternating_with_other_log_lines_compare_by_rank():
    lines = ["[2026-12-04 03:20:59 TP0] Prefill batch, #new-seq: 2"]
    lines += _block(0, 4048) + ["[2026-12-04 03:21:00] INFO:     127.0.0.1:1 - \"GET /health HTTP/1.1\" 503"]
    lines += _block(1, 4064) + ["[2026-12-04 03:21:00 TP1] Scheduler watchdog timeout (self.watchdog_timeout=4.0, self.soft=True)"]
    lines += _block(0, 4048, t="03:21:04") + _block(1, 4064, t="03:21:04")
    rep = _read(lines)
    assert list(rep.last_blocks) == ["TP0", "TP1"] and rep.blocks_per_rank == {"TP0": 2, "TP1": 2}
    assert [d.figure for d in rep.diffs] == ["[full] available"]
    assert rep.diffs[0].values == {"TP0": "4048", "TP1": "4064"}
    assert rep.last_blocks["TP0"].figures["batch_size()"] == "2" and rep.last_blocks["TP1"].members["reqs"] == ("a1", "b2")
    assert "`[full] available` TP0 = 4048, TP1 = 4064" in rep.summary


def test_a_request_only_one_rank_holds_is_named_with_the_counts():
    rep = _read(_block(0, 4064, rids=("a1",)) + _block(1, 4064, rids=("a1", "b2")))
    by = {d.figure: d for d in rep.diffs}
    assert by["reqs (count)"].values == {"TP0": "1", "TP1": "2"} and by["reqs (count)"].only == {"TP1": ["b2"]}
    assert by["batch_size()"].values == {"TP0": "1", "TP1": "2"}
    assert "TP1 alone holds b2" in rep.summary


def test_equal_blocks_say_every_figure_equal():
    rep = _read(_block(0, 4064) + _block(1, 4064))
    assert not rep.diverged and "every figure equal across ranks (8 compared)" in rep.summary


def test_swa_and_mamba_lines_are_figures_of_their_pool():
    lines = _block(0, 100) + ["[swa] unified ring (leak-check skipped): available=10, evictable=2, total=64",
                              "[mamba] total=32, available=5, evictable=0, protected=0, session_held=0, uncached=0"]
    lines += _block(1, 100) + ["[swa] unified ring (leak-check skipped): available=12, evictable=2, total=64",
                               "[mamba] total=32, available=5, evictable=0, protected=0, session_held=0, uncached=0"]
    rep = _read(lines)
    assert {d.figure: d.values for d in rep.diffs} == {"[swa] available": {"TP0": "10", "TP1": "12"}}
    assert rep.last_blocks["TP1"].figures["[mamba] total"] == "32"


def test_consensus_checker_and_idle_leak_lines_are_named_as_such():
    lines = ["[2026-12-04 03:21:02 TP0] Found rank divergence for 3 events(s)! local hash: 0a1b2c3d4e5f60718293, "
             "events = ['UnifiedRadixCache.match_prefix(...)']",
             "[2026-12-04 03:21:02 TP1] Found rank divergence for 3 events(s)! local hash: ffeeddccbbaa99887766, "
             "events = ['UnifiedRadixCache.match_prefix(...)']",
             "[2026-12-04 03:21:05 TP0] Scheduler hit an exception: Traceback (most recent call last):",
             "ValueError: req_to_token_pool memory leak detected!available_size=7, session_held=0, total_size=8"]
    rep = _read(lines)
    kinds = [(e.kind, e.rank_label) for e in rep.events]
    assert kinds == [("consensus_divergence", "TP0"), ("consensus_divergence", "TP1"), ("memory_leak", "")]
    assert rep.events[2].figures["[req_to_token_pool] available_size"] == "7"
    assert "rank consensus checker: Found rank divergence on TP0, TP1 (local hashes TP0 = 0a1b2c3d4e5f, TP1 = " \
           "ffeeddccbbaa)" in rep.summary
    assert "sglang idle memory leak check: memory leak detected" in rep.summary and "req_to_token_pool" in rep.summary


def test_a_log_without_engine_dumps_reads_as_none(tmp_path):
    p = tmp_path / "server.log"
    p.write_text("[2026-12-04 03:20:16] INFO:     Started server process [9247]\nhello\n")
    assert read_engine_dumps([p]) is None


def test_analyze_names_the_differing_pool_figure_of_the_real_soft_watchdog_blocks():
    """The committed real fixture: two ranks' soft-watchdog blocks, rank 0 with 16 KV token slots taken."""
    from typer.testing import CliRunner

    from repro.cli import app

    log = FIXTURE / "server.log"
    r = CliRunner().invoke(app, ["analyze", str(log), "--json"])
    assert r.exit_code == 0, r.output[-3000:]
    d = json.loads(r.stdout)["engine_dumps"]
    assert set(d["last_blocks"]) == {"TP0", "TP1"}, d["summary"]
    assert all(n >= 1 for n in d["blocks_per_rank"].values())
    diffs = {x["figure"]: x["values"] for x in d["differing_figures"]}
    avail = diffs["[full] available"]
    assert int(avail["TP1"]) - int(avail["TP0"]) == 16, d["summary"]
    assert f"`[full] available` TP0 = {avail['TP0']}, TP1 = {avail['TP1']}" in d["summary"]
    # the rest of each block is equal (same batch, same request), and the text output names the figure too
    assert list(diffs) == ["[full] available"], d["summary"]
    assert d["last_blocks"]["TP0"]["members"]["reqs"] == d["last_blocks"]["TP1"]["members"]["reqs"]
    r2 = CliRunner().invoke(app, ["analyze", str(log)], env={"COLUMNS": "200"})
    assert r2.exit_code == 0 and "[full] available" in r2.stdout and avail["TP0"] in r2.stdout, r2.output[-2000:]
