"""The store owns the evidence layout: the injector's own file names agree with it, and no module of ``repro/``
outside the store spells an evidence file's name (docstrings aside) — they go through ``repro.evidence``'s named
members (``EvidenceDir.verdict``, ``Layout.fire_log(pid)``, …)."""

from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

from repro import evidence as ev

ROOT = Path(__file__).resolve().parent.parent
STORE = {ROOT / "repro" / "evidence.py"}
# A member's name that also names something else in one module: (module, name) -> what it is there.
OTHER_MEANING = {("repro/resources.py", "scenarios"): "the repository's data folder scenarios/, not a hunt folder's"}


def _injector_files():
    sys.path.insert(0, str(ROOT / "injectors"))
    try:
        from repro_injector import files
    finally:
        sys.path.pop(0)
    return files


def test_the_injectors_file_names_are_the_stores() -> None:
    files = _injector_files()
    L = ev.Layout
    for pid in (7, 123456):
        assert files.loaded_marker(pid) == L.loaded_marker(pid)
        assert files.fire_log(pid) == L.fire_log(pid)
        assert files.faulthandler_file(pid) == L.faulthandler_file(pid)
        assert files.ticks_file(pid) == L.ticks_file(pid)
        assert files.mp_names_file(pid) == L.mp_names_file(pid)
        for part in (0, 1):
            assert files.ledger_file(pid, part) == L.ledger_file(pid, part)
            assert files.digest_file(pid, part) == L.digest_file(pid, part)
            assert L.LEDGER_FILE_RE.match(files.ledger_file(pid, part)).group(1) == str(pid)
            assert L.DIGEST_FILE_RE.match(files.digest_file(pid, part)).group(1) == str(pid)
        for name in (files.loaded_marker(pid), files.fire_log(pid), files.ledger_file(pid), files.ledger_file(pid, 1),
                     files.faulthandler_file(pid)):
            assert L.pid_of(name) == pid, name
        assert Path(files.loaded_marker(pid)).match(L.LOADED_GLOB) and Path(files.fire_log(pid)).match(L.FIRES_GLOB)
        assert Path(files.faulthandler_file(pid)).match(L.FAULTHANDLER_GLOB)
    assert files.ERRORS_LOG == L.INJECTOR_ERRORS


@functools.lru_cache(maxsize=1)
def _names() -> tuple[list[str], list[str], list[str]]:
    """(file member names, folder member names, the stems of the per-process files: ``fires-`` …)."""
    members = [m for m in vars(ev.Layout).values() if isinstance(m, ev.Member)]
    files = _injector_files()
    stems = sorted({re.sub(r"\d+.*$", "", f(42)) for f in (files.loaded_marker, files.fire_log, files.ledger_file,
                                                            files.digest_file, files.faulthandler_file, files.ticks_file,
                                                            files.mp_names_file)})
    named = [m.name for m in members if m.kind != "dir"] + [files.ERRORS_LOG]
    for fn in (ev.Layout.workload_finding, ev.Layout.workload_scenario):
        stems.append(fn("\0").split("\0")[0])
    return named, [m.name for m in members if m.kind == "dir"], stems


def _docstring_ids(tree: ast.AST) -> set[int]:
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body:
            b = n.body[0]
            if isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str):
                out.add(id(b.value))
    return out


def _path_operands(tree: ast.AST) -> set[int]:
    """Constants used to build a path: an operand of ``/`` or an argument of ``joinpath`` / ``os.path.join`` /
    ``EvidenceDir.file``."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div):
            out |= {id(x) for x in (n.left, n.right) if isinstance(x, ast.Constant)}
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("joinpath", "join", "file"):
            out |= {id(x) for x in n.args if isinstance(x, ast.Constant)}
    return out


@functools.lru_cache(maxsize=1)
def _patterns() -> tuple[list[str], list[re.Pattern]]:
    """(folder member names, one pattern per file name and per per-process stem)."""
    named, dirs, stems = _names()
    pats = [re.compile(rf"(?<![\w-]){re.escape(n)}(?![\w])") for n in named]
    pats += [re.compile(rf"(?<![\w-]){re.escape(s)}(?=$|[{{<*(\\\d])") for s in stems]
    return dirs, pats


def store_names_in(path: Path, rel: str) -> list[str]:
    """Every non-docstring string constant of ``path`` that spells an evidence file's name."""
    dirs, pats = _patterns()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs, path_ops = _docstring_ids(tree), _path_operands(tree)
    hits = []
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Constant) and isinstance(n.value, str)) or id(n) in docs:
            continue
        s = n.value
        found = [p.pattern for p in pats if p.search(s)]
        for d in dirs:
            if (rel, d) in OTHER_MEANING:
                continue
            if (s == d and id(n) in path_ops) or re.search(rf"(^|/){re.escape(d)}/|/{re.escape(d)}$", s):
                found.append(d)
        if found:
            hits.append(f"{rel}:{n.lineno}: {s[:70]!r}")
    return hits


def test_no_module_outside_the_store_names_an_evidence_file() -> None:
    hits = []
    for p in sorted((ROOT / "repro").rglob("*.py")):
        if p in STORE or "store" in p.relative_to(ROOT).parts:
            continue
        hits += store_names_in(p, str(p.relative_to(ROOT)))
    assert not hits, ("evidence file names spelled outside the store (use repro.evidence's members):\n  "
                      + "\n  ".join(hits))


def test_the_check_finds_a_spelled_name(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text('"""Docstrings may say verdict.json and fires-<pid>.jsonl."""\n'
                 'a = "verdict.json"\nb = f"fires-{1}.jsonl"\nc = base / "injector"\nd = "--ledger-dir"\n'
                 'e = "ledger-proof"\ng = {"injector": 1}\nh = f"{x}/REPORT.md)"\n')
    got = store_names_in(f, "m.py")
    assert [h.split(":")[1] for h in got] == ["2", "3", "4", "8"], got
