"""Guards: the may-taint analysis of one function from rank-local sources to a branch, loop bound, ``break``,
``continue`` or ``return`` around a collective-reaching call (``Guards``)."""

from __future__ import annotations

import ast

from .attrs import _self_attr
from . import COLL, MAX_LEAVES
from .walk import _match, _text, stmt_calls


class Src:
    """A rank-local source occurrence: kind, text, resolved sites (``module:Qual``), line, loop var, and, when the
    value comes through functions that return a rank-local value (``budget.has_capacity()`` ← ``remaining_total`` ←
    ``allocator.available_size() + cache.evictable_size()``), the ``leaves``: the innermost rank-local queries as
    (site, the function that calls it, kind) — a patch site whose row is its own direct caller."""

    __slots__ = ("kind", "text", "sites", "line", "loop", "leaves")

    def __init__(self, kind, text, sites, line, loop, leaves=()):
        self.kind, self.text, self.line, self.loop = kind, text, line, loop
        self.sites = tuple(sites or ())
        self.leaves = tuple(sorted(set(leaves)))[:MAX_LEAVES]

    def key(self):
        return (self.kind, self.text, self.sites, self.line, self.loop)

    def __hash__(self):
        return hash(self.key())

    def __eq__(self, o):
        return isinstance(o, Src) and self.key() == o.key()

    def to_json(self):
        return {"kind": self.kind, "text": self.text, "sites": list(self.sites), "line": self.line, "loop_var": self.loop,
                "leaves": [list(x) for x in self.leaves]}


class Guards:
    """The guard analysis of one function (see the module docstring)."""

    def __init__(self, ctx, f):
        self.ctx, self.f = ctx, f
        self.ix, self.reach, self.types = ctx.ix, ctx.reach, ctx.types
        self.calls = {id(n): (tg, text) for n, tg, text in f.calls}
        self.found = []
        self.returned = frozenset()  # sources the function's return values depend on
        self.seen = set()
        self.loops = []  # stack of (loop node, target names)
        self.frames = []  # stack of (kind, stmts, index) for skipped-code computation
        self.pc = []  # stack of (frozenset[Src], loop depth when pushed)
        self.attr_writes = None  # cross_call_attrs: attribute of self -> sources of the values written into it

    # ---- sources
    def source_of_call(self, call):
        r = self.ctx.rules_src
        fn = call.func
        tg, text = self.calls.get(id(call), (frozenset(), _text(fn)))
        loop = self.loops[-1][1] if self.loops else None
        name = fn.attr if isinstance(fn, ast.Attribute) else (fn.id if isinstance(fn, ast.Name) else "")
        if self.reach.is_agreed_api(tg):
            return None
        ret_reaching = [t for t in tg if t in self.ctx.returners and self.reach.reaches(t)]
        if self.reach.is_sanitizer(tg) and not ret_reaching:
            return None  # reaches a collective and returns no rank-local value of its own: its result is agreed
        sites = sorted(t for t in tg if t in self.ix.funcs and "<locals>" not in t  # nested functions: no patch site
                       and t not in self.ix.prop_fids)
        ext = next((t[4:] for t in tg if isinstance(t, str) and t.startswith("ext:")), None)
        if ext and any(ext == c for c in r["clocks"]):
            m, _, q = ext.rpartition(".")
            return Src("clock", text + "()", [f"{m}:{q}"], call.lineno, loop)
        if ext and ext.split(".")[0] in r["non_source_modules"]:
            return None
        if isinstance(fn, ast.Attribute):
            for kind, globs in r["method_kinds"]:
                if _match(name, globs):
                    return Src(kind, text + "()", sites, call.lineno, loop)
        elif sites:
            for kind, globs in r["method_kinds"]:
                if kind != "poll" and _match(name, globs):
                    return Src(kind, text + "()", sites, call.lineno, loop)
        ret = [t for t in sites if t in self.ctx.returners]
        if ret:
            return Src(self.ctx.returners[ret[0]], text + "()", ret, call.lineno, loop, self.leaves_of(ret))
        return None

    def leaves_of(self, fids):
        out = set()
        for t in fids:
            out |= self.ctx.leaves.get(t, set())
        return out

    def source_of_property(self, e):
        """A property read whose getter returns a rank-local value (``self.budget.remaining_total``): a source like
        the call it is; None otherwise (a getter that reaches a collective gives an agreed value)."""
        tg = self.calls.get(id(e), (frozenset(), ""))[0]
        if not tg or self.reach.is_agreed_api(tg):
            return None
        ret = sorted(t for t in tg if t in self.ctx.returners)
        if not ret:
            return None
        loop = self.loops[-1][1] if self.loops else None
        # a getter is no patch site: the value is perturbed at its leaves (the queries the getter reads)
        return Src(self.ctx.returners[ret[0]], _text(e), (), e.lineno, loop, self.leaves_of(ret))

    def taint(self, e, st):
        """The rank-local sources an expression depends on (a frozenset, empty when none)."""
        if e is None:
            return frozenset()
        if isinstance(e, ast.Call):
            tg, _ = self.calls.get(id(e), (frozenset(), ""))
            s = self.source_of_call(e)
            if s is not None:
                return frozenset([s])
            if self.reach.is_sanitizer(tg):
                return frozenset()
            fn = e.func
            if isinstance(fn, ast.Name) and fn.id == "len" and e.args:
                return self.len_taint(e.args[0], st)
            out = frozenset()
            if isinstance(fn, ast.Attribute):
                out |= self.taint(fn.value, st)
            for a in e.args:
                out |= self.taint(a.value if isinstance(a, ast.Starred) else a, st)
            for k in e.keywords:
                out |= self.taint(k.value, st)
            return out
        if isinstance(e, ast.Name):
            return st.get(e.id, frozenset())
        if isinstance(e, ast.Attribute):
            p = _path(e)
            if p is not None and p in st:
                return st[p]
            if id(e) in self.calls:
                s = self.source_of_property(e)
                if s is not None:
                    return frozenset([s])
                if self.reach.is_sanitizer(self.calls[id(e)][0]):
                    return frozenset()
            cc = self.cross_call_source(e)
            if cc is not None:
                return frozenset([cc])
            if self.is_self_attr(e):
                if e.attr in self.ctx.sanitized_attrs:
                    return frozenset()
                if e.attr in self.ctx.thread_attrs.get(self.f.cls.id, ()):
                    loop = self.loops[-1][1] if self.loops else None
                    return frozenset([Src("thread-written attribute", _text(e), (), e.lineno, loop)])
                return frozenset()
            return self.taint(e.value, st)
        if isinstance(e, (ast.Lambda, ast.Constant)):
            return frozenset()
        out = frozenset()
        # an emptiness/membership test on a per-rank container: one source, its writers and their queries as leaves
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
            cs = self.container_source(e.operand, "emptiness")
            if cs:
                return cs
        elif isinstance(e, ast.Compare):
            for op, cmp in zip(e.ops, e.comparators):
                if isinstance(op, (ast.In, ast.NotIn)):
                    out |= self.container_source(cmp, "membership")
            if out:
                return out | self.taint(e.left, st)
        for c in ast.iter_child_nodes(e):
            if isinstance(c, ast.expr):
                out |= self.taint(c, st)
            elif isinstance(c, ast.comprehension):
                out |= self.taint(c.iter, st)
                for i in c.ifs:
                    out |= self.taint(i, st)
        return out

    def len_taint(self, arg, st):
        t = self.taint(arg, st)
        if t:
            return t
        if isinstance(arg, ast.Attribute) and self.is_self_attr(arg):
            name = arg.attr
            if name in self.ctx.sanitized_attrs:
                return frozenset()
            if _match(name, self.ctx.rules_src["containers"]):
                loop = self.loops[-1][1] if self.loops else None
                return frozenset([Src("len of per-rank container", f"len({_text(arg)})", (), arg.lineno, loop,
                                      self.writer_leaves(self.f.cls.id, name))])
        return frozenset()

    # ---- state across calls (issue 31)
    def _attr_classes(self, e):
        """Classes whose attribute ``e`` (``self.x`` or ``self.a.x``) reads; empty for anything else."""
        if not isinstance(e, ast.Attribute) or self.f.cls is None or self.f.self_name is None:
            return ()
        if self.is_self_attr(e):
            return (self.f.cls.id,)
        v = e.value
        if isinstance(v, ast.Attribute) and self.is_self_attr(v):
            return tuple(sorted(self.types.of(self.f, v)))
        return ()

    def _attr_leaves(self, table, classes, name):
        out, writers = set(), set()
        for c in classes:
            for k in self.ix.mro(c):
                got = (table.get(k) or {}).get(name)
                if got:
                    for leaf in got:
                        writers.add(leaf[1])
                        if leaf[0]:
                            out.add(leaf)
        return out, writers

    def cross_call_source(self, e):
        """``self.x`` (or ``self.a.x``) read here, written from a rank-local value in another method: a source
        (kind ``cross-call attribute``) whose leaves are the writers' queries; None otherwise."""
        table = getattr(self.ctx, "attr_src", None)
        if not table or not isinstance(e.ctx, ast.Load) or e.attr in self.ctx.sanitized_attrs:
            return None
        classes = self._attr_classes(e)
        if not classes:
            return None
        leaves, writers = self._attr_leaves(table, classes, e.attr)
        if not writers or writers == {self.f.id}:  # written only here: the local flow already follows it
            return None
        loop = self.loops[-1][1] if self.loops else None
        return Src("cross-call attribute", _text(e), (), e.lineno, loop, leaves)

    def writer_leaves(self, cid, name):
        """The methods that add to ``self.<name>`` of class ``cid``, each at every caller: ``(writer, caller,
        'container write')`` — skipping one write once leaves this rank's container emptier than its peers'. A
        writer that itself reaches a collective is left out (skipping it would drop a collective by construction)."""
        table = getattr(self.ctx, "attr_writers", None) or {}
        out = set()
        for k in self.ix.mro(cid):
            for w in (table.get(k) or {}).get(name, ()):
                if self.reach.reaches(w) or w in self.ix.prop_fids or "<locals>" in w:
                    continue
                for caller in self.reach.callers.get(w, ()):
                    out.add((w, caller, "container write"))
        return out

    def container_source(self, e, how):
        """A truth test (``not self.x``, ``if self.x``) or membership test (``k in self.x``) on a per-rank container
        (its name matches the rules' ``containers``, or it holds rank-local values written in another method): a
        source of kind ``per-rank container`` (leaves: its writers at their callers, and the queries those writes
        depend on); empty otherwise."""
        if not isinstance(e, ast.Attribute) or not isinstance(e.ctx, ast.Load) or e.attr in self.ctx.sanitized_attrs:
            return frozenset()
        classes = self._attr_classes(e)
        if not classes:
            return frozenset()
        name = e.attr
        table = getattr(self.ctx, "attr_src", None) or {}
        cross, writers = self._attr_leaves(table, classes, name)
        # (a container a Thread target writes is a source already: kind `thread-written attribute`)
        per_rank = _match(name, self.ctx.rules_src["containers"]) or bool(writers - {self.f.id})
        if not per_rank:
            return frozenset()
        leaves = set(cross)
        for c in classes:
            leaves |= self.writer_leaves(c, name)
        loop = self.loops[-1][1] if self.loops else None
        text = {"emptiness": f"not {_text(e)}", "membership": f"… in {_text(e)}"}.get(how, _text(e))
        return frozenset([Src("per-rank container", text, (), e.lineno, loop, leaves)])

    def cond_taint(self, test, st):
        """The taint of a condition: its value's, plus a bare per-rank container tested for emptiness
        (``if self.ongoing_x:``, ``while self.pending and …``)."""
        parts = test.values if isinstance(test, ast.BoolOp) else [test]
        out = frozenset()
        for x in parts:
            cs = self.container_source(x, "emptiness") if isinstance(x, ast.Attribute) else frozenset()
            out |= cs or self.taint(x, st)
        return out

    def is_self_attr(self, e):
        return (isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and self.f.self_name is not None
                and e.value.id == self.f.self_name and self.f.cls is not None)

    def pc_taint(self, loop_only=False):
        out = frozenset()
        depth = len(self.loops)
        for s, d in self.pc:
            if not loop_only or d == depth:
                out |= s
        return out

    # ---- reach
    def region_reach(self, stmts):
        """The collective-reaching calls in ``stmts``: (the most direct one's text, its line, its chain — the
        shortest path to a collective API —, the texts of up to four such calls in source order) or None."""
        best, texts = None, []
        for n in stmt_calls(stmts):
            if isinstance(n, ast.Call) or id(n) in self.calls:
                tg, text = self.calls.get(id(n), (frozenset(), ""))
                if self.reach.call_reaches(tg):
                    chains = [self.reach.chain(t) for t in sorted(x for x in tg if x != COLL) if self.reach.reaches(t)]
                    chain = min(chains, key=len) if chains else [text]
                    if best is None or len(chain) < len(best[2]):
                        best = (text, n.lineno, chain)
                    if text not in texts:
                        texts.append(text)
                    if len(texts) >= 4:
                        break
        if best is None:
            return None
        texts = [best[0]] + [t for t in texts if t != best[0]]
        return best + (texts,)

    # ---- statements
    def run(self):
        self.block(self.f.node.body, {})

    def block(self, stmts, st):
        for i, s in enumerate(stmts):
            self.frames.append(("block", stmts, i))
            try:
                st = self.stmt(s, st)
            finally:
                self.frames.pop()
        return st

    def assign(self, target, t, st):
        if isinstance(target, (ast.Tuple, ast.List)):
            for x in target.elts:
                self.assign(x.value if isinstance(x, ast.Starred) else x, t, st)
            return
        if self.attr_writes is not None and t:
            x = _self_attr(self.f, target)
            if x:
                self.attr_writes[x] |= t
        key = target.id if isinstance(target, ast.Name) else _path(target)
        if key is None:
            if isinstance(target, ast.Subscript):
                key = _path(target.value) if not isinstance(target.value, ast.Name) else target.value.id
                if key and t:
                    st[key] = st.get(key, frozenset()) | t
            return
        if t:
            st[key] = t if isinstance(target, ast.Name) else st.get(key, frozenset()) | t
        elif isinstance(target, ast.Name):
            st.pop(key, None)

    def stmt(self, s, st):
        st = dict(st)
        pc = self.pc_taint()
        if isinstance(s, ast.Assign):
            t = self.taint(s.value, st) | pc
            for tgt in s.targets:
                self.assign(tgt, t, st)
        elif isinstance(s, (ast.AnnAssign, ast.AugAssign)):
            if s.value is not None:
                t = self.taint(s.value, st) | pc
                if isinstance(s, ast.AugAssign):
                    t |= self.taint(s.target, st)
                self.assign(s.target, t, st)
        elif isinstance(s, ast.Expr):
            self.expr_stmt(s.value, st, pc)
        elif isinstance(s, ast.If):
            c = self.cond_taint(s.test, st)
            if c:
                self.branch_guard(s, c, st)
            self.pc.append((c, len(self.loops)))
            a = self.block(s.body, st)
            b = self.block(s.orelse, st)
            self.pc.pop()
            st = _join(a, b)
        elif isinstance(s, (ast.For, ast.AsyncFor)):
            c = self.taint(s.iter, st)
            if c:
                r = self.region_reach(s.body)
                if r:
                    self.record("loop bound", s, c, r, "the number of iterations of a loop that reaches a collective")
            names = tuple(n.id for n in ast.walk(s.target) if isinstance(n, ast.Name))
            self.assign(s.target, c | pc, st)
            self.loops.append((s, names[-1] if names else None))
            self.pc.append((c, len(self.loops)))
            self.frames.append(("loop", s.body, -1))
            cur = st
            for _ in range(2):
                cur = _join(cur, self.block(s.body, cur))
            self.frames.pop()
            self.pc.pop()
            self.loops.pop()
            st = _join(cur, self.block(s.orelse, cur))
        elif isinstance(s, ast.While):
            c = self.cond_taint(s.test, st)
            if c:
                r = self.region_reach(s.body)
                if r:
                    self.record("loop condition", s, c, r, "whether/how often a loop that reaches a collective runs")
            self.loops.append((s, None))
            self.pc.append((c, len(self.loops)))
            self.frames.append(("loop", s.body, -1))
            cur = st
            for _ in range(2):
                cur = _join(cur, self.block(s.body, cur))
            self.frames.pop()
            self.pc.pop()
            self.loops.pop()
            st = _join(cur, self.block(s.orelse, cur))
        elif isinstance(s, (ast.Break, ast.Continue, ast.Return, ast.Raise)):
            if isinstance(s, ast.Return):
                self.returned |= (self.taint(s.value, st) if s.value is not None else frozenset()) | pc
            self.exit_guard(s)
        elif isinstance(s, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            a = self.block(s.body, st)
            outs = [a]
            for h in s.handlers:
                loop = self.loops[-1][1] if self.loops else None
                src = Src("except path", f"except {_text(h.type) if h.type else ''}".strip(), (), h.lineno, loop)
                self.try_guard(s, h, src)
                self.pc.append((frozenset([src]), len(self.loops)))
                outs.append(self.block(h.body, _join(st, a)))
                self.pc.pop()
            st = outs[0]
            for o in outs[1:]:
                st = _join(st, o)
            st = self.block(s.orelse, st)
            st = self.block(s.finalbody, st)
        elif isinstance(s, (ast.With, ast.AsyncWith)):
            st = self.block(s.body, st)
        elif isinstance(s, getattr(ast, "Match", ())) if hasattr(ast, "Match") else False:
            c = self.taint(s.subject, st)
            self.pc.append((c, len(self.loops)))
            outs = [self.block(case.body, st) for case in s.cases]
            self.pc.pop()
            for o in outs:
                st = _join(st, o)
        return st

    def expr_stmt(self, e, st, pc):
        if not isinstance(e, ast.Call):
            return
        tg, _ = self.calls.get(id(e), (frozenset(), ""))
        if COLL in tg or self.reach.is_sanitizer(tg):
            for a in e.args:  # an in-place collective: every rank holds the reduced value afterwards
                if isinstance(a, ast.Name):
                    st.pop(a.id, None)
            return
        fn = e.func
        if isinstance(fn, ast.Attribute) and fn.attr in ("append", "extend", "add", "update", "insert", "appendleft"):
            t = frozenset()
            for a in e.args:
                t |= self.taint(a, st)
            t |= pc
            key = fn.value.id if isinstance(fn.value, ast.Name) else _path(fn.value)
            if key and t:
                st[key] = st.get(key, frozenset()) | t
            if self.attr_writes is not None and t:
                x = _self_attr(self.f, fn.value)
                if x:
                    self.attr_writes[x] |= t

    # ---- guard records
    def branch_guard(self, s, c, st):
        rb, ro = self.region_reach(s.body), self.region_reach(s.orelse)
        r = rb or ro
        if r:
            self.record("branch", s, c, r, "whether a collective-reaching call runs (if/else)")

    def exit_guard(self, s):
        kind = type(s).__name__.lower()
        loop_only = kind in ("break", "continue")
        if loop_only and not self.loops:
            return
        c = self.pc_taint(loop_only=loop_only)
        if not c:
            return
        if kind == "break":
            loop = self.loops[-1][0]
            r = self.region_reach(loop.body)
            why = f"a `break` out of `for {self.loops[-1][1]}` skips every later iteration, which reach a collective"
        else:
            skipped = []
            for fk, stmts, i in reversed(self.frames):
                if fk == "loop":
                    if loop_only:
                        break
                    continue
                skipped.extend(stmts[i + 1:])
            r = self.region_reach(skipped)
            why = {"continue": "a `continue` skips the rest of this iteration, which reaches a collective",
                   "return": "an early `return` skips the rest of the function, which reaches a collective",
                   "raise": "a `raise` skips the rest of the function, which reaches a collective"}[kind]
        if r:
            self.record(kind, s, c, r, why)

    def try_guard(self, s, h, src):
        r_h = self.region_reach(h.body)
        r_t = self.region_reach(s.body)
        if (r_h or r_t) and ("except", h.lineno) not in self.seen:
            self.seen.add(("except", h.lineno))
            self.found.append({"guard": "except", "line": h.lineno, "sources": [src.to_json()],
                               "collective": _coll_json(r_h or r_t),
                               "why": "an exception raised on one rank only takes the handler, which changes whether "
                                      "a collective-reaching call runs"})

    def record(self, kind, s, c, r, why):
        key = (kind, s.lineno, tuple(sorted(x.key() for x in c)))
        if key in self.seen:
            return
        self.seen.add(key)
        self.found.append({"guard": kind, "line": s.lineno, "sources": [x.to_json() for x in sorted(c, key=Src.key)],
                           "collective": _coll_json(r), "why": why})


def _coll_json(r):
    text, line, chain, texts = r
    return {"call": text, "line": line, "chain": chain, "calls": texts}


def _path(e):
    """``a.b.c`` for a Name/Attribute chain, else None."""
    parts = []
    while isinstance(e, ast.Attribute):
        parts.append(e.attr)
        e = e.value
    if not isinstance(e, ast.Name):
        return None
    parts.append(e.id)
    return ".".join(reversed(parts))


def _join(a, b):
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, frozenset()) | v
    return out
