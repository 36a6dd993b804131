"""The package to scan: where it is (``find_package``, never imported), its modules under the rules' scope, its
version."""

from __future__ import annotations

import ast
import importlib.util
import os
import sys


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
