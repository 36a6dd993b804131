"""Alignment of collective ledgers on synthetic records: first divergence (missing ranks / mismatch), in-flight
sequences are not a desync, rotation windows, per-tick counts, the reader's tolerance of garbage lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from repro.ledger import (
    GroupInfo, LedgerError, RankLedger, Record, align, check_consistent, load_ledgers, per_tick_counts,
)

CPU = GroupInfo(key="1", ranks=(0, 1), backend="gloo", label="tp/cpu")
DEV = GroupInfo(key="2", ranks=(0, 1), backend="gloo", label="tp/device")
BCAST_SITE = ("sglang.srt.utils.common:broadcast_pyobj", "m:_broadcast_reqs_across_ranks")


def rec(rank, group, seq, op="broadcast", *, red=None, shapes=((1,),), dtypes=("int64",), site=BCAST_SITE, tick=1,
        t=None, open_=False, inj=None) -> Record:
    t0 = t if t is not None else seq * 1.0 + (0.1 if group == "2" else 0.0)
    return Record(rank=rank, group=group, seq=seq, op=op, red=red, shapes=shapes, dtypes=dtypes, site=site, tick=tick,
                  t_enter=t0, t_exit=None if open_ else t0 + 0.01, inj=inj)


def ledger(rank, records, dropped=0) -> RankLedger:
    return RankLedger(rank=rank, pid=100 + rank, groups={"1": CPU, "2": DEV}, records=list(records), dropped=dropped,
                      max_records=100)


def healthy(rank, n=3):
    out = []
    for i in range(1, n + 1):
        out.append(rec(rank, "1", i, tick=i))
        out.append(rec(rank, "2", i, "all_reduce", red="SUM", shapes=((4, 64),), dtypes=("float32",),
                       site=("m:VocabParallelEmbedding.forward",), tick=i))
    return out


def test_identical_ledgers_agree_and_are_consistent():
    leds = {0: ledger(0, healthy(0)), 1: ledger(1, healthy(1))}
    d = align(leds)
    assert d.kind == "none" and "agree" in d.summary
    assert check_consistent(leds) == []


def test_extra_all_reduce_on_rank0_is_the_first_divergence_with_both_call_sites():
    extra = rec(0, "1", 4, "all_reduce", red="MAX", shapes=((1,),), dtypes=("int32",),
                site=("m:UnifiedRadixCache.check_prefetch_progress", "m:Scheduler._get_new_batch_prefill_raw"),
                tick=4, open_=True)
    r1_wait = rec(1, "1", 4, tick=4, open_=True, t=4.5)
    leds = {0: ledger(0, healthy(0) + [extra]), 1: ledger(1, healthy(1) + [r1_wait])}
    d = align(leds)
    assert d.kind == "mismatch" and d.seq == 4 and d.group.label == "tp/cpu"
    assert d.fields == ("op", "red", "dtypes") and d.culprits == ()  # 1 against 1: no majority
    assert d.summary.startswith("TP CPU group #4: rank 0 entered all_reduce(MAX) [(1,)] int32 from "
                                "UnifiedRadixCache.check_prefetch_progress") and "rank 1 entered broadcast" in d.summary


def test_rank_that_never_entered_is_missing_and_its_wait_is_named():
    extra = rec(0, "1", 4, "all_reduce", red="MAX", shapes=((1,),), dtypes=("int32",),
                site=("m:UnifiedRadixCache.check_prefetch_progress", "m:Scheduler._get_new_batch_prefill_raw"),
                tick=4, open_=True, t=10.0)
    r1_wait = rec(1, "2", 4, "all_reduce", red="SUM", shapes=((4, 64),), dtypes=("float32",),
                  site=("m:VocabParallelEmbedding.forward", "m:LlamaModel.forward"), tick=4, open_=True, t=10.1)
    leds = {0: ledger(0, healthy(0) + [extra]), 1: ledger(1, healthy(1) + [r1_wait])}
    d = align(leds)
    assert d.kind == "missing" and d.seq == 4 and d.group.key == "1"
    assert list(d.entered) == [0] and d.missing == (1,)
    assert d.waits[1].group == "2" and d.waits[1].seq == 4
    assert d.summary.startswith("rank 0 entered all_reduce #4 on the TP CPU group from "
                                "UnifiedRadixCache.check_prefetch_progress ← Scheduler._get_new_batch_prefill_raw")
    assert "rank 1 never did and waits in all_reduce #4 on the TP device group from VocabParallelEmbedding.forward" \
        in d.summary


def test_injected_divergence_is_reported_before_a_simultaneous_one():
    inj = rec(0, "1", 4, "all_reduce", red="SUM", shapes=((1,),), dtypes=("int32",), site=("m:Scheduler.run_batch",),
              open_=True, t=10.2, inj="extra")
    r1 = rec(1, "2", 4, "all_reduce", red="SUM", shapes=((4, 64),), dtypes=("float32",), site=("m:Scheduler.run_batch",),
             open_=True, t=10.0)
    d = align({0: ledger(0, healthy(0) + [inj]), 1: ledger(1, healthy(1) + [r1])})
    assert d.kind == "missing" and d.group.key == "1" and 0 in d.entered and "the injected all_reduce" in d.summary


def test_idle_rank_between_ticks_is_in_flight_not_a_divergence():
    # rank 1 already waits in the next request broadcast; rank 0 sleeps in the idle path (no open record)
    leds = {0: ledger(0, healthy(0)), 1: ledger(1, healthy(1) + [rec(1, "1", 4, open_=True)])}
    assert align(leds).kind == "none"


def test_rank_still_in_an_earlier_collective_of_the_group_is_in_flight():
    # rank 0's exit of broadcast #3 is not written yet while rank 1 already entered #4
    r0 = healthy(0)
    r0[-2] = rec(0, "1", 3, tick=3, open_=True)
    leds = {0: ledger(0, r0), 1: ledger(1, healthy(1) + [rec(1, "1", 4, open_=True)])}
    assert align(leds).kind == "none"


def test_reduce_op_mismatch_names_the_culprit_of_three():
    recs = {r: healthy(r) + [rec(r, "3", 1, "all_reduce", red="MIN" if r == 2 else "MAX", shapes=((1,),),
                                 dtypes=("int32",), site=("m:check",))] for r in range(3)}
    leds = {r: ledger(r, v) for r, v in recs.items()}
    for led in leds.values():
        led.groups["3"] = GroupInfo(key="3", ranks=(0, 1, 2), backend="gloo")
    d = align(leds)
    assert d.kind == "mismatch" and d.culprits == (2,) and d.fields == ("red",) and d.group.key == "3"


def test_rotation_window_compares_only_common_sequences():
    r0 = [x for x in healthy(0, 6) if x.seq > 2]  # rank 0 dropped its oldest records
    leds = {0: ledger(0, r0, dropped=4), 1: ledger(1, healthy(1, 6))}
    assert align(leds).kind == "none"
    assert any("dropped" in p for p in check_consistent(leds))


def test_per_tick_counts_by_group_key_or_label():
    leds = {0: ledger(0, healthy(0)), 1: ledger(1, healthy(1))}
    assert per_tick_counts(leds) == {0: {1: 2, 2: 2, 3: 2}, 1: {1: 2, 2: 2, 3: 2}}
    assert per_tick_counts(leds, "tp/cpu") == {0: {1: 1, 2: 1, 3: 1}, 1: {1: 1, 2: 1, 3: 1}}
    assert per_tick_counts(leds, "2")[0] == {1: 1, 2: 1, 3: 1}


def _write(folder: Path, pid: int, rank: int, lines: list, part: str = "") -> None:
    head = {"e": "header", "pid": pid, "rank": rank, "part": 0, "dropped": 0, "max_records": 10, "time": 0}
    grp = {"e": "group", "g": "1", "name": "1", "ranks": [0, 1], "backend": "gloo", "label": "tp/cpu"}
    body = [json.dumps(head), json.dumps(grp)] + [l if isinstance(l, str) else json.dumps(l) for l in lines]
    (folder / f"ledger-{pid}{part}.jsonl").write_text("\n".join(body) + "\n")


def test_reader_skips_garbage_lines_merges_parts_and_keeps_the_newest_process_per_rank(tmp_path: Path):
    enter = lambda seq, t: {"e": "enter", "g": "1", "seq": seq, "op": "broadcast", "api": "x", "red": None,
                            "shapes": [[1]], "dtypes": ["int64"], "site": ["m:f"], "tick": 1, "t": t, "inj": None}
    _write(tmp_path, 10, 0, [enter(1, 1.0), {"e": "exit", "g": "1", "seq": 1, "t": 1.1, "err": None}], ".1")
    _write(tmp_path, 10, 0, [enter(2, 2.0), '{"e": "enter", "g": "1", "se'])  # truncated last line
    _write(tmp_path, 11, 1, [enter(1, 1.0)])
    _write(tmp_path, 12, 1, [enter(1, 5.0), enter(2, 6.0)])  # a restarted server's rank 1: newer
    leds = load_ledgers(tmp_path)
    assert [r.seq for r in leds[0].records] == [1, 2] and leds[0].records[0].t_exit == 1.1
    assert leds[0].records[1].open and any("not JSON" in w for w in leds[0].warnings)
    assert leds[1].pid == 12
    assert load_ledgers(tmp_path, pids=[10, 11])[1].pid == 11


def test_file_without_header_is_not_a_ledger(tmp_path: Path):
    (tmp_path / "ledger-5.jsonl").write_text('{"e": "enter", "g": "1", "seq": 1}\n')
    from repro.ledger import read_ledger_files

    with pytest.raises(LedgerError, match="no header"):
        read_ledger_files([tmp_path / "ledger-5.jsonl"])
    assert load_ledgers(tmp_path) == {}


@pytest.mark.parametrize("rank0", ["missing", "garbage", "records_of_the_wrong_type"])
def test_a_rank_without_a_readable_ledger_is_named_and_the_ledgers_are_never_said_to_agree(tmp_path: Path, rank0):
    """Rank 1's ledger alone cannot stand for the group: the diagnosis names rank 0's ledger (by the pid the run
    recorded, or as a group rank when no pid list is given) and says the ledgers cannot be aligned."""
    from repro.ledger import diagnose

    enter = lambda seq: {"e": "enter", "g": "1", "seq": seq, "op": "broadcast", "api": "x", "red": None,
                         "shapes": [[1]], "dtypes": ["int64"], "site": ["m:f"], "tick": seq, "t": float(seq)}
    _write(tmp_path, 11, 1, [enter(1), enter(2)])
    if rank0 == "garbage":
        (tmp_path / "ledger-10.jsonl").write_bytes(bytes(range(256)) * 8)
    elif rank0 == "records_of_the_wrong_type":  # a header, then lines that are JSON but no record
        _write(tmp_path, 10, 0, ["5", "[1, 2]", '{"e": "enter", "g": "1", "seq": "x"}', json.dumps(enter(1))])
        led = load_ledgers(tmp_path, pids=[10])[0]  # the readable record is kept, the others skipped with a warning
        assert [r.seq for r in led.records] == [1] and len(led.warnings) == 3, led.warnings
        return
    unread: dict = {}
    assert set(load_ledgers(tmp_path, pids=[10, 11], unread=unread)) == {1}
    assert set(unread) == {10}
    no_pids = "pid 10: unreadable" if rank0 == "garbage" else "rank 0: no readable ledger"  # the group names rank 0
    for pids, named in (([10, 11], "pid 10: "), (None, no_pids)):
        d = diagnose(tmp_path, pids)
        assert "agree" not in d.divergence.summary, d.divergence.summary
        assert d.divergence.summary.startswith("The ledgers cannot be aligned") and named in d.divergence.summary
        assert d.to_dict()["unread"] and named in d.to_dict()["unread"][0]


def test_stack_analysis_names_the_injected_site_and_ignores_ledger_wrappers():
    from repro.analysis import analyze
    from repro.stacks import RankCapture, parse_pyspy_text

    text = ("Process 1: sglang::scheduler_TP0\n\nThread 1 (idle): \"MainThread\"\n"
            "    all_reduce (torch/distributed/distributed_c10d.py:3913)\n"
            "    _exception_logger.<locals>.wrapper (torch/distributed/c10d_logger.py:83)\n"
            "    repro_ledger[torch.distributed.all_reduce] (repro_injector/_ledger.py:300)\n"
            "    Site._collective (repro_injector/_runtime.py:245)\n"
            "    Site.run (repro_injector/_runtime.py:265)\n"
            "    repro_injected[Scheduler.run_batch] (repro_injector/_runtime.py:534)\n"
            "    Scheduler.event_loop_normal (scheduler.py:2048)\n"
            "    repro_tick[Scheduler.get_next_batch_to_run] (repro_injector/_ledger.py:250)\n")
    text1 = ("Process 2: sglang::scheduler_TP1\n\nThread 1 (idle): \"MainThread\"\n"
             "    all_reduce (torch/distributed/distributed_c10d.py:3913)\n"
             "    repro_ledger[torch.distributed.all_reduce] (repro_injector/_ledger.py:300)\n"
             "    GroupCoordinator.all_reduce (sglang/srt/distributed/parallel_state.py:700)\n"
             "    repro_ledger[GroupCoordinator.all_reduce] (repro_injector/_ledger.py:400)\n"
             "    VocabParallelEmbedding.forward (sglang/srt/layers/vocab_parallel_embedding.py:480)\n")
    caps = []
    for rank, t in ((0, text), (1, text1)):
        d = parse_pyspy_text(t)[0]
        caps.append(RankCapture(rank=rank, pid=d.pid, label=f"rank{rank}", ok=True, method="file", text=t,
                                threads=d.threads, title=d.title))
    a = analyze(caps)
    r0, r1 = a.ranks
    assert r0.injected and r0.injected_site == "Scheduler.run_batch"
    assert r0.caller_chain[:2] == ["[injected] at Scheduler.run_batch", "Scheduler.event_loop_normal"]
    assert r0.where().startswith("the injected all_reduce at Scheduler.run_batch ← Scheduler.event_loop_normal")
    assert not r1.injected and r1.via == "GroupCoordinator" and r1.caller_chain[0] == "VocabParallelEmbedding.forward"
    assert "rank 0 is in the injected all_reduce at Scheduler.run_batch" in a.summary


def test_timeline_svg_marks_the_divergence_and_is_valid_xml():
    import xml.etree.ElementTree as ET

    from repro.timeline import render_timeline

    extra = rec(0, "1", 4, "all_reduce", red="MAX", shapes=((1,),), dtypes=("int32",), site=("m:check",), open_=True,
                t=10.0, inj="x")
    r1 = rec(1, "2", 4, "all_reduce", red="SUM", shapes=((4, 64),), dtypes=("float32",), site=("m:fwd",), open_=True,
             t=10.1)
    leds = {0: ledger(0, healthy(0) + [extra]), 1: ledger(1, healthy(1) + [r1])}
    d = align(leds)
    svg = render_timeline(leds, d)
    root = ET.fromstring(svg)
    assert root.tag.endswith("svg")
    assert "first divergence: missing at tp/cpu #4" in svg and "never entered tp/cpu #4" in svg
    assert svg.count('stroke="#b30000"') == 2  # rank 0's injected all_reduce and rank 1's wait
    assert "AR*" in svg and "tp/device" in svg


def test_report_diagnosis_section_comes_first_with_the_ledger_sentence_table_and_timeline():
    from repro.ledger import LedgerDiagnosis, check_consistent, per_tick_counts
    from repro.report import diagnosis_lines

    extra = rec(0, "1", 4, "all_reduce", red="MAX", shapes=((1,),), dtypes=("int32",), site=("m:check", "m:loop"),
                open_=True, t=10.0)
    r1 = rec(1, "2", 4, "all_reduce", red="SUM", shapes=((4, 64),), dtypes=("float32",), site=("m:fwd",), open_=True,
             t=10.1)
    leds = {0: ledger(0, healthy(0) + [extra]), 1: ledger(1, healthy(1) + [r1])}
    diag = LedgerDiagnosis(leds, align(leds), per_tick_counts(leds), check_consistent(leds))
    lines = diagnosis_lines(None, diag, "timeline.svg")
    text = "\n".join(lines)
    assert lines[0] == "## Diagnosis"
    assert "**Collective ledger:** rank 0 entered all_reduce #4 on the TP CPU group from check ← loop; rank 1 never " \
           "did and waits in all_reduce #4 on the TP device group from fwd." in text
    assert "| 0 | #4 | all_reduce | MAX | [(1,)] | int32 | check ← loop | 1 | blocked (never left) |" in text
    assert "| 1 | - | - | - | - | - | never entered; waits in all_reduce #4 on tp/device from fwd | - | - |" in text
    assert "![per-rank collective timeline](timeline.svg)" in text
    d = diag.to_dict()
    assert d["divergence"]["kind"] == "missing" and d["records_per_group"]["tp/cpu"] == {"0": 4, "1": 3}


def test_injector_writes_enter_and_exit_lines_as_the_documented_json_records(tmp_path: Path):
    """The pre-encoded lines (``Ledger.enter_line`` and the exit line) parse to exactly the documented records,
    keys in the documented order, whatever was cached from earlier records (same site, other shapes / ops)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "injectors"))
    from repro_injector._ledger import Ledger, _meta

    class T:  # what the writer reads of a tensor: shape and dtype
        def __init__(self, shape, dtype="torch.float16"):
            self.shape, self.dtype = shape, dtype

    class RT:
        out_dir, pid = str(tmp_path), 4242

        def error(self, *a):
            raise AssertionError(a)

    led = Ledger(RT(), {"max_records": 1000})
    site = ("sglang.srt.layers.linear:RowParallelLinear.forward", "sglang.srt.models.llama:LlamaMLP.forward")
    items = [
        ("n", "3", 7, "all_reduce", "GroupCoordinator.all_reduce", "SUM", _meta((T((8, 512)),)), site, 11, 1796143260.0566263,
         None, "MainThread", False, None),
        ("x", "3", 7, 1796143260.07, None),
        ("n", "3", 8, "all_reduce", "GroupCoordinator.all_reduce", "MAX", _meta((T((1,), "torch.int32"),)), site, 12,
         1796143261.5, "extra", "MainThread", False, None),
        ("x", "3", 8, 1796143261.75, 'RuntimeError: gloo "size" mismatch\n'),
        ("n", "4", 1, "broadcast", "torch.distributed.broadcast", None, _meta(([T((2,)), T((2,))],)), site[:1], 12, 1.25,
         None, "prefetch \"thread\"", False, 0),
        ("n", "3", 9, "all_gather", "GroupCoordinator.all_gather", None, _meta((T((8, 512)),)), site, 13, 2.0, None,
         "MainThread", True, None),
        ("n", "3", 10, "all_reduce", "torch.distributed.all_reduce", "MIN", _meta((T((), "torch.int32"),)), site, 14,
         3.0, None, "MainThread", False, None, 7),  # a small CPU tensor's values in and out (_ledger_args)
        ("x", "3", 10, 3.5, None, 5),
    ]
    for it in items:
        led.q.append(it)
    led.drain()
    lines = [json.loads(x) for x in Path(led.path()).read_text().splitlines()]
    assert lines[0]["e"] == "header" and lines[0]["pid"] == 4242
    got = lines[1:]
    base = {"e": "enter", "g": "3", "op": "all_reduce", "api": "GroupCoordinator.all_reduce", "inj": None,
            "thread": "MainThread"}
    want = [
        {**base, "seq": 7, "red": "SUM", "shapes": [[8, 512]], "dtypes": ["float16"], "site": list(site), "tick": 11,
         "t": 1796143260.0566263},
        {"e": "exit", "g": "3", "seq": 7, "t": 1796143260.07, "err": None},
        {**base, "seq": 8, "red": "MAX", "shapes": [[1]], "dtypes": ["int32"], "site": list(site), "tick": 12,
         "t": 1796143261.5, "inj": "extra"},
        {"e": "exit", "g": "3", "seq": 8, "t": 1796143261.75, "err": 'RuntimeError: gloo "size" mismatch\n'},
        {"e": "enter", "g": "4", "seq": 1, "op": "broadcast", "api": "torch.distributed.broadcast", "red": None,
         "shapes": [[2, 2]], "dtypes": ["float16"], "site": list(site[:1]), "tick": 12, "t": 1.25, "inj": None,
         "thread": 'prefetch "thread"', "src": 0},
        {**base, "g": "3", "seq": 9, "op": "all_gather", "api": "GroupCoordinator.all_gather", "red": None,
         "shapes": [[8, 512]], "dtypes": ["float16"], "site": list(site), "tick": 13, "t": 2.0, "bypass": True},
        {**base, "seq": 10, "api": "torch.distributed.all_reduce", "red": "MIN", "shapes": [[]], "dtypes": ["int32"],
         "site": list(site), "tick": 14, "t": 3.0, "in": 7},
        {"e": "exit", "g": "3", "seq": 10, "t": 3.5, "err": None, "out": 5},
    ]
    assert got == want
    order = ["e", "g", "seq", "op", "api", "red", "shapes", "dtypes", "site", "tick", "t", "inj", "thread"]
    assert [list(d)[:13] for d in got if d["e"] == "enter"] == [order] * 5 and list(got[-2])[-1] == "in"
    assert [list(d) for d in got if d["e"] == "exit"] == [["e", "g", "seq", "t", "err"]] * 2 + [["e", "g", "seq", "t", "err", "out"]]
