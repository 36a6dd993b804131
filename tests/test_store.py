"""The store's typed readers/writers (repro.evidence) and the diagnosis types (repro.diagnosis).

Round trips through the named members, clear errors naming the file for truncated / malformed / wrong-shape files,
the one fire-log reader (whole file and tailing), and the enums every report uses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from repro import evidence as ev
from repro.diagnosis import (
    COLLECTIVE_OPS,
    DATA_COLLECTIVES,
    CollectiveDiagnosis,
    CollectiveFamily,
    CrashKind,
    DivergenceKind,
    describe_where,
    md_cell,
    op_abbrev,
    where_of,
)
from repro.injection_records import read_fire_log, read_injector_dir


def _folder(tmp_path: Path) -> ev.EvidenceDir:
    return ev.EvidenceDir(tmp_path, "scen", "v")


def test_members_round_trip_typed_records(tmp_path: Path) -> None:
    evd = _folder(tmp_path)
    assert evd.run.read().status == "running"  # written at creation
    plan = {"version": 1, "arm_file": str(evd.arm.path), "out_dir": str(evd.injector_dir),
            "injections": [{"id": "a"}, {"id": "b"}], "ledger": {"enabled": True}}
    evd.plan.write(plan)
    got = evd.plan.read()
    assert got.injection_ids() == ["a", "b"] and got.arm_file == str(evd.arm.path)
    assert json.loads(evd.plan.path.read_text()) == plan  # the file is exactly what was given (extra fields kept)
    rec = ev.verdict_record({"verdict": "DEADLOCKED", "reason": "r", "notes": ["n"], "exit_code": 3}, exit_code=5,
                            evidence=evd.path, scenario="scen", variant="v", variant_expects="deadlock",
                            expect="success", timings={"burst_s": 1.23456}, rank_pids={1: 11, 0: 10})
    evd.verdict.write(rec)
    back = evd.verdict.read()
    assert back.verdict == "DEADLOCKED" and back.exit_code == 5 and back.pids() == [10, 11]
    assert back.timings == {"burst_s": 1.235} and back.kind == "run" and back.evidence == str(evd.path)
    evd.requests.write([{"i": 0}, {"i": 1}])
    assert evd.requests.read() == [{"i": 0}, {"i": 1}]
    evd.report.write("# x\n")
    assert evd.report.read() == "# x\n" and evd.report.path.name == "REPORT.md"
    opened = ev.EvidenceDir.open(evd.path)
    assert opened.verdict.read() == back and opened.path == evd.path


def test_a_truncated_json_file_is_an_error_naming_the_file(tmp_path: Path) -> None:
    evd = _folder(tmp_path)
    evd.verdict.path.write_text('{"verdict": "DEADLOCKED", "reason": "x')
    with pytest.raises(ev.EvidenceFileError) as e:
        evd.verdict.read()
    assert str(evd.verdict.path) in str(e.value) and "truncated" in str(e.value) and "not valid JSON" in str(e.value)
    assert e.value.path == evd.verdict.path


def test_a_json_file_of_the_wrong_shape_names_the_field(tmp_path: Path) -> None:
    evd = _folder(tmp_path)
    evd.plan.path.write_text(json.dumps({"out_dir": "/x", "injections": []}))
    with pytest.raises(ev.EvidenceFileError, match=r"plan\.json: field arm_file: Field required"):
        evd.plan.read()
    with pytest.raises(ev.EvidenceFileError, match="refusing to write"):
        evd.teardown.write({"left_running": "not a list"})
    assert not evd.teardown.exists()  # nothing written


def test_a_missing_member_is_none_or_an_error_naming_it(tmp_path: Path) -> None:
    evd = _folder(tmp_path)
    assert evd.env.read(missing_ok=True) is None
    with pytest.raises(ev.EvidenceFileError, match=r"env\.json: not found"):
        evd.env.read()
    with pytest.raises(ev.EvidenceFileError, match="does not exist"):
        ev.EvidenceDir.open(tmp_path / "nope")


def test_jsonl_skips_a_torn_last_line_but_not_a_broken_middle_one(tmp_path: Path) -> None:
    evd = _folder(tmp_path)
    evd.requests.path.write_text('{"i": 0}\n{"i": 1}\n{"i": 2')
    assert evd.requests.read() == [{"i": 0}, {"i": 1}]
    evd.requests.path.write_text('{"i": 0}\n{"i"\n{"i": 2}\n')
    with pytest.raises(ev.EvidenceFileError, match=r"requests\.jsonl: line 2 is not JSON"):
        evd.requests.read()


def test_fire_log_reader_whole_file_and_tail(tmp_path: Path) -> None:
    f = tmp_path / ev.Layout.fire_log(42)
    f.write_text('{"event": "armed", "arm_seq": 1, "ids": ["x"], "rank": 0}\n{"event": "seen", "id": "x", "caller": "m:f"}\n'
                 '{"event": "coun')
    events, off = read_fire_log(f)  # tailing: the incomplete last line waits
    assert [e["event"] for e in events] == ["armed", "seen"] and off == len(f.read_bytes()) - len('{"event": "coun')
    with open(f, "a") as fh:
        fh.write('ts", "arm_seq": 1, "counts": {"x": {"entered": 2, "matched": 1, "fired": 1}}}\n')
    more, off2 = read_fire_log(f, off)
    assert [e["event"] for e in more] == ["counts"] and off2 == len(f.read_bytes())
    assert read_fire_log(tmp_path / "absent.jsonl", 7) == ([], 7)
    rep = read_injector_dir(tmp_path)  # the typed report: counts and seen events, read once
    assert rep.counts_by_rank("x")["fired"] == {0: 1}
    assert [e["caller"] for e in rep.seen()] == ["m:f"] and rep.seen()[0]["rank"] == 0


def test_layout_names_files_once() -> None:
    assert ev.Layout.pid_of(ev.Layout.fire_log(7)) == 7 and ev.Layout.pid_of(ev.Layout.ledger_file(9, 1)) == 9
    assert ev.Layout.pid_of("REPORT.md") is None
    assert ev.Layout.LEDGER_FILE_RE.match(ev.Layout.ledger_file(3)) and ev.Layout.stack_name(1, "-2") == "rank1-2.txt"


def test_diagnosis_enums_read_and_write_as_their_words() -> None:
    assert DivergenceKind.MISSING == "missing" and DivergenceKind("mismatch") is DivergenceKind.MISMATCH
    assert f"{DivergenceKind.NONE}" == "none" and json.dumps({"k": DivergenceKind.MISSING}) == '{"k": "missing"}'
    assert CollectiveFamily("scheduling/cache") is CollectiveFamily.SCHEDULING and str(CollectiveFamily.FORWARD) == "model forward"
    d = CollectiveDiagnosis(CollectiveFamily.FORWARD, f"{CrashKind.GLOO_SIZE_MISMATCH} in all_reduce",
                            crash=CrashKind.GLOO_SIZE_MISMATCH)
    assert d.is_desync_crash and not CollectiveDiagnosis(CollectiveFamily.UNCLEAR, "no stacks").is_desync_crash
    with pytest.raises(ValueError):
        DivergenceKind("sideways")


def test_one_op_table_and_formatters() -> None:
    assert {"all_reduce", "broadcast_object_list", "wait", "send"} <= COLLECTIVE_OPS
    assert "wait" not in DATA_COLLECTIVES and "send" not in DATA_COLLECTIVES and "all_reduce" in DATA_COLLECTIVES
    assert op_abbrev("all_reduce") == "AR" and op_abbrev("frobnicate") == "frob"
    chain = ["[injected Scheduler.run_batch]", "Scheduler.run_batch", "Scheduler.event_loop_normal", "main"]
    assert describe_where("collective", op="all_reduce", via="GroupCoordinator", caller_chain=chain[1:]) == \
        "all_reduce via GroupCoordinator ← Scheduler.run_batch ← Scheduler.event_loop_normal ← main"
    assert describe_where("collective", op="all_reduce", caller_chain=chain, injected_site="Scheduler.run_batch") == \
        "the injected all_reduce at Scheduler.run_batch ← Scheduler.run_batch ← Scheduler.event_loop_normal"
    assert where_of({"state": "idle-wait", "wait": "zmq poll", "caller_chain": ["recv"]}) == "idle (zmq poll) ← recv"
    assert where_of({"state": "unknown", "error": "no dump"}) == "unknown (no dump)"
    assert md_cell("a|b\nc") == "a\\|b c"


def test_the_injectors_own_op_list_is_named_in_the_one_table() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "injectors"))
    try:
        from repro_injector import _ledger
    finally:
        sys.path.pop(0)
    assert set(_ledger.TORCH_OPS) <= COLLECTIVE_OPS


@pytest.mark.parametrize("scenario", [".", "..", "..."])
def test_an_evidence_folder_named_by_dots_stays_under_the_root(tmp_path: Path, scenario: str) -> None:
    """The store's own guard (a hunt-merge shard's folder ``x/..`` gives the scenario name ``..``): the run folder
    and its ``latest`` link are made inside the evidence root, never in its parent."""
    root = tmp_path / "root"
    evd = ev.EvidenceDir(root, scenario, "..")
    assert evd.path.resolve().parent.parent == root.resolve()
    assert not (tmp_path / "latest").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["root"]
    cmp = ev.unique_folder(root, "..", "compare", "x")
    assert cmp.resolve().parent.parent == root.resolve()
