"""Rank-local sources beyond one function: attributes written by threads, callables stored on ``self``, attributes
written in one method and read in another (cross-call), and the functions whose returned value depends on a source
(``returners``)."""

from __future__ import annotations

import ast
from collections import defaultdict

from .attrs import _ADD_METHODS, _self_attr
from .guards import Guards, Src
from .walk import _match, local_defs, walk_body


class Ctx:
    pass


def thread_attrs(ix, types):
    """class id -> attributes written (``self.x = …``, ``self.x.append(…)``) inside a ``Thread(target=self.m)``."""
    out = defaultdict(set)
    for f in ix.funcs.values():
        for node in walk_body(f.node):
            if not isinstance(node, ast.Call):
                continue
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name != "Thread":
                continue
            tgt = next((k.value for k in node.keywords if k.arg == "target"), None)
            if tgt is None or not isinstance(tgt, ast.Attribute) or f.cls is None:
                continue
            if not (isinstance(tgt.value, ast.Name) and tgt.value.id == f.self_name):
                continue
            for m in ix.method_targets(f.cls.id, tgt.attr, False):
                g = ix.funcs[m]
                for n in walk_body(g.node):
                    if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                        for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == g.self_name:
                                out[f.cls.id].add(t.attr)
                    elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in (
                            "append", "extend", "add", "update", "put", "pop", "popleft", "clear"):
                        v = n.func.value
                        if isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name) and v.value.id == g.self_name:
                            out[f.cls.id].add(v.attr)
    return out


def stored_callables(ix, types):
    """class id -> attribute -> functions it may hold: ``self.x = self.m`` / ``= helper`` / ``= partial(helper, …)``
    / ``= lambda …: call(…)`` / ``= inner`` (a nested ``def``), in any method of the class (issue 31)."""
    out = defaultdict(lambda: defaultdict(set))

    def refs(f, v, depth=0):
        if depth > 2 or v is None:
            return set()
        if isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name) and v.value.id == f.self_name and f.cls is not None:
            return set(ix.method_targets(f.cls.id, v.attr, True))
        if isinstance(v, ast.Name):
            if v.id in local_defs(f):
                return {local_defs(f)[v.id]}
            r = ix.lookup(f.mod, v.id)
            return {r[1]} if r and r[0] == "obj" and r[1] in ix.funcs else set()
        if isinstance(v, ast.Call):
            fn = v.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name == "partial" and v.args:
                return refs(f, v.args[0], depth + 1)
            return set()
        if isinstance(v, ast.Lambda):
            got = set()
            for n in ast.walk(v.body):
                if isinstance(n, ast.Call):
                    got |= {t for t in types.callees(f, n) if t in ix.funcs}
            return got
        if isinstance(v, ast.IfExp):
            return refs(f, v.body, depth + 1) | refs(f, v.orelse, depth + 1)
        return set()

    for f in ix.funcs.values():
        if f.cls is None or f.self_name is None:
            continue
        for n in walk_body(f.node):
            if isinstance(n, ast.Assign):
                for t in n.targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == f.self_name \
                            and t.attr not in f.cls.methods:
                        got = refs(f, n.value)
                        if got:
                            out[f.cls.id][t.attr] |= got
    return out


def _may_read_source(ctx, f):
    """Whether ``f`` calls (or reads) something that can be a rank-local source — a query the rules name, a clock,
    a function returning a rank-local value, ``len()`` of a per-rank container: a cheap filter before running its
    taint analysis (the rest cannot write a rank-local value into an attribute, bar another attribute: round 2)."""
    r = ctx.rules_src
    for _node, tg, text in f.calls:
        name = text.rsplit(".", 1)[-1]
        if any(t in ctx.returners for t in tg):
            return True
        if any(_match(name, globs) for _k, globs in r["method_kinds"]):
            return True
        if any(isinstance(t, str) and t.startswith("ext:") and t[4:] in r["clocks"] for t in tg):
            return True
        if name == "len" and r["containers"]:
            return True
    return False


def cross_call_attrs(ctx, rounds):
    """class id -> attribute -> the leaves ``(site, writer, kind)`` of the rank-local values written into
    ``self.attr`` (directly, or under a rank-local condition) by its methods: a later read of that attribute, in
    another method or a later tick, is a rank-local source (kind ``cross-call attribute``). Iterated ``rounds``
    times (an attribute written from another one)."""
    ctx.attr_src = {}
    every = []  # (method, the attributes of self it writes or adds to, the attributes of self it reads)
    writers = []  # those of them that read a source of their own (round 1)
    containers = {a for c in ctx.thread_attrs.values() for a in c}  # read: a source already (round 1)
    for f in ctx.ix.funcs.values():
        if f.cls is None or f.self_name is None:
            continue
        wrote, read = set(), set()
        for n in walk_body(f.node):
            if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                    x = _self_attr(f, t)
                    if x:
                        wrote.add(x)
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _ADD_METHODS:
                x = _self_attr(f, n.func.value)
                if x:
                    wrote.add(x)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load):
                x = _self_attr(f, n)
                if x:
                    read.add(x)
        wrote -= ctx.sanitized_attrs
        if wrote:
            every.append((f, wrote, read))
            if _may_read_source(ctx, f) or read & containers:
                writers.append((f, wrote, read))
    # monotone: a later round only adds; it re-runs only the writers that read an attribute the round before found
    found = defaultdict(lambda: defaultdict(set))
    todo = writers
    for _ in range(max(1, rounds)):
        before = {(c, a): len(v) for c, attrs in found.items() for a, v in attrs.items()}
        for f, wrote, _read in todo:
            g = Guards(ctx, f)
            g.record = lambda *a, **k: None
            g.try_guard = lambda *a, **k: None
            g.attr_writes = defaultdict(set)
            try:
                g.run()
            except RecursionError:  # pragma: no cover
                continue
            for attr, srcs in g.attr_writes.items():
                if attr in ctx.sanitized_attrs:
                    continue
                leaves = set()
                for x in srcs:
                    if x.kind == "except path":
                        continue
                    leaves |= set(x.leaves) if x.leaves else {(site, f.id, x.kind) for site in x.sites
                                                              if site not in ctx.ix.prop_fids}
                    leaves.add(("", f.id, x.kind))  # the writer itself (no site: kept to name where it is written)
                if leaves:
                    found[f.cls.id][attr] |= leaves
        changed = {a for c, attrs in found.items() for a, v in attrs.items() if before.get((c, a)) != len(v)}
        ctx.attr_src = {c: dict(v) for c, v in found.items()}
        if not changed:
            break
        todo = [w for w in every if w[2] & changed]
    return ctx.attr_src


def returners(ctx, rounds):
    """fid -> source kind, for functions whose return value depends on a rank-local source (``free_slots()``
    returning ``pool.available_size()``): calling them is a source too, and ``ctx.leaves`` keeps the innermost
    queries each value comes from. A function that reaches a collective on the way counts too when its returned
    value does not come from that collective (a value reduced in place is agreed); functions whose only taint is
    an ``except`` path do not. Later rounds look only at the callers of the functions found in the round before."""
    ctx.returners = {}
    ctx.leaves = {}  # fid -> {(leaf site, its direct caller, kind)}
    todo = list(ctx.ix.funcs)
    for _ in range(rounds):
        new, new_leaves = {}, {}
        for fid in todo:
            f = ctx.ix.funcs[fid]
            if f.id in ctx.returners:
                continue
            if not any(isinstance(n, ast.Return) and n.value is not None for n in walk_body(f.node)):
                continue
            g = Guards(ctx, f)
            g.record = lambda *a, **k: None  # only the return taint is wanted here
            g.try_guard = lambda *a, **k: None
            try:
                g.run()
            except RecursionError:  # pragma: no cover
                continue
            srcs = [x for x in sorted(g.returned, key=Src.key) if x.kind != "except path"]
            if srcs:
                new[f.id] = srcs[0].kind
                leaves = set()
                for x in srcs:
                    # a query called here is a leaf whose row is this function; a value from another returner
                    # keeps that returner's leaves
                    leaves |= set(x.leaves) if x.leaves else {(site, f.id, x.kind) for site in x.sites
                                                              if site not in ctx.ix.prop_fids}
                new_leaves[f.id] = leaves
        if not new:
            break
        ctx.returners.update(new)
        ctx.leaves.update(new_leaves)
        # the next round: only functions that call (or read) one found in this round can newly return a rank-local
        # value
        todo = sorted({c for fid in new for c in ctx.reach.callers.get(fid, ()) if c not in ctx.returners})
    # a returner found early saw only the returners known then: its leaves grow until nothing changes. A returner's
    # leaves depend only on those of the returners it calls, so a sweep re-runs only those whose callees' leaves
    # changed since they were last run (the rest would give what they hold: the same sweeps, a fraction of the runs)
    stale = set(ctx.returners)
    for _ in range(rounds):
        changed = False
        for fid in list(ctx.returners):
            if fid not in stale:
                continue
            stale.discard(fid)
            g = Guards(ctx, ctx.ix.funcs[fid])
            g.record = lambda *a, **k: None
            g.try_guard = lambda *a, **k: None
            try:
                g.run()
            except RecursionError:  # pragma: no cover
                continue
            leaves = set(ctx.leaves.get(fid, ()))
            for x in g.returned:
                if x.kind != "except path":
                    leaves |= set(x.leaves) if x.leaves else {(site, fid, x.kind) for site in x.sites
                                                              if site not in ctx.ix.prop_fids}
            if leaves != ctx.leaves.get(fid):
                ctx.leaves[fid] = leaves
                changed = True
                stale |= {c for c in ctx.reach.callers.get(fid, ()) if c in ctx.returners}
        if not changed:
            break
    return ctx.returners
