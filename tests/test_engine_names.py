"""The engine seam holds (issue 30): no harness module outside ``repro/targets/`` names the default engine in code.

Checked with ``ast`` over every module of ``repro/`` outside ``repro/targets/``: string literals (f-string parts
included) that are not docstrings, and every identifier (names, attributes, definitions, arguments, keywords,
imports). What counts as naming the engine is read from the default adapter's own data, not typed here: its name and
package (any case; this covers its module paths, ``sglang.srt…``), its process-title patterns
(``sglang::scheduler``), and the classes its data names (site alternatives of its release files, coordinator
classes, tick functions: ``Scheduler``, ``GroupCoordinator``, ``HiRadixCache``…, as whole words). The one exception
is the ``repro.testbed`` shim, which exists to import SGLang's testbed module under its old name.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from repro.targets.registry import DEFAULT_ADAPTER, get_adapter
from test_store_names import _docstring_ids  # the one docstring rule of the harness's ast checks

REPO = Path(__file__).resolve().parent.parent
HARNESS = REPO / "repro"
ALLOWED = {"repro/testbed.py"}  # the shim: `repro.testbed` is `repro.targets.<default engine>.testbed`


def _forbidden() -> tuple[list[str], re.Pattern]:
    """(case-insensitive substrings, whole-word class names) that name the default engine."""
    a = get_adapter(DEFAULT_ADAPTER)
    subs = {a.name, a.ref_location.package, a.watch_defaults.title_match, a.title_namespace}
    sites = [s for rf in a.release_data().releases.values() for alts in rf.sites.values() for s in alts]
    sites += [*a.injector_profile.coordinators, a.tick_function]
    classes = {s.split(":", 1)[1].split(".")[0] for s in sites if ":" in s and "." in s.split(":", 1)[1]}
    classes |= {s.split(":", 1)[1] for s in a.injector_profile.coordinators}
    assert {"Scheduler", "GroupCoordinator", "HiRadixCache", "UnifiedRadixCache"} <= classes  # the data says them
    return sorted(x.lower() for x in subs if x), re.compile(r"\b(" + "|".join(sorted(map(re.escape, classes))) + r")\b")


def _words(tree: ast.AST):
    """(line, text) of every non-docstring string literal and every identifier of ``tree``."""
    docs = _docstring_ids(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node.lineno, node.value
        elif isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.lineno, node.name
        elif isinstance(node, ast.arg):
            yield node.lineno, node.arg
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.value.lineno, node.arg
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, node.module or ""
            for al in node.names:
                yield node.lineno, al.name
        elif isinstance(node, ast.Import):
            for al in node.names:
                yield node.lineno, al.name


def engine_names_in(path: Path, subs: list[str], classes: re.Pattern) -> list[str]:
    """``file:line: text`` of every place ``path`` names the default engine in code."""
    rel = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name
    hits = []
    for line, text in _words(ast.parse(path.read_text(encoding="utf-8"))):
        low = text.lower()
        if any(s in low for s in subs) or classes.search(text):
            hits.append(f"{rel}:{line}: {text[:100]!r}")
    return hits


def test_no_harness_module_outside_targets_names_the_default_engine():
    subs, classes = _forbidden()
    files = [p for p in sorted(HARNESS.rglob("*.py")) if "targets" not in p.relative_to(HARNESS).parts[:1]
             and p.relative_to(REPO).as_posix() not in ALLOWED]
    assert len(files) > 50
    hits = [h for p in files for h in engine_names_in(p, subs, classes)]
    assert hits == [], "engine-specific names belong in repro/targets/ (an adapter, its data):\n" + "\n".join(hits)


def test_the_check_sees_strings_names_and_imports_but_not_docstrings(tmp_path):
    subs, classes = _forbidden()
    f = tmp_path / "probe.py"
    f.write_text('"""sglang::scheduler in a docstring is fine."""\nimport sglang.srt\nx = "sglang::scheduler_TP0"\n'
                 'def f(hiradix):\n    """GroupCoordinator."""\n    return HiRadixCache, f"{x} GroupCoordinator"\n')
    hits = engine_names_in(f, subs, classes)
    assert [h.split(": ", 1)[0].rsplit(":", 1)[1] for h in hits] == ["2", "3", "6", "6"], hits
