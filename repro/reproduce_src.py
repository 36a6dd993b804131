"""Map dump frames to the engine's source, in the TARGET interpreter (standard library only; never imports the engine).

Run as ``python reproduce_src.py PACKAGE`` with a JSON list of frames on stdin
(``[{"file": "scheduler.py" | "sglang/srt/managers/scheduler.py", "function": "Scheduler.event_loop_normal",
"line": 2039}, …]``). Prints one line ``REPRO-SRC <json>``: a list, one entry per frame, with

- ``module`` / ``qualname``: where the function is defined in PACKAGE (``sglang.srt.managers.scheduler``,
  ``Scheduler.event_loop_normal``), or None with ``nearest`` (close names, as ``repro sites`` gives them);
- ``call``: the call the frame was making at its line (``{"name": "run_batch", "self_method": true,
  "collective": false, "group": null}``; ``collective`` when it is a ``torch.distributed`` collective or a method
  whose name holds one; ``group`` the ``self.X`` path of its ``group=`` argument), None when the line holds no call;
- ``loop_var``: the target of the innermost ``for`` loop of the function enclosing that line (``req``), else None.

Checked against sglang 0.5.23's ``srt/managers/scheduler.py`` and ``srt/mem_cache/unified_radix_cache.py``.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import json
import os
import sys

COLLECTIVE_WORDS = ("all_reduce", "allreduce", "broadcast", "all_gather", "allgather", "reduce_scatter", "barrier",
                    "all_to_all", "gather", "scatter")
_MARK = "REPRO-SRC "


def _package_root(package: str) -> str:
    spec = importlib.util.find_spec(package)  # a top-level find_spec runs no engine code
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {package!r} is not installed in {sys.executable}")
    return list(spec.submodule_search_locations)[0]


def _files(root: str, package: str) -> list[tuple[str, str]]:
    out = []
    for d, _, names in os.walk(root):
        for n in names:
            if n.endswith(".py"):
                p = os.path.join(d, n)
                rel = os.path.relpath(p, os.path.dirname(root)).replace(os.sep, "/")
                out.append((rel, p))
    return out


class _Defs(ast.NodeVisitor):
    def __init__(self) -> None:
        self.stack: list[str] = []
        self.defs: dict[str, ast.AST] = {}

    def _fn(self, node) -> None:
        q = ".".join(self.stack + [node.name])
        self.defs.setdefault(q, node)
        self.stack.append(node.name)
        self.stack.append("<locals>")
        self.generic_visit(node)
        self.stack.pop()
        self.stack.pop()

    visit_FunctionDef = _fn
    visit_AsyncFunctionDef = _fn

    def visit_ClassDef(self, node) -> None:
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()


_PARSED: dict[str, dict] = {}


def _defs(path: str) -> dict:
    if path not in _PARSED:
        try:
            tree = ast.parse(open(path, encoding="utf-8").read())
        except (OSError, SyntaxError, ValueError):
            _PARSED[path] = {}
        else:
            v = _Defs()
            v.visit(tree)
            _PARSED[path] = v.defs
    return _PARSED[path]


def _callee(call: ast.Call) -> tuple[str, bool, str]:
    f = call.func
    if isinstance(f, ast.Attribute):
        base = f.value
        full = f.attr
        while isinstance(base, ast.Attribute):
            full = base.attr + "." + full
            base = base.value
        if isinstance(base, ast.Name):
            full = base.id + "." + full
        return f.attr, isinstance(f.value, ast.Name) and f.value.id == "self", full
    if isinstance(f, ast.Name):
        return f.id, False, f.id
    return "", False, ""


def _self_path(node: ast.AST):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "self" and parts:
        return ".".join(reversed(parts))
    return None


def _at_line(fn: ast.AST, line: int) -> tuple[dict | None, str | None]:
    best = None
    loop_var = None

    def walk(node, loops):
        nonlocal best, loop_var
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                continue
            lo, hi = getattr(child, "lineno", None), getattr(child, "end_lineno", None)
            inner = loops
            if isinstance(child, (ast.For, ast.AsyncFor)) and lo is not None and lo <= line <= (hi or lo):
                t = child.target
                if isinstance(t, ast.Tuple) and t.elts and isinstance(t.elts[0], ast.Name):
                    t = t.elts[0]
                if isinstance(t, ast.Name) and not (child.iter.lineno <= line <= (child.iter.end_lineno or 0)):
                    inner = loops + [t.id]
            if isinstance(child, ast.Call) and lo is not None and lo <= line <= (hi or lo):
                span = (hi or lo) - lo
                if best is None or span <= best[0]:
                    best = (span, child)
                    loop_var = inner[-1] if inner else None
            walk(child, inner)

    walk(fn, [])
    if best is None:
        return None, None
    call = best[1]
    name, self_method, full = _callee(call)
    low = name.lower()
    group = None
    for kw in call.keywords:
        if kw.arg == "group":
            group = _self_path(kw.value)
    coll = any(w in low for w in COLLECTIVE_WORDS)
    return {"name": name, "full": full, "self_method": self_method, "collective": coll, "group": group}, loop_var


def resolve(frames: list[dict], package: str) -> list[dict]:
    root = _package_root(package)
    files = _files(root, package)
    out = []
    for fr in frames:
        fpath = (fr.get("file") or "").replace("\\", "/")
        func = fr.get("function") or ""
        line = fr.get("line")
        cands = [(rel, p) for rel, p in files if rel == fpath or rel.endswith("/" + fpath)] if fpath else []
        hit = None
        names: list[str] = []
        hits = []
        for rel, p in cands:
            defs = _defs(p)
            names += list(defs)
            q = func if func in defs else next((k for k in defs if k.rsplit(".", 1)[-1] == func and "." not in func), None)
            if q is not None:
                hits.append((rel, p, q, defs[q]))
        # several files of that name define it (sglang has three vocab_parallel_embedding.py): prefer the one whose
        # function spans the frame's line and has a call there
        for h in hits:
            node = h[3]
            if line and node.lineno <= int(line) <= (node.end_lineno or node.lineno) and _at_line(node, int(line))[0]:
                hit = h
                break
        if hit is None and hits:
            hit = hits[0]
        if hit is None:
            near = list(dict.fromkeys(difflib.get_close_matches(func, list(dict.fromkeys(names)), n=3, cutoff=0.6)))
            short = func.rsplit(".", 1)[-1]
            if not near and short.isidentifier():
                needle = f"def {short}("
                for rel, p in files:  # the same method name anywhere in the package (a renamed class or file)
                    try:
                        if needle not in open(p, encoding="utf-8", errors="replace").read():
                            continue
                    except OSError:
                        continue
                    mod = rel[:-3].replace("/", ".").removesuffix(".__init__")
                    near += [f"{mod}:{q}" for q in _defs(p) if q.rsplit(".", 1)[-1] == short]
                    if len(near) >= 3:
                        break
            out.append({"module": None, "qualname": None, "call": None, "loop_var": None, "file_found": bool(cands),
                        "nearest": near[:3]})
            continue
        rel, p, q, node = hit
        call, loop_var = _at_line(node, int(line)) if line else (None, None)
        out.append({"module": rel[:-3].replace("/", ".").removesuffix(".__init__"), "qualname": q, "call": call,
                    "loop_var": loop_var, "file_found": True, "nearest": []})
    return out


if __name__ == "__main__":
    frames = json.loads(sys.stdin.read() or "[]")
    if len(sys.argv) != 2:
        sys.exit("usage: python reproduce_src.py PACKAGE < frames.json (PACKAGE: the engine's top-level package)")
    print(_MARK + json.dumps(resolve(frames, sys.argv[1])))
