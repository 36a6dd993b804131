"""Target-side scan for ``repro discover``: find rank-local decision points around collectives in an engine's source.

Runs in the TARGET interpreter (the one that runs the server) as a plain script, with the standard library only: it
never imports ``repro`` nor the engine's modules (it only locates the package with ``importlib.util.find_spec``
and reads its ``.py`` files with ``ast``). Request: one JSON object on stdin (the adapter's rules, see
``scenarios/sglang/discover_rules.toml``); answer: one line ``REPRO-DISCOVER {json}`` on stdout.

What it computes (all from the AST, nothing executed):

1. **Collective-reaching functions**: a call graph over the package, resolving plain names and imports, module
   attributes, ``self.method`` (the class's MRO, plus overrides in subclasses: a call on a declared class may land
   in any subclass), ``super().method`` and ``x.method`` where the class of ``x`` is known (constructor calls,
   annotations of parameters/attributes/returns, ``self.attr = …`` in any method, keyword arguments of a class's
   constructor calls, the classes call sites pass into a function's parameters, what an unannotated function
   returns, a class a factory hands out: ``self.get_prefill_adder_class()(…)``); reading a ``@property`` is a call
   to its getter. Seeds: ``torch.distributed`` collectives, the coordinator's collective methods, object
   broadcasts. Calls that resolve to nothing in the package are listed (``unresolved``), never guessed.
2. **Guards**, per function that calls a collective-reaching function: a may-taint analysis over its statements
   (through local assignments, attribute paths such as ``batch.is_full``, and implicit flows: an assignment made
   under a tainted condition is tainted) from **rank-local sources** (pool/allocator queries matched by name,
   clocks, non-blocking polls, attributes written inside a ``Thread`` target, ``len()`` of those, ``except``
   paths, and calls of functions — or reads of properties — whose returned value depends on one: ``returners``,
   each with its innermost queries, the *leaves*, to perturb where they are read) to a branch, loop bound,
   ``break``, ``continue`` or ``return`` that changes whether, or how many times, a collective-reaching call runs
   in the same invocation — a ``break`` counts every later iteration of its loop.
   **Across calls** (issue 31): an attribute of ``self`` (or of an object reachable from it) written from a rank-local
   value in one method is a source where another method reads it (``cross-call attribute``: its leaves are the
   writes' queries); an emptiness or membership test on a per-rank container (``not self.ongoing_x``,
   ``k in self.ongoing_x``: a name the rules list, or one holding such values) is a source whose leaves are the
   methods adding to it (``container write``, at each caller); a callable stored on ``self`` (a bound method, a
   function, a ``partial``, a ``lambda``) is followed as a call.
   **Sanitizers**: results of collectives and of collective-reaching calls that return no rank-local value of
   their own (every rank agrees on them), the
   attributes named as derived from the request broadcast (e.g. the waiting queue), and the tensor an in-place
   collective reduced.

Mirrors no sglang function; written against sglang 0.5.23's layout (``sglang.srt``), but every engine name comes
from the request.
"""

from __future__ import annotations

import ast
import fnmatch
import gc
import hashlib
import importlib.util
import json
import os
import sys
import time
from collections import defaultdict, deque

MARK = "REPRO-DISCOVER "
COLL = "<collective>"
MAX_LEAVES = 96  # innermost queries kept per derived source (a getter over a wide class hierarchy names many)


# ------------------------------------------------------------------------------------------------- the package
def find_package(package, root=None):
    """(package name, folder) of the engine package: ``root`` if given, else ``find_spec`` (no import of it)."""
    if root:
        return package, os.path.abspath(root)
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {package!r} not found in {sys.executable}")
    return package, list(spec.submodule_search_locations)[0]


def iter_modules(package, folder, include, exclude):
    """(module name, path) of every ``.py`` file under ``folder`` whose module matches include and not exclude."""
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
        rel = os.path.relpath(dirpath, folder)
        parts = [package] + ([] if rel == "." else rel.split(os.sep))
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            mod = ".".join(parts if fn == "__init__.py" else parts + [fn[:-3]])
            if include and not any(mod == p or mod.startswith(p + ".") for p in include):
                continue
            if any(mod == p or mod.startswith(p + ".") for p in exclude):
                continue
            yield mod, os.path.join(dirpath, fn)


_BLOCKS = (ast.stmt, ast.excepthandler) + ((ast.match_case,) if hasattr(ast, "match_case") else ())


def _walk_statements(tree):
    """The statements of a module (and its handlers/cases), in ``ast.walk``'s breadth-first order, without
    descending into expressions (an import is a statement, and a statement's parent is always one: the same order of
    statements as a full walk at a fraction of its nodes)."""
    todo = deque([tree])
    while todo:
        n = todo.popleft()
        yield n
        for c in ast.iter_child_nodes(n):
            if isinstance(c, _BLOCKS):
                todo.append(c)


class Func:
    __slots__ = ("id", "mod", "cls", "node", "self_name", "calls", "params")

    def __init__(self, fid, mod, cls, node):
        self.id, self.mod, self.cls, self.node = fid, mod, cls, node
        args = node.args.posonlyargs + node.args.args
        self.self_name = args[0].arg if (cls and args and not _is_static(node)) else None
        self.calls = []  # (call node, frozenset of callee ids or COLL, text)
        self.params = {a.arg: a.annotation for a in args + node.args.kwonlyargs if a.annotation is not None}


class Cls:
    __slots__ = ("id", "mod", "node", "bases", "methods", "attrs", "ann", "elems", "props")

    def __init__(self, cid, mod, node):
        self.id, self.mod, self.node = cid, mod, node
        self.bases = []
        self.methods = {}
        self.props = set()  # methods read as attributes (@property, @cached_property): reading one is a call
        self.attrs = defaultdict(set)
        self.ann = {}
        self.elems = defaultdict(set)  # attr -> classes of its elements (dict values, list items), from annotations


def _is_static(node):
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)


def _is_property(node):
    """``@property`` / ``@cached_property`` / ``@functools.cached_property`` (a getter: reading it calls it)."""
    for d in node.decorator_list:
        name = d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "")
        if name in ("property", "cached_property"):
            return True
    return False


class Index:
    """Modules, classes, functions of the package and the names each module binds."""

    def __init__(self, package, folder, include, exclude):
        self.package = package
        self.mods = {}  # module -> ast
        self.paths = {}
        self.binds = defaultdict(dict)  # module -> local name -> ("mod", m) | ("obj", "m:Q") | ("ext", dotted)
        self.classes = {}
        self.funcs = {}
        self.prop_names = set()  # every property name of every class (a cheap filter before type inference)
        self.prop_fids = set()  # their getters: never a patch site (the injector wraps functions and methods)
        self.errors = []
        for mod, path in iter_modules(package, folder, include, exclude):
            try:
                with open(path, encoding="utf-8") as fh:
                    self.mods[mod] = ast.parse(fh.read(), filename=path)
                self.paths[mod] = path
            except (SyntaxError, ValueError, OSError) as e:
                self.errors.append(f"{path}: {e}")
        self.pkg_dirs = set()  # every dotted proper prefix of a module (a package folder): _is_pkg_dir's answer
        for mod in self.mods:
            parts = mod.split(".")
            for i in range(1, len(parts)):
                self.pkg_dirs.add(".".join(parts[:i]))
        for mod, tree in self.mods.items():
            self._collect(mod, tree)
        self.subclasses = defaultdict(set)
        for c in self.classes.values():
            c.bases = [b for b in (self.resolve_class_expr(c.mod, x) for x in c.node.bases) if b]
            for b in c.bases:
                self.subclasses[b].add(c.id)

    def _collect(self, mod, tree):
        pkg_of = mod if self.paths[mod].endswith("__init__.py") else mod.rsplit(".", 1)[0]
        for node in _walk_statements(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.binds[mod][a.asname] = ("mod", a.name)
                    else:
                        top = a.name.split(".")[0]
                        self.binds[mod].setdefault(top, ("mod", top))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg_of.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for a in node.names:
                    if a.name == "*":
                        continue
                    name = a.asname or a.name
                    full = f"{base}.{a.name}"
                    self.binds[mod][name] = ("mod", full) if full in self.mods or self._is_pkg_dir(full) else ("obj", f"{base}:{a.name}")
        self._defs(mod, tree.body, "", None)

    def _is_pkg_dir(self, dotted):
        return dotted in self.pkg_dirs if dotted.startswith(self.package) else False

    def _defs(self, mod, body, prefix, cls):
        for node in body:
            if isinstance(node, ast.ClassDef):
                cid = f"{mod}:{prefix}{node.name}"
                c = self.classes[cid] = Cls(cid, mod, node)
                if not prefix:
                    self.binds[mod][node.name] = ("obj", cid)
                for st in node.body:
                    if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                        c.ann[st.target.id] = st.annotation
                self._defs(mod, node.body, f"{prefix}{node.name}.", c)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                fid = f"{mod}:{prefix}{node.name}"
                self.funcs[fid] = Func(fid, mod, cls, node)
                if cls is not None:
                    cls.methods.setdefault(node.name, fid)
                    if _is_property(node):
                        cls.props.add(node.name)
                        self.prop_names.add(node.name)
                        self.prop_fids.add(fid)
                elif not prefix:
                    self.binds[mod][node.name] = ("obj", fid)
                self._defs(mod, node.body, f"{prefix}{node.name}.<locals>.", None)
            elif isinstance(node, (ast.If, ast.Try)):  # TYPE_CHECKING / optional-import blocks
                for sub in (getattr(node, "body", []), getattr(node, "orelse", []), getattr(node, "finalbody", [])):
                    self._defs(mod, sub, prefix, cls)
                for h in getattr(node, "handlers", []):
                    self._defs(mod, h.body, prefix, cls)

    # ---- names
    def lookup(self, mod, name, depth=0):
        """What ``name`` means at module level of ``mod``: ("mod", m) | ("obj", id) | ("ext", dotted) | None."""
        b = self.binds.get(mod, {}).get(name)
        if b is None:
            return None
        if b[0] == "obj" and b[1] not in self.classes and b[1] not in self.funcs and depth < 6:
            m, _, q = b[1].partition(":")
            if m in self.mods:
                inner = self.lookup(m, q, depth + 1)
                if inner is not None:
                    return inner
            return ("ext", f"{m}.{q}")
        return b

    def resolve_expr_ref(self, mod, e):
        """A Name/Attribute chain → ("mod", m) | ("obj", id) | ("ext", dotted) | None."""
        if isinstance(e, ast.Name):
            return self.lookup(mod, e.id)
        if isinstance(e, ast.Attribute):
            base = self.resolve_expr_ref(mod, e.value)
            if base is None:
                return None
            kind, v = base
            if kind == "mod":
                full = f"{v}.{e.attr}"
                if full in self.mods or self._is_pkg_dir(full):
                    return ("mod", full)
                if v in self.mods:
                    inner = self.lookup(v, e.attr)
                    if inner is not None:
                        return inner
                    oid = f"{v}:{e.attr}"
                    if oid in self.classes or oid in self.funcs:
                        return ("obj", oid)
                return ("ext", full)
            if kind == "ext":
                return ("ext", f"{v}.{e.attr}")
            if kind == "obj" and v in self.classes:
                oid = f"{v}.{e.attr}"
                if oid in self.classes or oid in self.funcs:
                    return ("obj", oid)
        return None

    def resolve_class_expr(self, mod, e):
        r = self.resolve_expr_ref(mod, e)
        return r[1] if r and r[0] == "obj" and r[1] in self.classes else None

    def ann_classes(self, mod, ann):
        """Package classes an annotation names (Optional/Union/X | None/"X"/List[X] unwrapped to X)."""
        out = set()
        if ann is None:
            return out
        if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
            try:
                ann = ast.parse(ann.value, mode="eval").body
            except SyntaxError:
                return out
        if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
            return self.ann_classes(mod, ann.left) | self.ann_classes(mod, ann.right)
        if isinstance(ann, ast.Subscript):
            head = ann.value.attr if isinstance(ann.value, ast.Attribute) else getattr(ann.value, "id", "")
            if head in ("Optional", "Union"):
                sl = ann.slice
                elts = sl.elts if isinstance(sl, ast.Tuple) else [sl]
                for x in elts:
                    out |= self.ann_classes(mod, x)
            return out
        c = self.resolve_class_expr(mod, ann)
        if c:
            out.add(c)
        return out

    def ann_elem_classes(self, mod, ann):
        """Classes of the elements an annotation's container holds: ``dict[K, V]`` → V, ``list[X]``/``deque[X]`` → X."""
        if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
            try:
                ann = ast.parse(ann.value, mode="eval").body
            except SyntaxError:
                return set()
        if not isinstance(ann, ast.Subscript):
            return set()
        head = ann.value.attr if isinstance(ann.value, ast.Attribute) else getattr(ann.value, "id", "")
        elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
        if head in ("Optional", "Union"):
            out = set()
            for x in elts:
                out |= self.ann_elem_classes(mod, x)
            return out
        if head in ("dict", "Dict", "Mapping", "MutableMapping", "OrderedDict", "defaultdict", "DefaultDict"):
            return self.ann_classes(mod, elts[-1])
        if head in ("list", "List", "deque", "Deque", "Sequence", "set", "Set", "Iterable", "frozenset"):
            return self.ann_classes(mod, elts[0])
        return set()

    def attr_elem_types(self, cid, attr):
        out = set()
        for c in self.mro(cid):
            k = self.classes[c]
            out |= k.elems.get(attr, set())
            if attr in k.ann:
                out |= self.ann_elem_classes(k.mod, k.ann[attr])
        return out

    def mro(self, cid):
        out, seen, stack = [], set(), [cid]
        while stack:
            c = stack.pop(0)
            if c in seen or c not in self.classes:
                continue
            seen.add(c)
            out.append(c)
            stack = self.classes[c].bases + stack
        return out

    def all_subclasses(self, cid):
        out, todo = set(), [cid]
        while todo:
            for s in self.subclasses.get(todo.pop(), ()):
                if s not in out:
                    out.add(s)
                    todo.append(s)
        return out

    def method_targets(self, cid, name, include_overrides=True):
        """Method ``name`` on an object declared as ``cid``: the MRO's first definition, plus every override in a
        subclass (the object may be any subclass)."""
        out = set()
        for c in self.mro(cid):
            m = self.classes[c].methods.get(name)
            if m:
                out.add(m)
                break
        if include_overrides:
            for s in self.all_subclasses(cid):
                m = self.classes[s].methods.get(name)
                if m:
                    out.add(m)
        return out

    def attr_types(self, cid, attr):
        out = set()
        for c in self.mro(cid):
            k = self.classes[c]
            out |= k.attrs.get(attr, set())
            if attr in k.ann:
                out |= self.ann_classes(k.mod, k.ann[attr])
        return out


# ---------------------------------------------------------------------------------------------- type inference
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


# --------------------------------------------------------------------------------------------- collectives
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


# ------------------------------------------------------------------------------------------------------- taint
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


# ---------------------------------------------------------------------------------------------------- driver
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


_ADD_METHODS = ("append", "extend", "add", "update", "insert", "appendleft", "put", "put_nowait", "setdefault")


def _self_attr(f, e):
    """``X`` when ``e`` is ``self.X`` (or ``self.X[…]``, ``self.X.y``) in method ``f``, else None."""
    while isinstance(e, ast.Subscript) or (isinstance(e, ast.Attribute) and isinstance(e.value, (ast.Attribute, ast.Subscript))):
        e = e.value
    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and f.self_name and e.value.id == f.self_name:
        return e.attr
    return None


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


def attr_writers(ix):
    """class id -> attribute -> methods that add to it (``self.x[k] = …``, ``self.x.append(…)``/``add``/``update``…),
    constructors left out: the writers of a per-rank container, each a place where one rank may add and another not."""
    out = defaultdict(lambda: defaultdict(set))
    for f in ix.funcs.values():
        if f.cls is None or f.self_name is None or f.node.name in ("__init__", "__post_init__"):
            continue
        for n in walk_body(f.node):
            x = None
            if isinstance(n, (ast.Assign, ast.AugAssign)):
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                    if isinstance(t, ast.Subscript):
                        x = _self_attr(f, t.value) if isinstance(t.value, ast.Attribute) else None
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _ADD_METHODS:
                v = n.func.value
                if isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name) and v.value.id == f.self_name:
                    x = v.attr
            if x:
                out[f.cls.id][x].add(f.id)
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


def scan(req):
    t0, c0 = time.time(), time.process_time()
    for table in (_BODY_NODES, _STMT_CALLS, _LOCAL_DEFS, _MATCHED, _TEXTS):  # a second scan in one process starts clean
        table.clear()
    rules = req.get("rules") or {}
    pkg, folder = find_package(req["package"], req.get("root"))
    scope = rules.get("scope", {})
    ix = Index(pkg, folder, scope.get("include", []), scope.get("exclude", []))
    t_parse, c_parse = time.time() - t0, time.process_time() - c0
    t_graph, c_graph = time.time(), time.process_time()
    types = Types(ix)
    for _ in range(int(scope.get("type_rounds", 3))):
        types.round()
    cross = bool((rules.get("sources", {}).get("options") or {}).get("cross_call", True))
    if cross:
        types.callables = stored_callables(ix, types)  # before the call graph: `self.cb()` reaches what cb holds
    reach = Reach(ix, types, rules)
    src = rules.get("sources", {})
    ctx = Ctx()
    ctx.ix, ctx.types, ctx.reach = ix, types, reach
    opts = src.get("options") or {}
    ctx.rules_src = {
        "clocks": list((src.get("clock") or {}).get("functions", [])),
        "method_kinds": [(k, list(v)) for k, v in (src.get("methods") or {}).items()],
        "containers": list(opts.get("containers", [])),
        "non_source_modules": list(opts.get("non_source_modules", ["torch", "numpy", "np", "os", "json"])),
    }
    ctx.sanitized_attrs = set((rules.get("sanitizers") or {}).get("attributes", []))
    ctx.thread_attrs = thread_attrs(ix, types) if opts.get("thread_written", True) else {}
    t_graph, c_graph = time.time() - t_graph, time.process_time() - c_graph
    t_ret, c_ret = time.time(), time.process_time()
    ctx.returners = returners(ctx, int(scope.get("return_rounds", 2)))
    t_ret, c_ret = time.time() - t_ret, time.process_time() - c_ret
    t_cross, c_cross = time.time(), time.process_time()
    ctx.attr_writers = attr_writers(ix) if cross else {}
    if cross:
        cross_call_attrs(ctx, int(scope.get("attr_rounds", 2)))
    t_cross, c_cross = time.time() - t_cross, time.process_time() - c_cross
    t_guards, c_guards = time.time(), time.process_time()
    guards = []
    only = req.get("only_functions") or []
    for f in ix.funcs.values():
        if only and not _match(f.id, only):
            continue
        if not any(reach.call_reaches(tg) for _, tg, _ in f.calls):
            continue
        g = Guards(ctx, f)
        try:
            g.run()
        except RecursionError:  # pragma: no cover - pathological nesting
            continue
        for x in g.found:
            x["caller"] = f.id
            x["file"] = ix.paths[f.mod]
            guards.append(x)
    t_guards, c_guards = time.time() - t_guards, time.process_time() - c_guards
    families = {}
    depth = {}  # site -> its class's MRO length (a base class's definition before its overrides' when folding)
    for g in guards:
        for x in g["sources"]:
            # the leaves' callers too: overrides of one caller calling the same query fold into one point
            for site in list(x["sites"]) + [y for leaf in x.get("leaves") or () for y in leaf[:2]] + [g["caller"]]:
                if site not in families:
                    families[site] = site_family(ix, site)
                    f = ix.funcs.get(site)
                    if f is not None and f.cls is not None:
                        depth[site] = len(ix.mro(f.cls.id))
    n_calls = sum(len(f.calls) for f in ix.funcs.values())
    n_unres = sum(len(v) for v in reach.unresolved.values())
    guarded_callers = {g["caller"] for g in guards}
    return {
        "package": pkg, "folder": folder, "python": sys.version.split()[0],
        "version": _version(folder),
        "modules": len(ix.mods), "classes": len(ix.classes), "functions": len(ix.funcs),
        "calls": n_calls, "unresolved_calls": n_unres,
        "reaching": len(reach.next),
        "reaching_functions": sorted(reach.next) if req.get("list_reaching") else [],
        "unresolved_in_guarded": {fid: [f"{ln}: {t}" for ln, t in reach.unresolved.get(fid, [])]
                                  for fid in sorted(guarded_callers)},
        "thread_attrs": {k: sorted(v) for k, v in ctx.thread_attrs.items()},
        "returners": len(ctx.returners),
        # what each returner returns (its patch site is perturbed accordingly: repro/discover/__init__.py)
        "return_types": {fid: return_types(ix.funcs[fid].node) for fid in sorted(ctx.returners)},
        "parse_errors": ix.errors[:20],
        "guards": guards,
        "families": families,
        "site_depth": depth,
        "cross_call_attrs": sum(len(v) for v in (getattr(ctx, "attr_src", None) or {}).values()),
        "stored_callables": sum(len(v) for v in (getattr(types, "callables", None) or {}).values()),
        # wall seconds per stage (``types``: class inference and the call graph), and the CPU seconds of each (the
        # scan is single-threaded: on a shared box its CPU time is what its wall time is on a quiet one)
        "seconds": {"parse": round(t_parse, 2), "types": round(t_graph, 2), "returners": round(t_ret, 2),
                    "cross_call": round(t_cross, 2), "guards": round(t_guards, 2), "total": round(time.time() - t0, 2)},
        "cpu_seconds": {"parse": round(c_parse, 2), "types": round(c_graph, 2), "returners": round(c_ret, 2),
                        "cross_call": round(c_cross, 2), "guards": round(c_guards, 2),
                        "total": round(time.process_time() - c0, 2)},
    }


def site_family(ix, site):
    """Other definitions of a method site's name in its class hierarchy (the classes a model may build instead)."""
    f = ix.funcs.get(site)
    if f is None or f.cls is None:
        return []
    name = f.node.name
    roots = [c for c in ix.mro(f.cls.id) if name in ix.classes[c].methods]
    out = set()
    for r in roots or [f.cls.id]:
        for c in {r} | ix.all_subclasses(r):
            m = ix.classes[c].methods.get(name)
            if m and m != site:
                out.add(m)
    return sorted(out)


def _version(folder):
    for name in ("version.py", "_version.py"):
        p = os.path.join(folder, name)
        if os.path.isfile(p):
            try:
                tree = ast.parse(open(p, encoding="utf-8").read())
            except SyntaxError:
                continue
            for n in ast.walk(tree):
                if isinstance(n, ast.Assign) and any(getattr(t, "id", "") in ("__version__", "version") for t in n.targets):
                    if isinstance(n.value, ast.Constant) and isinstance(n.value.value, str):
                        return n.value.value
    return None


def fingerprint(req):
    """A key for the scan's answer: the request, this script, the Python version and every scanned file's size and
    mtime (a changed, added or removed file changes it)."""
    rules = req.get("rules") or {}
    pkg, folder = find_package(req["package"], req.get("root"))
    scope = rules.get("scope", {})
    h = hashlib.sha256()
    h.update(json.dumps(req, sort_keys=True).encode())
    h.update(open(__file__, "rb").read())
    h.update(sys.version.encode())
    for mod, path in iter_modules(pkg, folder, scope.get("include", []), scope.get("exclude", [])):
        st = os.stat(path)
        h.update(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


def main():
    req = json.loads(sys.stdin.read())
    # the scan builds millions of AST nodes and frees none until it ends: the cyclic collector's passes over them
    # found nothing to free and cost seconds (issue 31). Off for this process (a script run once per scan).
    gc.disable()
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    cache = req.get("cache_dir")
    key = path = None
    if cache:
        key = fingerprint(req)
        path = os.path.join(cache, f"scan-{key}.json")
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as fh:
                    out = json.load(fh)
                out["cached"] = path
                sys.stdout.write(MARK + json.dumps(out) + "\n")
                return
            except (OSError, ValueError):
                pass
    out = scan(req)
    if path:
        try:
            os.makedirs(cache, exist_ok=True)
            tmp = path + f".{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(out, fh)
            os.replace(tmp, path)
        except OSError:
            pass
    sys.stdout.write(MARK + json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
    # the answer is written; freeing the trees one by one at exit took longer than a parse pass
    sys.stdout.flush()
    os._exit(0)
