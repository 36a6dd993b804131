"""The package's index: every module parsed once, its functions and classes (``Func``, ``Cls``), the MRO."""

from __future__ import annotations

import ast
from collections import defaultdict, deque

from .package import iter_modules


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
