"""A cheap check, before any server is launched, that every injection has a site that can exist (issue 29 item 3).

``repro sites`` (:func:`repro.sites.check_sites`) imports each site's module in the target interpreter: exact, but
importing sglang's scheduler takes ~15 s on 2 cores, too slow to add to every launch. This check only asks the
target interpreter for its ``sys.path`` (no engine import, ~50 ms), finds each site's module file there and reads
its source with the injector's own AST index (``injectors/repro_injector/resolve.py``, ``_static_index``). An
injection is refused only when **every** alternative site is definitely absent: the module file does not exist
under a package that does, or the file defines neither the class nor the function (nor imports the name), or the
class has no bases and defines no such attribute. Anything it cannot decide (a compiled module, an inherited
method, a namespace package) passes, and the launch-time check (``Session.start``) still decides it with the
server's own imports. Used by :func:`repro.runner.prepare`, so run, demo, serve, compare, hunt and reproduce refuse
a missing site in about a second, before the evidence folder and the server exist.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional, Sequence

from repro import resources


@lru_cache(maxsize=1)
def _resolve_module() -> Any:
    """The injector's ``repro_injector.resolve`` (stdlib only), loaded from this install's injectors folder."""
    path = Path(resources.injectors_dir()) / "repro_injector" / "resolve.py"
    spec = importlib.util.spec_from_file_location("_repro_precheck_resolve", path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


@lru_cache(maxsize=8)
def _sys_path(python: str) -> tuple[str, ...]:
    """``sys.path`` of ``python`` (empty on any failure: the check then decides nothing)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "REPRO_PLAN")}
    try:
        r = subprocess.run([python, "-c", "import json, sys; print(json.dumps(sys.path))"], env=env,
                           capture_output=True, text=True, timeout=30)
        return tuple(p for p in json.loads(r.stdout) if p) if r.returncode == 0 else ()
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return ()


def _module_file(dirs: Sequence[str], modname: str) -> tuple[Optional[str], bool]:
    """(source file of ``modname`` or None, whether it is definitely absent): absent only when its parent package's
    folder exists somewhere on the path and holds no module of that name in any form."""
    parts = modname.split(".")
    parent_seen = False
    for d in dirs:
        base = Path(d, *parts[:-1])
        if not base.is_dir():
            continue
        parent_seen = parent_seen or len(parts) > 1
        f = base / (parts[-1] + ".py")
        if f.is_file():
            return str(f), False
        pkg = base / parts[-1] / "__init__.py"
        if pkg.is_file():
            return str(pkg), False
        if (base / parts[-1]).is_dir() or any(base.glob(parts[-1] + ".*.so")) or any(base.glob(parts[-1] + ".*.pyd")):
            return None, False  # a namespace package or a compiled module: not decided here
    return None, parent_seen


@dataclass
class _Index:
    """What one source file defines: class -> own member names, class -> base expressions, top-level names, name ->
    (module, attribute) it is imported from, and whether it star-imports (then any name may exist)."""

    classes: dict = field(default_factory=dict)
    bases: dict = field(default_factory=dict)
    top: set = field(default_factory=set)
    imports: dict = field(default_factory=dict)
    star: bool = False


@lru_cache(maxsize=256)
def _index(path: str, modname: str) -> Optional[_Index]:
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"), filename=path)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    ix = _Index()
    pkg = modname if path.endswith("__init__.py") else modname.rpartition(".")[0]

    def visit_class(node: ast.ClassDef, prefix: str) -> None:
        q = prefix + node.name
        members: list = []
        for b in node.body:
            if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                members.append(b.name)
                if isinstance(b, ast.ClassDef):
                    visit_class(b, q + ".")
            elif isinstance(b, (ast.Assign, ast.AnnAssign)):
                targets = b.targets if isinstance(b, ast.Assign) else [b.target]
                members.extend(t.id for t in targets if isinstance(t, ast.Name))
        ix.classes[q] = members
        ix.bases[q] = [ast.unparse(x) for x in node.bases if ast.unparse(x) != "object"]

    def handle(node: ast.AST) -> None:
        if isinstance(node, ast.ClassDef):
            ix.top.add(node.name)
            visit_class(node, "")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            ix.top.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    ix.top.add(t.id)
                elif isinstance(t, (ast.Tuple, ast.List)):
                    ix.top.update(e.id for e in t.elts if isinstance(e, ast.Name))
        elif isinstance(node, ast.Import):
            ix.top.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            src = node.module or ""
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)] if pkg else []
                src = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:
                if a.name == "*":
                    ix.star = True
                else:
                    ix.top.add(a.asname or a.name)
                    ix.imports.setdefault(a.asname or a.name, (src, a.name))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):  # optional imports, version switches: every branch
            for part in ("body", "orelse", "finalbody"):
                for sub in getattr(node, part, []) or []:
                    handle(sub)
            for h in getattr(node, "handlers", []) or []:
                for sub in h.body:
                    handle(sub)
        elif isinstance(node, (ast.Expr, ast.Pass)):
            pass
        else:  # anything else that could bind names at import time (globals().update, exec, a for loop)
            ix.star = True

    for node in tree.body:
        handle(node)
    return ix


def _has_member(dirs: Sequence[str], modname: str, cls: str, name: str, depth: int = 0) -> Optional[bool]:
    """Does class ``cls`` of ``modname`` define or inherit ``name``? None when this check cannot tell."""
    if depth > 6:
        return None
    path, absent = _module_file(dirs, modname)
    if path is None:
        return False if absent else None
    ix = _index(path, modname)
    if ix is None:
        return None
    if cls not in ix.classes:
        if "." not in cls and cls in ix.imports:  # re-exported from elsewhere
            mod, attr = ix.imports[cls]
            return _has_member(dirs, mod, attr, name, depth + 1)
        return None
    if name in ix.classes[cls]:
        return True
    verdicts = []
    for b in ix.bases.get(cls, []):
        head = b.split("[", 1)[0]
        if head in ("Generic", "Protocol", "ABC", "typing.Generic", "abc.ABC"):
            continue
        if head in ix.classes:
            verdicts.append(_has_member(dirs, modname, head, name, depth + 1))
        elif head in ix.imports:
            mod, attr = ix.imports[head]
            verdicts.append(_has_member(dirs, mod, attr, name, depth + 1))
        else:
            return None  # a base this check cannot follow (an attribute path, a call, a builtin)
    if any(v is True for v in verdicts):
        return True
    return None if any(v is None for v in verdicts) else False


def site_absent(python: str, site: str) -> Optional[str]:
    """Why ``site`` (``module:Qual.name``) cannot exist in ``python``'s installation, or None when it may exist (or
    this check cannot tell). Never raises."""
    res = _resolve_module()
    if any(c in site for c in "*?[") or ":" not in site:
        return None  # a pattern or a module-less name: the launch-time check decides
    try:
        modname, parts = res.split_site(site)
    except ValueError:
        return None  # malformed: the scenario loader / launch-time check words that error
    dirs = _sys_path(str(python))
    if not dirs:
        return None
    try:
        path, absent = _module_file(dirs, modname)
        if absent:
            return f"module {modname} does not exist in this installation"
        ix = _index(path, modname) if path else None
        if ix is None:
            return None
        qual = ".".join(parts)
        owner, name = ".".join(parts[:-1]), parts[-1]
        near = ", ".join(res._suggest(qual, sorted(ix.top) + [f"{c}.{m}" for c, ms in ix.classes.items() for m in ms]))
        hint = f" (nearest: {near})" if near else ""
        if not owner:
            return None if name in ix.top or ix.star else f"{qual} is not defined in {path}{hint}"
        if owner not in ix.classes and (parts[0] in ix.top or ix.star):
            return None if parts[0] not in ix.imports else (
                None if _has_member(dirs, modname, owner, name) is not False else f"{qual} does not exist{hint}")
        if owner not in ix.classes:
            return f"class {owner} is not defined in {path}{hint}"
        if _has_member(dirs, modname, owner, name) is False:
            return f"{owner} defines no {name!r} and none of its base classes does ({path}){hint}"
        return None
    except Exception:  # noqa: BLE001 - a check that cannot decide never blocks a launch
        return None


def missing_sites(python: str, injections: Sequence[tuple[str, str, Sequence[str]]]) -> list[str]:
    """One line per injection none of whose alternatives can exist: ``variant/id: site … (why)``.

    Args:
        python: the target interpreter.
        injections: ``(variant name, injection id, site alternatives)``.
    """
    out = []
    for vname, iid, alts in injections:
        whys = [(a, site_absent(python, a)) for a in alts]
        if alts and all(w for _, w in whys):
            out.append(f"variants.{vname}.injections.{iid}.site: " + "; ".join(f"{a}: {w}" for a, w in whys))
    return out


if __name__ == "__main__":  # python -m repro.site_precheck PYTHON SITE...: what the check says of each site
    for s in sys.argv[2:]:
        print(s, "->", site_absent(sys.argv[1], s) or "may exist")
