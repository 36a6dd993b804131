"""The call graph and which functions reach a collective (``Reach``); calls that resolve to nothing are listed, never
guessed."""

from __future__ import annotations

import ast
from collections import defaultdict, deque

from . import COLL
from .walk import _match, _text, walk_body


class Reach:
    """Which functions reach a collective, with one chain each (function ids, innermost last, then the API)."""

    def __init__(self, ix, types, rules):
        self.ix, self.types = ix, types
        coll = rules.get("collectives", {})
        self.torch_mods = tuple(coll.get("torch_modules", ["torch.distributed"]))
        self.torch_fns = set(coll.get("torch_functions", []))
        self.seed_globs = list(coll.get("coordinator_methods", [])) + list(coll.get("object_broadcasts", []))
        self.sanitizer_globs = list(coll.get("sanitizers", []))
        self.next = {}  # fid -> (next fid or API string)
        self.unresolved = defaultdict(list)
        edges_rev = defaultdict(set)
        for f in ix.funcs.values():
            for node in walk_body(f.node):
                if isinstance(node, ast.Attribute) and node.attr in ix.prop_names:
                    props = types.prop_targets(f, node)
                    if props:  # reading a property runs its getter: a call edge like any other
                        f.calls.append((node, frozenset(props), _text(node)))
                        for t in props:
                            edges_rev[t].add(f.id)
                    continue
                if not isinstance(node, ast.Call):
                    continue
                api = self.torch_api(f, node)
                if api:
                    f.calls.append((node, frozenset([COLL]), api))
                    continue
                tg = types.callees(f, node)
                resolved = set()
                for t in tg:
                    if t in ix.funcs:
                        resolved.add(t)
                    elif t in ix.classes:
                        for init in ("__init__", "__post_init__"):
                            resolved |= ix.method_targets(t, init, False)
                ext = {t for t in tg if t.startswith("ext:")}
                f.calls.append((node, frozenset(resolved | ext), _text(node.func)))
                if not tg:
                    self.unresolved[f.id].append((node.lineno, _text(node.func)))
                for t in resolved:
                    edges_rev[t].add(f.id)
        self.callers = edges_rev  # fid -> the functions that call it (property reads included)
        todo = deque()
        for fid in ix.funcs:
            if _match(fid, self.seed_globs):
                self.next[fid] = fid.split(":", 1)[1]
                todo.append(fid)
        for f in ix.funcs.values():
            for node, tg, text in f.calls:
                if COLL in tg and f.id not in self.next:
                    self.next[f.id] = text
                    todo.append(f.id)
        while todo:
            g = todo.popleft()
            for caller in edges_rev.get(g, ()):
                if caller not in self.next:
                    self.next[caller] = g
                    todo.append(caller)

    def torch_api(self, f, call):
        """``torch.distributed.all_reduce`` (however imported) → that dotted name; else None."""
        fn = call.func
        name = fn.attr if isinstance(fn, ast.Attribute) else (fn.id if isinstance(fn, ast.Name) else None)
        if name not in self.torch_fns:
            return None
        if isinstance(fn, ast.Attribute):
            r = self.ix.resolve_expr_ref(f.mod, fn.value)
            dotted = r[1] if r else _text(fn.value)
        else:
            r = self.ix.lookup(f.mod, fn.id)
            dotted = r[1].rsplit(".", 1)[0] if r and r[0] == "ext" else ""
        return f"{dotted}.{name}" if any(dotted == m or dotted.startswith(m + ".") for m in self.torch_mods) else None

    def reaches(self, fid):
        return fid in self.next

    def chain(self, fid, limit=8):
        out = []
        cur = fid
        while cur in self.next and len(out) < limit:
            out.append(cur)
            nxt = self.next[cur]
            if nxt == cur.split(":", 1)[1] or nxt not in self.ix.funcs:
                if nxt != cur.split(":", 1)[1]:
                    out.append(nxt)
                break
            cur = nxt
        return out

    def call_reaches(self, tg):
        if COLL in tg:
            return True
        return any(t in self.next for t in tg)

    def is_sanitizer(self, tg):
        return COLL in tg or any(_match(t, self.sanitizer_globs) for t in tg) or any(t in self.next for t in tg)

    def is_agreed_api(self, tg):
        """A collective itself, the coordinator's collective methods and object broadcasts, the named sanitizers:
        their results are what every rank agrees on. (A function that merely *reaches* a collective on the way may
        still return a rank-local value: ``PrefillAdder.add_one_req`` evicts through an all_reduce and returns a
        verdict on the free-token budget.)"""
        return COLL in tg or any(_match(t, self.sanitizer_globs) or _match(t, self.seed_globs) for t in tg)
