"""Site strings and their resolution, shared by the live injector and the ``repro sites`` preflight.

A site is ``package.module:Class.method`` (a class attribute; nested classes allowed) or ``package.module:function``
(a module attribute). ``resolve_in_module`` looks the attribute path up in an already imported module and says how
to patch it. ``preflight`` (run as ``python -c "...preflight_main()"`` in the target interpreter, never in the
harness) imports each module, falls back to reading the source with ``ast`` when the import itself fails, and lists
nearest names with ``difflib`` when something is missing. Stdlib only.
"""

from __future__ import annotations

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


def _static_index(path: str) -> Tuple[Dict[str, List[str]], List[str], Dict[str, List[str]]]:
    """From source: class -> own attribute names, top-level names, class -> base names."""
    import ast

    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), filename=path)
    classes: Dict[str, List[str]] = {}
    bases: Dict[str, List[str]] = {}
    top: List[str] = []

    def visit_class(node: Any, prefix: str) -> None:
        q = prefix + node.name
        members: List[str] = []
        for b in node.body:
            if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)):
                members.append(b.name)
            elif isinstance(b, ast.ClassDef):
                members.append(b.name)
                visit_class(b, q + ".")
            elif isinstance(b, ast.Assign):
                members.extend(t.id for t in b.targets if isinstance(t, ast.Name))
        classes[q] = members
        bases[q] = [ast.unparse(x) for x in node.bases]

    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            top.append(node.name)
            visit_class(node, "")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            top.append(node.name)
        elif isinstance(node, ast.Assign):
            top.extend(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            top.extend((a.asname or a.name).split(".")[0] for a in node.names)
    return classes, top, bases


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
        res["static"] = True
        classes, top, bases = _static_index(origin)
        qual = ".".join(parts)
        owner, name = ".".join(parts[:-1]), parts[-1]
        if (not owner and name in top) or (owner in classes and name in classes[owner]):
            res["status"] = "resolved"
            res["detail"] = f"found in source (import failed: {import_err})"
        elif owner in classes:
            res["status"] = "unverified"
            res["detail"] = (f"{owner} exists but defines no {name!r} itself (bases: {', '.join(bases[owner]) or 'none'}); "
                             f"import failed: {import_err}")
        else:
            res["status"] = "absent"
            res["detail"] = f"{qual} not found in {origin} (import failed: {import_err})"
            res["suggestions"] = _suggest(qual, top + [f"{c}.{m}" for c, ms in classes.items() for m in ms])
        return res
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
    """Answer a ``repro sites`` request.

    Args:
        request: ``{"injections": [{"id", "alternatives": [site...], "patterns": [frame pattern...],
            "method": str|None}]}``.
    Returns:
        ``{"python", "versions": {torch, sglang}, "injections": [{"id", "alternatives": [check_site...],
        "patterns": [check_pattern...], "method": check_method|None}]}``.
    """
    out: Dict[str, Any] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "versions": {"torch": _version("torch"), "sglang": _version("sglang")},
        "injections": [],
    }
    for inj in request.get("injections", []):
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
