"""Where ``self`` attributes are written: the writes of each attribute by method (``attr_writers``) and the containers
methods add to."""

from __future__ import annotations

import ast
from collections import defaultdict

from .walk import walk_body


_ADD_METHODS = ("append", "extend", "add", "update", "insert", "appendleft", "put", "put_nowait", "setdefault")


def _self_attr(f, e):
    """``X`` when ``e`` is ``self.X`` (or ``self.X[…]``, ``self.X.y``) in method ``f``, else None."""
    while isinstance(e, ast.Subscript) or (isinstance(e, ast.Attribute) and isinstance(e.value, (ast.Attribute, ast.Subscript))):
        e = e.value
    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and f.self_name and e.value.id == f.self_name:
        return e.attr
    return None


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
