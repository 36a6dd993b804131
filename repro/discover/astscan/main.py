"""The scan of one request (``scan``), its cache key (``fingerprint``) and the script's ``main``: one JSON request on
stdin, one ``REPRO-DISCOVER {json}`` line on stdout."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import time

from .attrs import attr_writers
from . import MARK
from .guards import Guards
from .index import Index
from .infer import Types, return_types
from .package import _version, find_package, iter_modules
from .reach import Reach
from .sources import Ctx, cross_call_attrs, returners, stored_callables, thread_attrs
from .walk import _BODY_NODES, _LOCAL_DEFS, _MATCHED, _STMT_CALLS, _TEXTS, _match


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


def fingerprint(req):
    """A key for the scan's answer: the request, this scanner's code (every module of the package and the entry
    script), the Python version and every scanned file's size and mtime (a changed, added or removed file changes
    it)."""
    rules = req.get("rules") or {}
    pkg, folder = find_package(req["package"], req.get("root"))
    scope = rules.get("scope", {})
    h = hashlib.sha256()
    h.update(json.dumps(req, sort_keys=True).encode())
    here = os.path.dirname(os.path.abspath(__file__))
    for code in [os.path.join(here, n) for n in sorted(os.listdir(here)) if n.endswith(".py")] + [
            os.path.join(os.path.dirname(here), "scan.py")]:
        with open(code, "rb") as fh:
            h.update(fh.read())
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
