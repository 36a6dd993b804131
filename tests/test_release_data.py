"""Per-release engine data: one home (``repro/targets/<engine>/releases/``), one schema (``repro.targets.release_data``).

Every shipped file validates; a broken one is one line naming the file and the field; the CPU compatibility agrees
with the setup recipe it names (pins, stand-in kernel, compat-layer items); the site alternatives exist in their
release (release index); and no engine data file lives anywhere else under ``repro/targets/``.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from repro import releases as rel
from repro.targets.registry import get_adapter
from repro.targets.release_data import ReleaseDataError, load_release_file, load_releases

REPO = Path(__file__).resolve().parent.parent
TARGETS = REPO / "repro" / "targets"


def _data(engine: str):
    data = get_adapter(engine).release_data()
    assert data is not None, f"the {engine} adapter declares no releases_dir"
    return data


def test_every_built_in_engine_has_its_release_data_in_its_package_and_it_validates():
    sg, vl = _data("sglang"), _data("vllm")
    assert sg.folder == TARGETS / "sglang" / "releases" and vl.folder == TARGETS / "vllm" / "releases"
    assert {"0.5.18", "0.5.23"} <= set(sg.releases) and sg.testbed_default == "0.5.23"
    assert sg.index_json == sg.folder / "index.json" and sg.version_patterns
    assert sg.recipes()["0.5.23"] == "cpu_testbed"
    assert set(vl.releases) == {"0.32.0"} and vl.index_json is None and vl.recipes() == {"0.32.0": "vllm_testbed"}
    assert set(sg.probe_sets()) >= {"0.5.18", "0.5.23"} and vl.probe_sets() == {}


def test_engine_data_files_live_only_in_an_engine_releases_folder():
    """One home: every TOML/JSON file under repro/targets/ is in <engine>/releases/."""
    stray = [p.relative_to(TARGETS).as_posix() for p in TARGETS.rglob("*")
             if p.suffix in (".toml", ".json") and p.parent.name != "releases"]
    assert stray == []
    for d in TARGETS.glob("*/releases"):
        for f in d.glob("[0-9]*.toml"):
            assert load_release_file(f).engine == d.parent.name


@pytest.mark.parametrize("body, field", [
    ('engine = "e"\nrelease = "1.0"\ncolour = "red"\n', "colour"),
    ('engine = "e"\nrelease = "1.0"\n[cpu]\ntorch = "two"\n', "cpu.torch"),
    ('engine = "e"\nrelease = "1.0"\n[cpu]\nrecipe = "x"\n', "cpu.torch"),
    ('engine = "e"\nrelease = "1.0"\n[cpu]\ntorch = "2.1"\npins = ["sglang-kernel"]\n', "cpu.pins"),
    ('engine = "e"\nrelease = "1.0"\n[sites]\ntick = ["Scheduler.tick"]\n', "sites"),
    ('engine = "e"\nrelease = "1.0"\n[state]\n[[state.probe]]\nname = "a"\npath = "x"\n[[state.probe]]\nname = "a"\npath = "y"\n',
     "state.probe"),
    ('engine = "e"\nrelease = "2.0"\n', "release"),
])
def test_a_broken_release_file_is_one_line_naming_the_file_and_the_field(tmp_path: Path, body: str, field: str):
    f = tmp_path / "1.0.toml"
    f.write_text(body)
    with pytest.raises(ReleaseDataError) as e:
        load_release_file(f)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{f}: {field}")


def test_a_broken_index_or_a_foreign_engine_in_the_folder_is_refused(tmp_path: Path):
    (tmp_path / "index.toml").write_text('engine = "e"\nversion_patterns = ["no group"]\n')
    with pytest.raises(ReleaseDataError, match=r"index.toml: version_patterns: .*expected one group"):
        load_releases(tmp_path)
    (tmp_path / "index.toml").write_text('engine = "e"\ntestbed_default = "1.0"\n')
    with pytest.raises(ReleaseDataError, match=r"index.toml: testbed_default: '1.0' has no 1.0.toml"):
        load_releases(tmp_path)
    (tmp_path / "1.0.toml").write_text('engine = "other"\nrelease = "1.0"\n')
    with pytest.raises(ReleaseDataError, match=r"1.0.toml: engine: 'other' is not this folder's engine 'e'"):
        load_releases(tmp_path)
    (tmp_path / "1.0.toml").write_text('engine = "e"\nrelease = "1.0"\n')
    assert load_releases(tmp_path).get("1.0").engine == "e"  # a fixed file is read again (cache keyed on mtime)


def _compat_items(recipe_dir: Path) -> set[str]:
    init = recipe_dir / "compat" / "repro_testbed_compat" / "__init__.py"
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "ITEMS":
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"{init} declares no ITEMS")


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_cpu_compatibility_agrees_with_the_setup_recipe_it_names(engine: str):
    for version, rf in _data(engine).releases.items():
        if rf.cpu is None or not rf.cpu.recipe:
            continue
        recipe = REPO / "scripts" / rf.cpu.recipe
        setup = (recipe / "setup.sh").read_text()
        reader = recipe / "release_recipe.py"
        if reader.is_file():  # a recipe driven by this data (setup.sh --release V): its reader gives these fields
            r = subprocess.run([sys.executable, str(reader), str(TARGETS / engine / "releases"), version],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            got = {k: shlex.split(v)[0] if v else "" for k, v in (ln.split("=", 1) for ln in r.stdout.splitlines())}
            assert (got["KIND"], got["TORCH"], got["BASE"], got["TORCH_BUILD"]) == (
                rf.cpu.kind, rf.cpu.torch, rf.cpu.base, rf.cpu.torch_build), (version, got)
            assert got["SKIP_DEPS"].split() == rf.cpu.skip_deps and got["PD"] == ("1" if rf.cpu.packages else "0")
        else:
            assert re.search(rf'^[A-Z_]*VERSION="{re.escape(version)}"', setup, re.M), (engine, version)
            torch = rf.cpu.torch.split("+")[0]
            assert (f'TORCH_VERSION="{torch}"' in setup or f"torch=={rf.cpu.torch}" in setup
                    or f"torch {rf.cpu.torch}" in setup)
        for pin in rf.cpu.packages:
            name, ver = pin.split("==")
            assert f'"{ver}"' in setup and name in setup, pin
        if rf.cpu.kernel_standin:
            assert (recipe / rf.cpu.kernel_standin).is_dir()
        if rf.cpu.compat:
            assert set(rf.cpu.compat) <= _compat_items(recipe), set(rf.cpu.compat) - _compat_items(recipe)
        if rf.cpu.python:
            assert rf.cpu.python in setup


def test_site_alternatives_exist_and_run_in_their_release():
    """Every ``[sites]`` name is a function of that release's source (release index), on a class its tree-cache
    factory builds when it is a factory class (0.5.18: HiRadixCache; 0.5.23: UnifiedRadixCache)."""
    idx = rel.load_index("sglang")
    raw = json.loads((TARGETS / "sglang" / "releases" / "index.json").read_text())
    for version, rf in _data("sglang").releases.items():
        bit = 1 << idx.versions().index(version)
        release = idx.get(version)
        assert rf.sites, version
        for name, alts in rf.sites.items():
            for site in alts:
                module, qual = site.split(":")
                spans = raw["modules"].get(module.replace(".", "/") + ".py", {}).get(qual, [])
                assert any(s[2] & bit for s in spans), f"{version} {name}: {site} is not in the release"
                assert rel.never_built(site, version, "sglang") is None, (version, site)
