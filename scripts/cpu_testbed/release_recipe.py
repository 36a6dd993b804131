"""Print one release's CPU testbed recipe as shell assignments, for setup.sh (standard library only).

    python3 release_recipe.py RELEASES_DIR VERSION

Reads the ``[cpu]`` table of ``RELEASES_DIR/VERSION.toml``, the adapter's per-release data
(``repro/targets/sglang/releases/``; the fields are ``repro.targets.release_data.CpuCompat``'s, which a fast test
validates) and prints ``KIND=…``, ``TORCH=…``, ``TORCH_BUILD=…``, ``SKIP_DEPS=…`` (space separated), ``BASE=…``,
``PD=0|1`` (extra ``packages``: Mooncake and the router) and ``RECIPE_HASH=…`` (what the stamp compares), each value
shell-quoted. Exit 2 with one line naming the fix when the file is unreadable, the release has no recipe, or a field
is wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys

try:
    import tomllib
except ImportError:  # Python 3.10: the harness depends on tomli there
    try:
        import tomli as tomllib  # type: ignore[no-redef]
    except ImportError:
        tomllib = None  # type: ignore[assignment]

KINDS = ("venv", "overlay")


def _load(folder: str, version: str) -> dict:
    path = os.path.join(folder, f"{version}.toml")
    if not os.path.isfile(path):
        have = sorted(f[:-5] for f in os.listdir(folder) if f[:1].isdigit() and f.endswith(".toml")) if os.path.isdir(folder) else []
        raise ValueError(f"sglang {version} has no release file (releases with one: {', '.join(have) or 'none'}); "
                         f"add {version}.toml with a [cpu] recipe (docs/adapters.md, 'Per-release data')")
    with open(path, "rb") as f:
        return tomllib.load(f)


def recipe(folder: str, version: str) -> dict:
    """The recipe of ``version`` with defaults filled in.

    Raises:
        ValueError: no release file or no ``[cpu] recipe`` for ``version``, or a field of the wrong kind (the message
            names the file and the field).
    """
    cpu = _load(folder, version).get("cpu") or {}
    where = f"{version}.toml [cpu]"
    if not cpu.get("recipe"):
        raise ValueError(f"{where}: no recipe: sglang {version} has no CPU testbed recipe; add recipe = \"cpu_testbed\"")
    kind = cpu.get("kind", "venv")
    if kind not in KINDS:
        raise ValueError(f'{where}: kind = {kind!r}: expected one of {", ".join(KINDS)}')
    out = {
        "KIND": kind,
        "TORCH": str(cpu.get("torch", "")),
        "TORCH_BUILD": str(cpu.get("torch_build", "")),
        "SKIP_DEPS": " ".join(cpu.get("skip_deps", [])),
        "BASE": str(cpu.get("base", "")),
        "PD": "1" if cpu.get("packages") else "0",
    }
    if not out["TORCH"]:
        raise ValueError(f'{where}: needs torch = "<the release\'s torch pin>"')
    if kind == "overlay":
        base = (_load(folder, out["BASE"]).get("cpu") or {}) if out["BASE"] else {}
        if base.get("kind", "venv") != "venv" or not base.get("recipe"):
            raise ValueError(f'{where}: kind = "overlay" needs base = "<a release whose [cpu] has its own venv recipe>"')
        if str(base.get("torch", "")).split("+")[0] != out["TORCH"].split("+")[0]:
            raise ValueError(f"{where}: torch {out['TORCH']} is not base {out['BASE']}'s ({base.get('torch')}): "
                             "an overlay needs the same torch pin")
    out["RECIPE_HASH"] = hashlib.sha256(json.dumps(out, sort_keys=True).encode()).hexdigest()[:12]
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: release_recipe.py RELEASES_DIR VERSION", file=sys.stderr)
        return 2
    path, version = argv[1], argv[2]
    if tomllib is None:
        print("release_recipe.py: needs Python >= 3.11 or the tomli package (pip install tomli)", file=sys.stderr)
        return 2
    try:
        r = recipe(path, version)
    except (OSError, ValueError) as e:
        print(f"{path}: {e}", file=sys.stderr)
        return 2
    for k, v in r.items():
        print(f"{k}={shlex.quote(v)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
