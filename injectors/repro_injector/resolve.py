"""Site strings and their resolution, shared by the live injector and the ``repro sites`` preflight.

A site is ``package.module:Class.method`` (a class attribute; nested classes allowed) or ``package.module:function``
(a module attribute). ``resolve_in_module`` looks the attribute path up in an already imported module and says how
to patch it. ``preflight`` (run as ``python -c "...preflight_main()"`` in the target interpreter, never in the
harness) imports each module, falls back to reading the source with ``ast`` when the import itself fails, and lists
nearest names with ``difflib`` when something is missing. Stdlib only.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

_GLOB = set("*?[")


def split_site(site: str) -> Tuple[str, List[str]]:
    """``'a.b:C.m'`` -> ``('a.b', ['C', 'm'])``. Raises ValueError naming the expected shape."""
    if ":" not in site:
        raise ValueError(f"site {site!r} must look like 'package.module:Class.method' or 'package.module:function'")
    mod, _, path = site.partition(":")
    parts = path.split(".")
    if not mod or not all(parts):
        raise ValueError(f"site {site!r} must look like 'package.module:Class.method' or 'package.module:function'")
    return mod, parts


class Target:
    """Where a resolved site lives: ``owner`` (class or module), attribute ``name``, the raw attribute and its kind.

    ``kind`` is ``function`` (plain function on a class: called with self), ``staticmethod``, ``classmethod``,
    ``module_function`` (module attribute), or ``callable`` (another callable class attribute, called as is).
    """

    def __init__(self, site: str, owner: Any, name: str, raw: Any, kind: str) -> None:
        self.site, self.owner, self.name, self.raw, self.kind = site, owner, name, raw, kind


def resolve_in_module(module: Any, site: str) -> Target:
    """Resolve ``site`` inside the imported ``module``.

    Raises:
        AttributeError: a part of the path is missing (message names the part and the owner).
        TypeError: the attribute is not something the injector can wrap (e.g. a property).
    """
    _, parts = split_site(site)
    owner: Any = module
    for p in parts[:-1]:
        if not hasattr(owner, p):
            raise AttributeError(f"{getattr(owner, '__name__', owner)!s} has no attribute {p!r}")
        owner = getattr(owner, p)
    name = parts[-1]
    if isinstance(owner, type):
        raw = None
        for klass in owner.__mro__:
            if name in klass.__dict__:
                raw = klass.__dict__[name]
                break
        else:
            raise AttributeError(f"class {owner.__qualname__} has no attribute {name!r}")
        if isinstance(raw, staticmethod):
            return Target(site, owner, name, raw, "staticmethod")
        if isinstance(raw, classmethod):
            return Target(site, owner, name, raw, "classmethod")
        if isinstance(raw, property):
            raise TypeError(f"{owner.__qualname__}.{name} is a property; sites must be methods or functions")
        if hasattr(raw, "__get__") and hasattr(raw, "__code__"):
            return Target(site, owner, name, raw, "function")
        if callable(raw):
            return Target(site, owner, name, raw, "callable")
        raise TypeError(f"{owner.__qualname__}.{name} is not callable ({type(raw).__name__})")
    if not hasattr(owner, name):
        raise AttributeError(f"{getattr(owner, '__name__', owner)!s} has no attribute {name!r}")
    raw = getattr(owner, name)
    if not callable(raw):
        raise TypeError(f"{site} is not callable ({type(raw).__name__})")
    if isinstance(owner, type(sys)):
        return Target(site, owner, name, raw, "module_function")
    return Target(site, owner, name, raw, "callable")


# ----------------------------------------------------------------------------------------------------------------
# preflight (target interpreter, no server)


def _names_in_module(module: Any) -> List[str]:
    out: List[str] = []
    for k, v in list(vars(module).items()):
        if k.startswith("__"):
            continue
        out.append(k)
        if isinstance(v, type) and getattr(v, "__module__", None) == module.__name__:
            out.extend(f"{k}.{m}" for m in dir(v) if not m.startswith("__"))
    return out


class _Index:
    """What one source file defines, read with ``ast`` (nothing executed).

    Attributes:
        classes: class qualname -> own member names (methods, nested classes, assignments, also those assigned
            later at module level as ``Class.name = ...``).
        bases: class qualname -> base expressions (``object`` left out).
        top: top-level names (defined, assigned or imported).
        imports: name -> (absolute module, attribute) it is imported from (``from m import a as name``).
        star: a name may be bound in a way this index cannot see (``import *``, ``globals()``, a loop at top level).
        dynamic: classes whose members may be added at run time (a class decorator other than dataclass, a
            ``setattr`` call at top level, statements in the class body this index does not read).
    """

    def __init__(self) -> None:
        self.classes: Dict[str, List[str]] = {}
        self.bases: Dict[str, List[str]] = {}
        self.top: set = set()
        self.imports: Dict[str, Tuple[str, str]] = {}
        self.star = False
        self.dynamic: set = set()
        self.setattr_anywhere = False


@functools.lru_cache(maxsize=512)
def _static_index(path: str, modname: str = "") -> Optional[_Index]:
    """Index ``path`` (the source of ``modname``, which resolves relative imports); None when it cannot be parsed."""
    import ast

    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), filename=path)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    ix = _Index()
    pkg = modname if path.endswith("__init__.py") else modname.rpartition(".")[0]
    plain_decorators = ("dataclass", "dataclasses.dataclass", "final", "typing.final", "total_ordering",
                        "functools.total_ordering")

    def targets_of(node: Any) -> List[Any]:
        return list(node.targets) if isinstance(node, ast.Assign) else [node.target]

    def visit_class(node: Any, prefix: str) -> None:
        q = prefix + node.name
        members: List[str] = []

        def body(stmts: List[Any]) -> None:
            for b in stmts:
                if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members.append(b.name)
                elif isinstance(b, ast.ClassDef):
                    members.append(b.name)
                    visit_class(b, q + ".")
                elif isinstance(b, (ast.Assign, ast.AnnAssign)):
                    for t in targets_of(b):
                        if isinstance(t, ast.Name):
                            members.append(t.id)
                        elif isinstance(t, (ast.Tuple, ast.List)):
                            members.extend(e.id for e in t.elts if isinstance(e, ast.Name))
                elif isinstance(b, (ast.If, ast.Try)):
                    body(list(b.body) + list(b.orelse) + list(getattr(b, "finalbody", [])))
                    for h in getattr(b, "handlers", []) or []:
                        body(list(h.body))
                elif isinstance(b, (ast.Expr, ast.Pass)):
                    pass
                else:  # a loop, a with, an exec in the class body: members this index cannot list
                    ix.dynamic.add(q)

        body(list(node.body))
        ix.classes[q] = members
        ix.bases[q] = [ast.unparse(x) for x in node.bases if ast.unparse(x) != "object"]
        if any(ast.unparse(d).split("(", 1)[0] not in plain_decorators for d in node.decorator_list):
            ix.dynamic.add(q)

    def handle(node: Any) -> None:
        if isinstance(node, ast.ClassDef):
            ix.top.add(node.name)
            visit_class(node, "")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            ix.top.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in targets_of(node):
                if isinstance(t, ast.Name):
                    ix.top.add(t.id)
                    if t.id in ix.classes:  # Class = wrap(Class): the live class may have more members
                        ix.dynamic.add(t.id)
                elif isinstance(t, (ast.Tuple, ast.List)):
                    ix.top.update(e.id for e in t.elts if isinstance(e, ast.Name))
                elif isinstance(t, ast.Attribute):  # Class.name = ... after the class: a member all the same
                    owner = ast.unparse(t.value)
                    if owner in ix.classes:
                        ix.classes[owner].append(t.attr)
                    else:
                        ix.dynamic.add(owner)
        elif isinstance(node, ast.Import):
            for a in node.names:
                ix.top.add((a.asname or a.name).split(".")[0])
                if a.asname:
                    ix.imports.setdefault(a.asname, (a.name, ""))
        elif isinstance(node, ast.ImportFrom):
            src = node.module or ""
            if node.level:
                parts = pkg.split(".") if pkg else []
                base = parts[: len(parts) - (node.level - 1)] if node.level - 1 <= len(parts) else []
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
        elif isinstance(node, ast.Expr):
            if isinstance(node.value, ast.Call) and ast.unparse(node.value.func) in ("setattr", "builtins.setattr"):
                ix.setattr_anywhere = True
        elif isinstance(node, ast.Pass):
            pass
        else:  # anything else that could bind names at import time (a for loop, exec, del)
            ix.star = True

    for node in tree.body:
        handle(node)
    return ix


@functools.lru_cache(maxsize=1024)
def find_source(modname: str) -> Tuple[Optional[str], str]:
    """Locate ``modname``'s source file on this interpreter's path WITHOUT importing it or its packages.

    Returns:
        ``(path, "source")`` (a ``.py`` file, or a package's ``__init__.py``), ``(None, "absent")`` when the
        module definitely does not exist (its top-level package is unknown to every finder, or its parent
        package's folders hold no such module and the parent's ``__init__.py`` does not touch ``__path__``), or
        ``(None, "undecided")`` (a compiled or namespace module, a finder this cannot follow).
    """
    from importlib.machinery import BYTECODE_SUFFIXES, EXTENSION_SUFFIXES

    parts = modname.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])  # a top-level name: no package is executed
    except Exception:
        return None, "undecided"
    if spec is None:
        return None, "absent"
    origin: Optional[str] = spec.origin if spec.has_location else None
    locations = list(spec.submodule_search_locations or [])
    for i in range(1, len(parts)):
        if not locations:  # a plain module has no submodules
            return (None, "absent") if origin and origin.endswith(".py") else (None, "undecided")
        name = parts[i]
        found: Optional[str] = None
        namespace: List[str] = []
        for d in locations:
            if os.path.isfile(os.path.join(d, name, "__init__.py")):
                found = os.path.join(d, name, "__init__.py")
                break
            if os.path.isfile(os.path.join(d, name + ".py")):
                found = os.path.join(d, name + ".py")
                break
            if any(os.path.exists(os.path.join(d, name + sfx)) for sfx in [*EXTENSION_SUFFIXES, *BYTECODE_SUFFIXES]):
                return None, "undecided"  # compiled: no source to read
            if os.path.isdir(os.path.join(d, name)):
                namespace.append(os.path.join(d, name))
        if found is None and not namespace:
            text = ""
            if origin and origin.endswith("__init__.py"):
                try:
                    with open(origin, encoding="utf-8") as fh:
                        text = fh.read()
                except (OSError, UnicodeDecodeError):
                    return None, "undecided"
            if any(k in text for k in ("__path__", "sys.modules", "__getattr__")):
                return None, "undecided"  # a package that extends its path or makes submodules up at import
            return None, "absent"
        if found is not None:
            origin = found
            locations = [os.path.dirname(found)] if found.endswith("__init__.py") else []
        else:  # a namespace package: every folder of that name counts
            origin, locations = None, namespace
    if origin and origin.endswith(".py") and os.path.exists(origin):
        return origin, "source"
    return None, "undecided"


def _sibling_names(modname: str) -> List[str]:
    """Modules beside ``modname`` in its parent package, found without importing anything."""
    import pkgutil

    parent, _, _ = modname.rpartition(".")
    if not parent:
        return []
    path, state = find_source(parent)
    if path is None or not path.endswith("__init__.py"):
        return []
    return [f"{parent}.{m.name}" for m in pkgutil.iter_modules([os.path.dirname(path)])]


def _has_member(modname: str, cls: str, name: str, depth: int = 0) -> Optional[bool]:
    """Does class ``cls`` of ``modname`` define or inherit ``name``, by its source? None when the source cannot tell
    (a base this cannot follow, a class whose members are made at run time)."""
    if depth > 8:
        return None
    path, state = find_source(modname)
    if path is None:
        return False if state == "absent" else None
    ix = _static_index(path, modname)
    if ix is None:
        return None
    if cls not in ix.classes:
        head = cls.split(".", 1)[0]
        if head in ix.imports:  # re-exported from elsewhere
            mod, attr = ix.imports[head]
            rest = cls.split(".", 1)[1:]
            return _has_member(mod, ".".join([attr, *rest]), name, depth + 1) if attr else None
        return None
    if name in ix.classes[cls]:
        return True
    if cls in ix.dynamic or ix.setattr_anywhere:
        return None
    verdicts: List[Optional[bool]] = []
    for b in ix.bases.get(cls, []):
        head = b.split("[", 1)[0]
        if head in ("Generic", "Protocol", "ABC", "typing.Generic", "typing.Protocol", "abc.ABC"):
            continue
        if head in ix.classes:
            verdicts.append(_has_member(modname, head, name, depth + 1))
        elif head.split(".", 1)[0] in ix.imports:
            mod, attr = ix.imports[head.split(".", 1)[0]]
            rest = head.split(".", 1)[1:]
            if attr:
                verdicts.append(_has_member(mod, ".".join([attr, *rest]), name, depth + 1))
            elif rest:  # import pkg.mod as m; class C(m.Base)
                sub = rest[0].rsplit(".", 1)
                verdicts.append(_has_member(".".join([mod, *sub[:-1]]), sub[-1], name, depth + 1))
            else:
                return None
        else:
            return None  # a base this check cannot follow (a call, a builtin, a name made at run time)
    if any(v is True for v in verdicts):
        return True
    return None if any(v is None for v in verdicts) else False


def check_site_source(site: str, import_error: str = "") -> Dict[str, Any]:
    """Resolve one site from the source of its module, importing nothing (the preflight before a launch, and
    :func:`check_site`'s fallback when the module's import fails). Never raises.

    A site is ``absent`` only when the source shows it cannot exist: the module is missing, or the owner class is
    defined there and neither it nor any base (followed through the sources) has the name, or the module defines
    no such top-level name. What the source cannot decide (a compiled module, a base that is a call, members made
    at run time) is ``unverified``; the launched server's injector decides it.

    Returns:
        ``{site, status, detail, suggestions, static: True}`` as :func:`check_site`.
    """
    res: Dict[str, Any] = {"site": site, "status": "error", "detail": "", "suggestions": [], "static": True}
    failed = f" (import failed: {import_error})" if import_error else ""
    try:
        modname, parts = split_site(site)
    except ValueError as e:
        res["detail"] = str(e)
        return res
    try:
        path, state = find_source(modname)
        if state == "absent":
            res.update(status="absent", detail=f"module {modname} does not exist in this installation",
                       suggestions=_suggest(modname, _sibling_names(modname)))
            return res
        ix = _static_index(path, modname) if path else None
        if ix is None:
            res.update(status="unverified", detail=f"the source of {modname} is not readable here{failed}")
            return res
        qual = ".".join(parts)
        owner, name = ".".join(parts[:-1]), parts[-1]
        near = _suggest(qual, sorted(ix.top) + [f"{c}.{m}" for c, ms in ix.classes.items() for m in ms])
        if not owner:
            if name in ix.top:
                res.update(status="resolved", detail=f"found in {path}{failed}")
            elif ix.star or "__getattr__" in ix.top:  # a module __getattr__ (PEP 562) makes names up at run time
                res.update(status="unverified", detail=f"{path} may bind {name!r} at import{failed}")
            else:
                res.update(status="absent", detail=f"{qual} is not defined in {path}{failed}", suggestions=near)
            return res
        if owner in ix.classes or parts[0] in ix.imports:
            has = _has_member(modname, owner, name)
            if has is True:
                res.update(status="resolved", detail=f"found in source{failed}")
            elif has is False:
                res.update(status="absent", detail=f"{owner} defines no {name!r} and none of its base classes does "
                                                   f"({path}){failed}", suggestions=near)
            else:
                res.update(status="unverified", detail=f"{owner} exists but {name!r} is not in its source (an "
                                                       f"inherited or run-time member?){failed}")
            return res
        if parts[0] in ix.top or ix.star:
            res.update(status="unverified", detail=f"{parts[0]} in {path} is not a class this can read{failed}")
        else:
            res.update(status="absent", detail=f"class {owner} is not defined in {path}{failed}", suggestions=near)
        return res
    except Exception as e:  # a check that cannot decide never blocks
        res.update(status="unverified", detail=f"source check failed: {type(e).__name__}: {e}")
        return res


def _suggest(wanted: str, candidates: List[str], n: int = 5) -> List[str]:
    import difflib

    cands = sorted(set(candidates))
    out = difflib.get_close_matches(wanted, cands, n=n, cutoff=0.55)
    last = wanted.rsplit(".", 1)[-1]
    if len(out) < n:  # also match on the last component alone (a method that moved to another class)
        by_last = {c: c.rsplit(".", 1)[-1] for c in cands}
        for m in difflib.get_close_matches(last, sorted(set(by_last.values())), n=n, cutoff=0.7):
            out.extend(c for c, l in by_last.items() if l == m and c not in out)
    return out[:n]


def _sibling_modules(modname: str) -> List[str]:
    import pkgutil

    parent, _, _ = modname.rpartition(".")
    if not parent:
        return []
    try:
        pkg = importlib.import_module(parent)
    except Exception:
        return []
    return [f"{parent}.{m.name}" for m in pkgutil.iter_modules(getattr(pkg, "__path__", []))]


def check_site(site: str) -> Dict[str, Any]:
    """Resolve one site string in this interpreter (importing its module). Never raises.

    Returns:
        ``{site, status, detail, suggestions, static}`` with status ``resolved``, ``absent`` (module or attribute
        missing; ``suggestions`` lists the nearest existing names), ``unverified`` (the module exists but could not
        be imported and the source does not show the attribute directly, e.g. it is inherited) or ``error``.
    """
    res: Dict[str, Any] = {"site": site, "status": "error", "detail": "", "suggestions": [], "static": False}
    try:
        modname, parts = split_site(site)
    except ValueError as e:
        res["detail"] = str(e)
        return res
    try:
        spec = importlib.util.find_spec(modname)
    except Exception as e:  # a parent package is missing or broken
        spec = None
        res["detail"] = f"cannot look up module {modname}: {type(e).__name__}: {e}"
    if spec is None:
        res["status"] = "absent"
        res["detail"] = res["detail"] or f"module {modname} does not exist in this installation"
        res["suggestions"] = _suggest(modname, _sibling_modules(modname))
        return res
    try:
        module = importlib.import_module(modname)
    except Exception as e:
        import_err = f"{type(e).__name__}: {e}"
        origin = getattr(spec, "origin", None)
        if not origin or not origin.endswith(".py") or not os.path.exists(origin):
            res["detail"] = f"import of {modname} failed ({import_err}) and its source is not readable"
            return res
        return check_site_source(site, import_err)
    try:
        t = resolve_in_module(module, site)
        res["status"] = "resolved"
        res["detail"] = f"{t.kind} in {getattr(t.owner, '__qualname__', getattr(t.owner, '__name__', ''))}"
    except (AttributeError, TypeError) as e:
        res["status"] = "absent"
        res["detail"] = str(e)
        res["suggestions"] = _suggest(".".join(parts), _names_in_module(module))
    return res


def check_pattern(pattern: str) -> Dict[str, Any]:
    """Check a gate frame pattern: exact ``module:qual`` patterns are resolved like sites; globs are not checked."""
    if ":" not in pattern or any(c in pattern for c in _GLOB):
        return {"pattern": pattern, "status": "unchecked", "detail": "glob or module-less pattern", "suggestions": []}
    r = check_site(pattern)
    return {"pattern": pattern, "status": r["status"], "detail": r["detail"], "suggestions": r["suggestions"]}


def check_method(site: str, method: str) -> Dict[str, Any]:
    """Does the class of a resolved ``module:Class.method`` site also have attribute path ``method``?"""
    try:
        modname, parts = split_site(site)
        module = importlib.import_module(modname)
        owner: Any = module
        for p in parts[:-1]:
            owner = getattr(owner, p)
        obj = owner
        for p in method.split("."):
            obj = getattr(obj, p)
        return {"method": method, "status": "resolved", "detail": ""}
    except Exception as e:
        return {"method": method, "status": "absent", "detail": f"{type(e).__name__}: {e}"}


def _version(dist: str) -> Optional[str]:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return None


def preflight(request: Dict[str, Any]) -> Dict[str, Any]:
    """Answer a ``repro sites`` request, or the check before a launch (``"mode": "source"``).

    Args:
        request: ``{"mode": "import" | "source", "versions": [distribution...], "injections": [{"id",
            "alternatives": [site...], "patterns": [frame pattern...], "method": str|None}]}``. ``import``
            (default): each site's module is imported (:func:`check_site`, exact; importing sglang's scheduler
            takes ~12 s on 2 cores). ``source``: nothing is imported (:func:`check_site_source`, ~0.1 s); gate
            patterns and action methods are then not checked (``unchecked``).
    Returns:
        ``{"python", "executable", "mode", "versions": {dist: version|None}, "injections": [{"id",
        "alternatives": [check_site...], "patterns": [check_pattern...], "method": check_method|None}]}``.
    """
    source = request.get("mode") == "source"
    dists = list(request.get("versions") or []) or ["torch", "sglang"]
    out: Dict[str, Any] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "mode": "source" if source else "import",
        "versions": {d: _version(d) for d in dists},
        "injections": [],
    }
    unchecked = {"status": "unchecked", "detail": "not checked before launch (source mode)", "suggestions": []}
    for inj in request.get("injections", []):
        if source:
            out["injections"].append({
                "id": inj.get("id"),
                "alternatives": [check_site_source(s) for s in inj.get("alternatives", [])],
                "patterns": [{"pattern": p, **unchecked} for p in inj.get("patterns", [])],
                "method": None,
            })
            continue
        alts = [check_site(s) for s in inj.get("alternatives", [])]
        method = None
        if inj.get("method"):
            first = next((a["site"] for a in alts if a["status"] == "resolved" and not a["static"]), None)
            method = check_method(first, inj["method"]) if first else {"method": inj["method"], "status": "unchecked",
                                                                       "detail": "no importable site to look it up on"}
        out["injections"].append({
            "id": inj.get("id"),
            "alternatives": alts,
            "patterns": [check_pattern(p) for p in inj.get("patterns", [])],
            "method": method,
        })
    return out


def preflight_main() -> None:
    """Read a request (JSON) from stdin, write ``REPRO-PREFLIGHT <json>`` as the last stdout line."""
    import warnings

    warnings.simplefilter("ignore")
    request = json.loads(sys.stdin.read() or "{}")
    result = preflight(request)
    sys.stdout.write("\nREPRO-PREFLIGHT " + json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":  # pragma: no cover
    preflight_main()
