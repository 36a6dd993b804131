"""Walking function bodies and statements, matching names against rule globs, short source texts; each cached per scan
(``scan()`` empties the caches)."""

from __future__ import annotations

import ast
import fnmatch
from collections import deque


_LOCAL_DEFS = {}


def local_defs(f):
    d = _LOCAL_DEFS.get(f.id)
    if d is None:
        d = _LOCAL_DEFS[f.id] = {n.name: f"{f.id}.<locals>.{n.name}" for n in f.node.body
                                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return d


_NESTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


_BODY_NODES = {}  # id(function node) -> (the node, its body's nodes); emptied by scan()


_STMT_CALLS = {}  # id(statement) -> (the statement, its Call / Attribute nodes in walk_stmts order); emptied by scan()


def walk_body(fnode):
    """Every node of a function's body, not descending into nested functions/classes/lambdas (breadth first).

    Computed once per function and kept (a list: every pass of the scan walks the same bodies — type rounds, the
    call graph, the attribute tables —, which was most of its time on sglang; issue 31)."""
    hit = _BODY_NODES.get(id(fnode))
    if hit is not None and hit[0] is fnode:
        return hit[1]
    got = []
    todo = deque(fnode.body)
    while todo:
        n = todo.popleft()
        got.append(n)
        for c in ast.iter_child_nodes(n):
            if not isinstance(c, _NESTED):
                todo.append(c)
    _BODY_NODES[id(fnode)] = (fnode, got)  # the node kept with it: an id is never reused while cached
    return got


def _stmt_nodes(s):
    """``s`` and the nodes under it (breadth first, nested definitions and lambdas left out): walk_stmts' order."""
    out = [s]
    todo = deque(ast.iter_child_nodes(s))
    while todo:
        n = todo.popleft()
        if isinstance(n, _NESTED):
            continue
        out.append(n)
        todo.extend(ast.iter_child_nodes(n))
    return out


def walk_stmts(stmts):
    for s in stmts:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        yield from _stmt_nodes(s)


def stmt_calls(stmts):
    """The Call and Attribute nodes of :func:`walk_stmts` (same order), from a per-statement list kept once made
    (the guard analysis asks for the regions after every exit and branch: the same statements many times)."""
    for s in stmts:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        hit = _STMT_CALLS.get(id(s))
        if hit is None or hit[0] is not s:
            hit = _STMT_CALLS[id(s)] = (s, [n for n in _stmt_nodes(s) if isinstance(n, (ast.Call, ast.Attribute))])
        yield from hit[1]


_MATCHED = {}  # id(glob list) -> (the list, {name: answer}): the same few rule lists are asked about every call


def _match(name, globs):
    """Whether ``name`` matches one of ``globs`` (fnmatch, case-sensitive); answers kept per list and name (the
    rule lists are not changed during a scan)."""
    hit = _MATCHED.get(id(globs))
    if hit is None or hit[0] is not globs:
        hit = _MATCHED[id(globs)] = (globs, {})
    got = hit[1].get(name)
    if got is None:
        got = hit[1][name] = any(fnmatch.fnmatchcase(name, g) for g in globs)
    return got


_TEXTS = {}  # (id(node), limit) -> (node, text); emptied by scan()


def _text(node, limit=120):
    """The source text of ``node`` on one line, cut to ``limit`` characters (kept per node: asked again by every
    pass that makes a source of it)."""
    hit = _TEXTS.get((id(node), limit))
    if hit is not None and hit[0] is node:
        return hit[1]
    s = _unparse_line(node, limit)
    _TEXTS[(id(node), limit)] = (node, s)
    return s


def _unparse_line(node, limit):
    try:
        s = ast.unparse(node)
    except Exception:  # pragma: no cover - ast.unparse handles every parsed node
        s = type(node).__name__
    s = " ".join(s.split())
    return s if len(s) <= limit else s[: limit - 1] + "…"
