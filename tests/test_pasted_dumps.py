"""Every case of tests/fixtures/pasted/ (one per dump format and failure class) gets its expected answer.

Each case folder holds the pasted input files and ``expected.json`` (its ``origin`` says which tool produced it,
or that it was written by hand because no tool here can). The keys checked, where present: ranks, formats read,
diverged, odd ranks, busy ranks, per-rank (state, op), backend, group kind, how the rank was known, notes and
errors that must be said, warnings that must be given, what must be reported missing, and the processes that must be skipped (with a reason).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from repro.analysis import analyze_paths

PASTED = Path(__file__).resolve().parent / "fixtures" / "pasted"
CASES = sorted(p.name for p in PASTED.iterdir() if (p / "expected.json").is_file())


def test_the_corpus_covers_every_format():
    fmts = set()
    for c in CASES:
        fmts |= set(json.loads((PASTED / c / "expected.json").read_text()).get("formats", []))
    assert fmts >= {"py-spy", "py-spy-json", "faulthandler", "pystack", "gdb", "traceback", "flight-recorder",
                    "condensed", "arrow-chain", "ray-stack"}


@pytest.mark.parametrize("case", CASES)
def test_pasted_case_gets_its_expected_answer(case):
    exp = json.loads((PASTED / case / "expected.json").read_text())
    files = sorted(p for p in (PASTED / case).iterdir() if p.name != "expected.json")
    a = analyze_paths(files)
    by = {r.rank: r for r in a.ranks}
    ctx = f"{case}: {a.summary} | " + " | ".join(a.input_lines()) + " | " + " | ".join(a.warnings[:5])
    if "ranks" in exp:
        assert [r.rank for r in a.ranks] == exp["ranks"], ctx
    if "formats" in exp:
        assert sorted(a.formats) == sorted(exp["formats"]), ctx
    if "diverged" in exp:
        assert a.diverged is exp["diverged"], ctx
    if "odd_ranks" in exp:
        assert a.odd_ranks == exp["odd_ranks"], ctx
    if "busy_ranks" in exp:
        assert a.busy_ranks == exp["busy_ranks"], ctx
    for k, (state, op) in exp.get("states", {}).items():
        r = by[int(k)]
        assert (r.state, r.op) == (state, op) or (op is None and r.state == state), (k, r.state, r.op, ctx)
    for k, v in exp.get("backend", {}).items():
        assert by[int(k)].backend == v, (k, by[int(k)].backend, ctx)
    for k, v in exp.get("group_kind", {}).items():
        assert by[int(k)].group_kind == v, (k, ctx)
    for k, v in exp.get("rank_source", {}).items():
        assert v in by[int(k)].rank_source, (k, by[int(k)].rank_source, ctx)
    for k, v in exp.get("notes_contain", {}).items():
        assert any(v in n for n in by[int(k)].notes), (k, by[int(k)].notes, ctx)
    for k, v in exp.get("error_contain", {}).items():
        assert v in by[int(k)].error, (k, by[int(k)].error, ctx)
    for v in exp.get("warnings_contain", []):
        assert any(v in w for w in a.warnings), (v, a.warnings, ctx)
    for v in exp.get("missing_contain", []):
        assert any(v in m for m in a.missing), (a.missing, ctx)
    for title in exp.get("skipped", []):
        hits = [i for i in a.inputs if not i["kept"] and title in (i.get("title") or "")]
        assert hits and all(i["reason"] for i in hits), (title, a.inputs, ctx)
    assert a.confidence in ("high", "medium", "low")
    # the same in --json
    data = json.loads(a.to_json())
    assert data["inputs"] == a.inputs and data["confidence"] == a.confidence and data["missing"] == a.missing


def test_binary_and_junk_files_are_bad_input_without_echoing_bytes(tmp_path):
    from typer.testing import CliRunner

    from repro.cli import EXIT_USAGE, app

    b = tmp_path / "core.bin"
    b.write_bytes(bytes(range(256)) * 64)
    j = tmp_path / "junk.txt"
    j.write_text("lorem ipsum dolor\n sit amet consectetur\n" * 2000)
    runner = CliRunner()
    for f in (b, j):
        res = runner.invoke(app, ["analyze", str(f)])
        assert res.exit_code == EXIT_USAGE, res.output
        assert "\x00" not in res.output and "\x01" not in res.output
    assert "binary file" in " ".join(runner.invoke(app, ["analyze", str(b)]).output.split())


def test_text_output_says_what_was_read_and_how_sure(tmp_path):
    """The plain-text `repro analyze` prints the formats read, every kept/skipped process and the confidence, and
    a file with no stack in it is one error line (no empty table)."""
    from typer.testing import CliRunner

    from repro.cli import EXIT_USAGE, app

    runner = CliRunner()
    res = runner.invoke(app, ["analyze", str(Path(__file__).parent / "fixtures" / "pasted" / "pyspy_text_gloo3")])
    assert res.exit_code == 0, res.output
    assert "read as: py-spy text" in res.output and "confidence:" in res.output and "kept rank0.txt" in res.output
    j = tmp_path / "junk.txt"
    j.write_text("lorem ipsum dolor\n" * 100)
    res = runner.invoke(app, ["analyze", str(j)])
    assert res.exit_code == EXIT_USAGE
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert lines[0].startswith("error: no rank's stack could be read") and "┃" not in res.output


def test_the_corpus_covers_every_failure_class_of_the_issue():
    """Each failure class the readers are built for has a case (1 formats not read, 2 py-spy's thread status, 3 the
    wrong thread standing for the rank, 4 processes dropped or merged, 5 collectives known by path only), and so do
    the pasting shapes (quoting, prefixes) and honest output on dumps that cannot be read."""
    classes = " / ".join(json.loads((PASTED / c / "expected.json").read_text()).get("class", "") for c in CASES)
    for needle in ("1 formats", "1 prefixes", "1 quoting", "2 ", "3 ", "4 ", "5 ", "honest output"):
        assert needle in classes, needle


def test_junk_binary_and_an_empty_folder_each_get_one_line(tmp_path):
    """Bad input is one line each (exit 2), with no raw bytes of a binary file echoed."""
    from typer.testing import CliRunner

    from repro.cli import EXIT_USAGE, app

    junk = tmp_path / "junk.txt"
    junk.write_text("".join(f"lorem ipsum {i} dolor, sit amet!\n" for i in range(20000)))
    binary = tmp_path / "core.bin"
    binary.write_bytes(bytes(range(256)) * 256)
    empty = tmp_path / "empty"
    empty.mkdir()
    runner = CliRunner()
    for p in (junk, binary, empty):
        res = runner.invoke(app, ["analyze", str(p)])
        lines = [ln for ln in res.output.splitlines() if ln.strip()]
        assert res.exit_code == EXIT_USAGE and len(lines) == 1, (p.name, res.output)
        assert lines[0].startswith("error:") and "\x00" not in res.output and "\\x0" not in res.output
