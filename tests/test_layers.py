"""The layer map (repro/layers.toml, drawn in docs/layers.md) holds: the import graph of repro/ and injectors/ — read
with ast, imports inside functions counted, ``if TYPE_CHECKING:`` blocks left out — has no cycle, every module is
on the map, at most MAX_AGAINST_MAP imports go against it; and no module is over MAX_LINES lines (cli.py aside)."""

from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path
from typing import Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
LAYER_FILE = ROOT / "repro" / "layers.toml"
MAX_AGAINST_MAP = 2  # imports allowed against the map (issue 30): today none
MAX_LINES = 900  # per module of repro/ and injectors/ (issue 30); later issues keep it
SIZE_EXEMPT = {"repro/cli.py"}  # one module per verb group is the next step for the CLI (STYLE.md)


def _modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for repro/ and injectors/repro_injector/."""
    out = {}
    for base, top in ((root, "repro"), (root / "injectors", "repro_injector")):
        for p in sorted((base / top).rglob("*.py")):
            parts = list(p.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` imports, at module level or inside functions and classes
    (``from a import b`` counts as ``a.b`` when that is a module, else as ``a``); ``if TYPE_CHECKING:`` bodies skipped."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for c in child.orelse:
                    visit_one(c)
                continue
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                found.add(sub if sub in known else mod)
        else:
            visit(node)

    visit(tree)
    out = set()
    for m in found:
        parts = m.split(".")
        for i in range(len(parts), 0, -1):  # the longest known module it names
            cand = ".".join(parts[:i])
            if cand in known:
                if cand != name:
                    out.add(cand)
                break
    return out


@functools.lru_cache(maxsize=2)
def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = _modules(root)
    return {n: imports_of(n, p, set(mods)) for n, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []
    counter = [0]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in graph:
        if v not in index:
            strong(v)
    return out


def load_map(path: Path = LAYER_FILE) -> list[dict]:
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    return list(data["layer"])


def place(module: str, layers: list[dict]) -> Optional[tuple[int, str]]:
    """(layer index, the entry) of the longest map entry naming ``module`` or a package above it; None: unmapped."""
    best = None
    for i, layer in enumerate(layers):
        for entry in layer["modules"]:
            if module == entry or module.startswith(entry + "."):
                if best is None or len(entry) > len(best[1]):
                    best = (i, entry)
    return best


def against_map(graph: dict[str, set[str]], layers: list[dict]) -> list[str]:
    """Every import that goes up a layer, or across entries of an ``apart`` layer."""
    out = []
    for a, deps in sorted(graph.items()):
        pa = place(a, layers)
        for b in sorted(deps):
            pb = place(b, layers)
            if pa is None or pb is None:
                continue
            if pb[0] > pa[0]:
                out.append(f"{a} ({layers[pa[0]]['name']}) imports {b} ({layers[pb[0]]['name']}, a layer above)")
            elif pb[0] == pa[0] and layers[pa[0]].get("apart") and pa[1] != pb[1]:
                out.append(f"{a} imports {b}: both are {layers[pa[0]]['name']}, which may not import each other")
    return out


def test_the_import_graph_has_no_cycle() -> None:
    found = [sorted(c) for c in cycles(import_graph())]
    assert not found, "import cycles (imports inside functions count): " + "; ".join(" <-> ".join(c) for c in found)


def test_every_module_is_on_the_layer_map_and_the_imports_follow_it() -> None:
    graph, layers = import_graph(), load_map()
    unmapped = sorted(m for m in graph if place(m, layers) is None)
    assert not unmapped, f"modules not on {LAYER_FILE.relative_to(ROOT)}: {unmapped} (add each to the layer of what it is)"
    bad = against_map(graph, layers)
    assert len(bad) <= MAX_AGAINST_MAP, "imports against the layer map:\n  " + "\n  ".join(bad)


def test_no_module_is_over_the_size_limit() -> None:
    big = []
    for p in sorted([*(ROOT / "repro").rglob("*.py"), *(ROOT / "injectors").rglob("*.py")]):
        rel = str(p.relative_to(ROOT))
        n = len(p.read_text(encoding="utf-8").splitlines())
        if n > MAX_LINES and rel not in SIZE_EXEMPT:
            big.append(f"{rel}: {n} lines")
    assert not big, f"modules over {MAX_LINES} lines (split them by role): {big}"


def test_the_drawing_names_the_layers_of_the_map_in_order() -> None:
    doc = (ROOT / "docs" / "layers.md").read_text(encoding="utf-8")
    drawn = re.findall(r"^\s*\d+\s+([a-z-]+)\b", doc.split("```")[1], flags=re.M)
    assert drawn == [layer["name"] for layer in reversed(load_map())], drawn


def test_the_graph_counts_imports_inside_functions_but_not_type_checking_ones(tmp_path: Path) -> None:
    pkg = tmp_path / "repro"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from repro import b\n"
                              "def f():\n    from repro.sub import c\n")
    (pkg / "b.py").write_text("import repro.a\n")
    (pkg / "sub" / "c.py").write_text("from .. import b\n")
    (tmp_path / "injectors" / "repro_injector").mkdir(parents=True)
    (tmp_path / "injectors" / "repro_injector" / "__init__.py").write_text("")
    g = import_graph(tmp_path)
    assert g["repro.a"] == {"repro.sub.c"} and g["repro.sub.c"] == {"repro.b"} and g["repro.b"] == {"repro.a"}
    assert cycles(g) == [{"repro.a", "repro.b", "repro.sub.c"}]
    layers = [{"name": "low", "modules": ["repro.b"]}, {"name": "high", "modules": ["repro"]}]
    assert against_map(g, layers) == ["repro.b (low) imports repro.a (high, a layer above)"]
