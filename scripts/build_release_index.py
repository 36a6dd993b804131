"""Build repro/targets/sglang/releases/index.json (the SGLang release index, read by repro.releases) from downloaded wheels.

Usage: python scripts/build_release_index.py [WHEEL_DIR]   (default ~/.cache/tp-deadlock-repro/wheels, filled with
``pip download --no-deps sglang==V -d WHEEL_DIR``). Standard library only; the wheels are read, never imported.

Output: {"releases": [{"version", "wheel", "requires", "factory_builds", "factory_bases"}], "modules": {path: {qualname:
[[first_line, last_line, release_mask], ...]}}} where bit i of release_mask is releases[i]; only the scheduler
process's folders (PREFIXES) are indexed. ``factory_builds``: classes imported from sglang and called in
``sglang/srt/mem_cache/registry.py`` (the tree-cache factory in 0.5.14-0.5.23) from ``sglang.srt.mem_cache``
modules: the tree caches it can return (HiRadixCache up to 0.5.18 only). Classes it calls from elsewhere are not
tree caches (``StreamingSession`` in ``create_tree_cache`` wraps the cache it was given) and are left out.
``factory_bases``: bare names of every base class of those (through the indexed folders' class statements, by
name), so a frame of an inherited method (``RadixCache.match_prefix`` on an ``LMCRadixCache``) still counts as built.
"""

import ast
import glob
import json
import os
import re
import sys
import zipfile
from pathlib import Path

PREFIXES = ("sglang/srt/managers/", "sglang/srt/mem_cache/", "sglang/srt/disaggregation/",
            "sglang/srt/distributed/", "sglang/srt/utils/", "sglang/srt/model_executor/")
FACTORY = "sglang/srt/mem_cache/registry.py"
CACHE_PACKAGE = "sglang.srt.mem_cache"  # the factory's tree caches come from here
OUT = Path(__file__).resolve().parent.parent / "repro" / "targets" / "sglang" / "releases" / "index.json"


def functions(tree):
    out = {}

    def walk(node, q):
        for c in ast.iter_child_nodes(node):
            if isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[q + c.name] = (c.lineno, c.end_lineno)
                walk(c, q + c.name + ".<locals>.")
            elif isinstance(c, ast.ClassDef):
                walk(c, q + c.name + ".")
    walk(tree, "")
    return out


def factory_builds(tree):
    imported = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith(CACHE_PACKAGE):
            for a in n.names:
                imported[a.asname or a.name] = f"{n.module}:{a.name}"
    called = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            for m in ast.walk(n.func):
                if isinstance(m, ast.Name) and m.id in imported and m.id[:1].isupper():
                    called.add(imported[m.id])
    return sorted(called)


def class_bases(tree, out):
    """Add ``{class name: [base names]}`` of every class statement in ``tree`` to ``out`` (bare names)."""
    for n in ast.walk(tree):
        if isinstance(n, ast.ClassDef):
            names = [b.id if isinstance(b, ast.Name) else b.attr for b in n.bases if isinstance(b, (ast.Name, ast.Attribute))]
            out.setdefault(n.name, set()).update(names)


def ancestors(classes, bases):
    """Every base class name of ``classes`` (bare names) through ``bases``, the classes themselves left out."""
    seen, todo = set(), [c.split(":")[-1] for c in classes]
    while todo:
        for b in bases.get(todo.pop(), ()):
            if b not in seen:
                seen.add(b)
                todo.append(b)
    return sorted(seen - {c.split(":")[-1] for c in classes} - {"object", "ABC", "Generic"})


def main(wheel_dir):
    wheels = sorted(glob.glob(os.path.join(wheel_dir, "sglang-*.whl")),
                    key=lambda w: [int(x) if x.isdigit() else x for x in re.split(r"[.]", Path(w).name.split("-")[1].replace("post", ""))])
    releases, modules = [], {}
    for i, w in enumerate(wheels):
        z = zipfile.ZipFile(w)
        version = Path(w).name.split("-")[1]
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        req = [ln.split(":", 1)[1].strip() for ln in z.read(meta).decode().splitlines() if ln.startswith("Requires-Dist:")]
        pins = [r for r in req if re.match(r"(torch|sglang-kernel|sgl-kernel)\b", r) and "extra ==" not in r]
        builds = factory_builds(ast.parse(z.read(FACTORY))) if FACTORY in z.namelist() else []
        release = {"version": version, "wheel": Path(w).name, "requires": pins, "factory_builds": builds}
        releases.append(release)
        bases = {}
        for n in z.namelist():
            if not n.endswith(".py") or not n.startswith(PREFIXES):
                continue
            try:
                tree = ast.parse(z.read(n))
            except SyntaxError:
                continue
            class_bases(tree, bases)
            mod = modules.setdefault(n, {})
            for q, (s, e) in functions(tree).items():
                spans = mod.setdefault(q, [])
                hit = next((sp for sp in spans if sp[0] == s and sp[1] == e), None)
                if hit is None:
                    spans.append([s, e, 1 << i])
                else:
                    hit[2] |= 1 << i
        release["factory_bases"] = ancestors(builds, bases)
    lines = ['{"releases": ' + json.dumps(releases) + ',', '"modules": {']
    items = sorted(modules.items())
    for j, (m, f) in enumerate(items):
        lines.append(json.dumps(m) + ": " + json.dumps(f, separators=(",", ":")) + ("," if j < len(items) - 1 else ""))
    lines.append("}}")
    OUT.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"{OUT}: {len(releases)} releases, {len(modules)} modules")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser("~/.cache/tp-deadlock-repro/wheels"))
