"""Which class a value is (``Types``: constructor calls, annotations, attribute writes, arguments, returns) and what a
function returns (``return_types``)."""

from __future__ import annotations

import ast
from collections import defaultdict

from .walk import local_defs, walk_body


class Types:
    """Flow-insensitive class inference for locals and attributes (iterated a few rounds to a rough fixpoint)."""

    def __init__(self, ix):
        self.ix = ix
        self.envs = {}
        self.ret_cache = {}

    def env(self, f):
        e = self.envs.get(f.id)
        if e is None:
            e = self.envs[f.id] = defaultdict(set)
            for p, ann in f.params.items():
                e[p] |= self.ix.ann_classes(f.mod, ann)
        return e

    def of(self, f, e, depth=0):
        ix = self.ix
        if depth > 4 or e is None:
            return set()
        if isinstance(e, ast.Name):
            if f.self_name and e.id == f.self_name and f.cls is not None:
                return {f.cls.id}
            got = set(self.env(f).get(e.id, ()))
            return got
        if isinstance(e, ast.Attribute):
            if isinstance(e.value, ast.Name) and f.self_name and e.value.id == f.self_name and f.cls is not None:
                out = set(ix.attr_types(f.cls.id, e.attr))
            else:
                out = set()
                for t in self.of(f, e.value, depth + 1):
                    out |= ix.attr_types(t, e.attr)
            for g in self.prop_targets(f, e, depth + 1):  # a property: the class its getter's annotation names
                out |= ix.ann_classes(ix.funcs[g].mod, ix.funcs[g].node.returns)
            return out
        if isinstance(e, ast.Call):
            out = set()
            fn = e.func
            if isinstance(fn, ast.Attribute) and fn.attr in ("get", "pop", "setdefault") and isinstance(fn.value, ast.Attribute) \
                    and isinstance(fn.value.value, ast.Name) and f.self_name and fn.value.value.id == f.self_name and f.cls is not None:
                out |= ix.attr_elem_types(f.cls.id, fn.value.attr)
            for tgt in self.callees(f, e, with_overrides=False):
                if tgt in ix.classes:
                    out.add(tgt)
                elif tgt in ix.funcs:
                    g = ix.funcs[tgt]
                    got = ix.ann_classes(g.mod, g.node.returns)
                    out |= got if got or g.node.returns is not None else self.returned_classes(g, depth + 1)
            return out
        if isinstance(e, ast.Subscript):  # self.d[k] → the element classes the annotation of self.d names
            v = e.value
            if isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name) and f.self_name and v.value.id == f.self_name \
                    and f.cls is not None:
                return ix.attr_elem_types(f.cls.id, v.attr)
            return set()
        if isinstance(e, ast.IfExp):
            return self.of(f, e.body, depth + 1) | self.of(f, e.orelse, depth + 1)
        if isinstance(e, ast.BoolOp):
            out = set()
            for v in e.values:
                out |= self.of(f, v, depth + 1)
            return out
        if isinstance(e, ast.NamedExpr):
            return self.of(f, e.value, depth + 1)
        return set()

    def returned_classes(self, g, depth):
        """Classes an unannotated function returns, from its ``return`` expressions (a factory such as
        ``allocator.create_prefill_budget(...)`` returning ``PrefillBudget(...)``); cached per round."""
        got = self.ret_cache.get(g.id)
        if got is not None:
            return got
        self.ret_cache[g.id] = set()  # a recursive factory returns what its other returns give
        out = set()
        for n in walk_body(g.node):
            if isinstance(n, ast.Return) and n.value is not None:
                out |= self.of(g, n.value, depth)
        self.ret_cache[g.id] = out
        return out

    def prop_targets(self, f, e, depth=0):
        """The property getters ``x.attr`` (an Attribute read) may run, ``x``'s class known: the MRO's first
        definition, plus overrides in subclasses; empty when ``attr`` is no property of a known class."""
        ix = self.ix
        if not isinstance(e, ast.Attribute) or e.attr not in ix.prop_names or not isinstance(e.ctx, ast.Load):
            return set()
        out = set()
        for c in self.of(f, e.value, depth):
            for k in ix.mro(c):
                kc = ix.classes[k]
                if e.attr in kc.methods:
                    if e.attr in kc.props:
                        out.add(kc.methods[e.attr])
                    break
            for sub in ix.all_subclasses(c):
                sc = ix.classes[sub]
                if e.attr in sc.props:
                    out.add(sc.methods[e.attr])
        return out

    def class_objects(self, f, call):
        """Classes a call returns as class objects (``self.get_prefill_adder_class()`` annotated
        ``-> type[PrefillAdder]`` or returning ``PrefillAdder``): calling its result constructs one."""
        ix = self.ix
        out = set()
        for tgt in self.callees(f, call, with_overrides=True):
            g = ix.funcs.get(tgt)
            if g is None:
                continue
            ann = g.node.returns
            if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
                try:
                    ann = ast.parse(ann.value, mode="eval").body
                except SyntaxError:
                    ann = None
            if isinstance(ann, ast.Subscript):
                head = ann.value.attr if isinstance(ann.value, ast.Attribute) else getattr(ann.value, "id", "")
                if head in ("type", "Type"):
                    out |= ix.ann_classes(g.mod, ann.slice)
            for n in walk_body(g.node):
                if isinstance(n, ast.Return) and n.value is not None:
                    c = ix.resolve_class_expr(g.mod, n.value)
                    if c:
                        out.add(c)
        return out

    def callees(self, f, call, with_overrides=True):
        """Package callees of ``call`` (function ids, class ids for constructors); COLL for a torch collective;
        empty when nothing resolved."""
        ix = self.ix
        fn = call.func
        out = set()
        if isinstance(fn, ast.Call):  # factory()(…): the class the factory hands out
            return self.class_objects(f, fn)
        if isinstance(fn, ast.Name):
            if fn.id in local_defs(f):
                return {local_defs(f)[fn.id]}
            r = ix.lookup(f.mod, fn.id)
            if r and r[0] == "obj":
                out.add(r[1])
            elif r and r[0] == "ext":
                out.add("ext:" + r[1])
            return out
        if not isinstance(fn, ast.Attribute):
            return out
        name = fn.attr
        v = fn.value
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super" and f.cls is not None:
            for c in ix.mro(f.cls.id)[1:]:
                m = ix.classes[c].methods.get(name)
                if m:
                    return {m}
            return out
        if isinstance(v, ast.Name) and f.self_name and v.id == f.self_name and f.cls is not None:
            got = ix.method_targets(f.cls.id, name, with_overrides)
            return got or self.stored_callables(f.cls.id, name)
        ref = ix.resolve_expr_ref(f.mod, v) if not (isinstance(v, ast.Name) and v.id in self.env(f)) else None
        if ref and ref[0] == "mod":
            r = ix.lookup(ref[1], name) if ref[1] in ix.mods else None
            if r and r[0] == "obj":
                return {r[1]}
            return {f"ext:{ref[1]}.{name}"}
        if ref and ref[0] == "ext":
            return {f"ext:{ref[1]}.{name}"}
        if ref and ref[0] == "obj" and ref[1] in ix.classes:
            return ix.method_targets(ref[1], name, False)
        for t in self.of(f, v):
            out |= ix.method_targets(t, name, with_overrides) or self.stored_callables(t, name)
        return out

    def stored_callables(self, cid, name):
        """Functions a callable attribute ``name`` of class ``cid`` (or a base) may hold (``self.on_done = self._sync``,
        ``= helper``, ``= functools.partial(helper, …)``, ``= lambda: self._sync()``, a nested ``def``): calling
        ``obj.name(…)`` calls them (:func:`stored_callables`)."""
        table = getattr(self, "callables", None)
        if not table:
            return set()
        out = set()
        for c in self.ix.mro(cid):
            out |= table.get(c, {}).get(name, set())
        return out

    def round(self):
        """One pass over every function: local variable classes, ``self.attr`` classes, constructor keywords,
        parameter classes from call sites."""
        ix = self.ix
        self.ret_cache = {}
        for f in ix.funcs.values():
            env = self.env(f)
            for node in walk_body(f.node):
                if isinstance(node, (ast.Assign, ast.AnnAssign)):
                    val = node.value
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    ts = self.of(f, val) if val is not None else set()
                    if isinstance(node, ast.AnnAssign):
                        ts = ts | ix.ann_classes(f.mod, node.annotation)
                        t0 = node.target
                        if (isinstance(t0, ast.Attribute) and isinstance(t0.value, ast.Name) and f.self_name
                                and t0.value.id == f.self_name and f.cls is not None):
                            f.cls.elems[t0.attr] |= ix.ann_elem_classes(f.mod, node.annotation)
                    if not ts:
                        continue
                    for t in targets:
                        if isinstance(t, ast.Name):
                            env[t.id] |= ts
                        elif (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and f.self_name
                              and t.value.id == f.self_name and f.cls is not None):
                            f.cls.attrs[t.attr] |= ts
                elif isinstance(node, ast.Call) and (node.args or node.keywords):
                    for c in self.callees(f, node, with_overrides=False):
                        if c in ix.classes:
                            for kw in node.keywords:
                                if kw.arg:
                                    ts = self.of(f, kw.value)
                                    if ts:
                                        ix.classes[c].attrs[kw.arg] |= ts
                        self.bind_args(f, node, c)


    def bind_args(self, f, call, target):
        """Parameter classes from a call site: the classes of ``call``'s arguments flow into the parameters of the
        function (or constructor) it resolves to, so ``self.cache = cache`` in an unannotated ``__init__`` learns the
        class its callers pass."""
        ix = self.ix
        if target in ix.classes:
            targets = ix.method_targets(target, "__init__", False)
        elif target in ix.funcs:
            targets = {target}
        else:
            return
        for gid in targets:
            g = ix.funcs[gid]
            a = g.node.args
            names = [x.arg for x in a.posonlyargs + a.args]
            if g.self_name is not None and names:
                names = names[1:]  # bound: self is not among the call's arguments
            env = None
            for i, arg in enumerate(call.args):
                if isinstance(arg, ast.Starred) or i >= len(names):
                    break
                ts = self.of(f, arg)
                if ts:
                    env = env if env is not None else self.env(g)
                    env[names[i]] |= ts
            kw_ok = set(names) | {x.arg for x in a.kwonlyargs}
            for kw in call.keywords:
                if kw.arg and kw.arg in kw_ok:
                    ts = self.of(f, kw.value)
                    if ts:
                        env = env if env is not None else self.env(g)
                        env[kw.arg] |= ts


_NUMBER_NAMES = {"int", "float", "complex"}


# annotations of a container an empty one can stand in for (a tuple is a fixed shape: it is an object)
_CONTAINER_NAMES = {"list", "List", "Sequence", "MutableSequence", "set", "Set", "frozenset", "FrozenSet", "deque",
                    "Deque", "Iterable", "Collection"}


_NUMBER_CALLS = {"len", "int", "float", "min", "max", "sum", "abs", "round"}


def _ann_types(a):
    """Return types named by an annotation: a subset of {"none", "bool", "number", "container", "object"}
    (``Optional[X]``, ``X | None``, ``Union[…]``, string annotations included)."""
    if a is None:
        return set()
    if isinstance(a, ast.Constant):
        if a.value is None:
            return {"none"}
        if isinstance(a.value, str):
            try:
                return _ann_types(ast.parse(a.value, mode="eval").body)
            except SyntaxError:
                return {"object"}
        return {"object"}
    if isinstance(a, ast.BinOp) and isinstance(a.op, ast.BitOr):
        return _ann_types(a.left) | _ann_types(a.right)
    if isinstance(a, ast.Subscript):
        head = a.value.attr if isinstance(a.value, ast.Attribute) else getattr(a.value, "id", "")
        if head in ("Optional", "Union"):
            sl = a.slice
            parts = sl.elts if isinstance(sl, ast.Tuple) else [sl]
            out = {"none"} if head == "Optional" else set()
            for x in parts:
                out |= _ann_types(x)
            return out
        return {"container"} if head in _CONTAINER_NAMES else {"object"}
    name = a.attr if isinstance(a, ast.Attribute) else getattr(a, "id", "")
    if name == "None":
        return {"none"}
    if name == "bool":
        return {"bool"}
    if name in _NUMBER_NAMES:
        return {"number"}
    return {"container"} if name in _CONTAINER_NAMES else {"object"}


def _value_type(v):
    """The type of a returned expression as far as its syntax tells: "none", "bool", "number", "container" (a list
    or set display, a comprehension, a slice), "object" (a tuple, a dict, a class called: a capitalised name), or
    "unknown" (another call, a name, an attribute)."""
    if v is None or (isinstance(v, ast.Constant) and v.value is None):
        return "none"
    if isinstance(v, ast.Constant):
        if isinstance(v.value, bool):
            return "bool"
        return "number" if isinstance(v.value, (int, float)) else "object"
    if isinstance(v, (ast.Compare, ast.BoolOp)) or (isinstance(v, ast.UnaryOp) and isinstance(v.op, ast.Not)):
        return "bool"
    if isinstance(v, (ast.BinOp, ast.UnaryOp)):
        return "number"
    if isinstance(v, (ast.List, ast.Set, ast.ListComp, ast.SetComp)):
        return "container"
    if isinstance(v, (ast.Tuple, ast.Dict, ast.DictComp, ast.JoinedStr)):
        return "object"
    if isinstance(v, ast.Call):
        fn = v.func.attr if isinstance(v.func, ast.Attribute) else getattr(v.func, "id", "")
        if fn in _NUMBER_CALLS:
            return "number"
        if fn == "bool":
            return "bool"
        if fn[:1].isupper():
            return "object"
    if isinstance(v, ast.Subscript) and isinstance(v.slice, ast.Slice):
        return "container"  # a slice of a list
    if isinstance(v, ast.IfExp):
        a, b = _value_type(v.body), _value_type(v.orelse)
        return a if a == b else "unknown"
    return "unknown"


def return_types(fnode):
    """What a function returns, for the perturbation that fits it: the annotation's types, plus "none" for a bare
    ``return`` or ``return None``; without an annotation, the types of the returned expressions ("unknown" among
    them when one is another call's result). A sorted list of words."""
    out = _ann_types(fnode.returns)
    seen_value = set()
    for n in walk_body(fnode):
        if isinstance(n, ast.Return):
            seen_value.add(_value_type(n.value))
    if out:
        if "none" in seen_value:
            out.add("none")
        return sorted(out)
    return sorted(seen_value)
