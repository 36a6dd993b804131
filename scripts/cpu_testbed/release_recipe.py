"""Print one release's CPU testbed recipe as shell assignments, for setup.sh (standard library only).

    python3 release_recipe.py RELEASES_TOML VERSION

Reads ``[testbeds."VERSION"]`` of the adapter's release data (``repro/targets/releases/sglang.toml``; field meanings
there) and prints ``KIND=…``, ``TORCH=…``, ``TORCH_BUILD=…``, ``SKIP_DEPS=…`` (space separated), ``BASE=…``, ``PD=0|1``
and ``RECIPE_HASH=…`` (what the stamp compares), each value shell-quoted. Exit 2 with one line naming the fix when the
file is unreadable, the release has no recipe, or a field is wrong.
"""

from __future__ import annotations

import hashlib
import json
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


def recipe(data: dict, version: str) -> dict:
    """The recipe of ``version`` with defaults filled in.

    Raises:
        ValueError: no recipe for ``version``, or a field of the wrong kind (the message names the field).
    """
    beds = data.get("testbeds", {})
    if version not in beds:
        known = ", ".join(sorted(beds)) or "none"
        raise ValueError(f"sglang {version} has no CPU testbed recipe (releases with one: {known}); add a "
                         f'[testbeds."{version}"] table to the release data')
    t = beds[version]
    kind = t.get("kind", "venv")
    if kind not in KINDS:
        raise ValueError(f'[testbeds."{version}"] kind = {kind!r}: expected one of {", ".join(KINDS)}')
    out = {
        "KIND": kind,
        "TORCH": str(t.get("torch", "")),
        "TORCH_BUILD": str(t.get("torch_build", "")),
        "SKIP_DEPS": " ".join(t.get("skip_deps", [])),
        "BASE": str(t.get("base", "")),
        "PD": "1" if t.get("pd") else "0",
    }
    if kind == "venv" and not out["TORCH"]:
        raise ValueError(f'[testbeds."{version}"] kind = "venv" needs torch = "<the release\'s torch pin>"')
    if kind == "overlay":
        if not out["BASE"] or out["BASE"] not in beds or beds[out["BASE"]].get("kind", "venv") != "venv":
            raise ValueError(f'[testbeds."{version}"] kind = "overlay" needs base = "<a release with kind venv>"')
    out["RECIPE_HASH"] = hashlib.sha256(json.dumps(out, sort_keys=True).encode()).hexdigest()[:12]
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: release_recipe.py RELEASES_TOML VERSION", file=sys.stderr)
        return 2
    path, version = argv[1], argv[2]
    if tomllib is None:
        print("release_recipe.py: needs Python >= 3.11 or the tomli package (pip install tomli)", file=sys.stderr)
        return 2
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
        r = recipe(data, version)
    except (OSError, ValueError) as e:
        print(f"{path}: {e}", file=sys.stderr)
        return 2
    for k, v in r.items():
        print(f"{k}={shlex.quote(v)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
