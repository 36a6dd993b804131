"""The harness installs like a tool: a wheel built with ``python -m build`` (sdist, then the wheel from the sdist)
carries the injector, the scenarios (hunt catalogue, patches) and the CPU testbed files, and its ``repro`` works
from a folder outside the clone.

The wheel is installed with ``--no-deps`` into a fresh venv made with ``--system-site-packages`` (typer, rich, …
come from this interpreter; no download but the isolated build's setuptools from the package index), and every
command runs with the clone absent from its path: the installed copy must be the one imported. Measured on the
2-core box: the non-hang tests ≈ 23 s quiet, ≈ 50 s loaded (build ≈ 10 s, venv + install ≈ 5 s, `repro sites` ≈
13–30 s as it imports sglang in the testbed's python, `repro analyze` < 1 s); the demo from the wheel (marked
``hang``: it deadlocks a real server; four variants of the smoke scenario) 170–240 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from repro import resources, testbed

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
FIXTURE_DUMPS = ROOT / "tests" / "fixtures" / "dumps" / "gloo3_extra_allreduce"
BUILD_TIMEOUT_S = 600
CMD_TIMEOUT_S = 600


def _run(cmd: list[str], cwd: Path, timeout_s: float = CMD_TIMEOUT_S, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COLUMNS")}  # no clone on the path
    return subprocess.run(cmd, cwd=str(cwd), capture_output=True, text=True, timeout=timeout_s, env={**clean, **(env or {})},
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """Build sdist + wheel from this clone, install the wheel into a fresh venv; returns paths and timings (s)."""
    base = tmp_path_factory.mktemp("pkg")
    t0 = time.monotonic()
    r = _run([sys.executable, "-m", "build", "--outdir", str(base / "dist"), str(ROOT)], cwd=base, timeout_s=BUILD_TIMEOUT_S)
    assert r.returncode == 0, f"python -m build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    wheels = sorted((base / "dist").glob("*.whl"))
    assert len(wheels) == 1 and sorted((base / "dist").glob("*.tar.gz")), list((base / "dist").iterdir())
    t1 = time.monotonic()
    venv = base / "venv"
    r = _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], cwd=base)
    assert r.returncode == 0, r.stderr
    py = venv / "bin" / "python"
    r = _run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheels[0])], cwd=base)
    assert r.returncode == 0, r.stdout + r.stderr
    work = base / "elsewhere"  # a folder outside the clone: the user's current folder
    work.mkdir()
    return {"venv": venv, "python": py, "repro": venv / "bin" / "repro", "wheel": wheels[0], "work": work,
            "build_s": t1 - t0, "install_s": time.monotonic() - t1}


def test_wheel_carries_injector_scenarios_and_testbed_files(installed):
    import zipfile

    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    for src, name in ((ROOT / d, n) for n, d in resources.DATA_FOLDERS.items()):
        files = [p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        assert files, src
        missing = [f for f in files if f"repro/_data/{name}/{f}" not in names]
        assert not missing, f"{src} files missing from {installed['wheel'].name}: {missing}"
    pkg = ROOT / "repro"  # data files inside the package itself (frame rules, pairing tables, …)
    in_pkg = [p.relative_to(ROOT).as_posix() for p in pkg.rglob("*")
              if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts and "_data" not in p.parts]
    missing = [f for f in in_pkg if f not in names]
    assert not missing, f"package data missing from {installed['wheel'].name}: {missing}"


def test_installed_package_reads_its_own_data_not_the_clone(installed):
    code = ("import json, repro, repro.resources as r, repro.testbed as t, repro.catalogue as c; print(json.dumps({'repro': repro.__file__, "
            "'checkout': r.is_checkout(), 'injectors': str(r.injectors_dir()), 'scenarios': str(r.scenarios_dir()), "
            "'stub': str(t.stub_dir()), 'catalogue': str(c.DEFAULT_CATALOGUE), 'demo': str(r.find_scenario('smoke_extra_allreduce')), "
            "'patch': str(r.find_data_file('scenarios/sglang/patches/sglang-0.5.23-30760-bulk-prefetch.patch')), "
            "'setup': t.setup_command()}))")
    r = _run([str(installed["python"]), "-c", code], cwd=installed["work"])
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    venv = str(installed["venv"].resolve())
    assert info["repro"].startswith(venv) and not info["checkout"], info
    for key in ("injectors", "scenarios", "stub", "catalogue", "demo", "patch"):
        assert info[key].startswith(venv) and "/repro/_data/" in info[key] and Path(info[key]).exists(), (key, info)
    assert (Path(info["injectors"]) / "repro_injector" / "resolve.py").is_file()
    assert info["setup"].endswith("repro/_data/cpu_testbed/setup.sh"), info["setup"]


def test_installed_analyze_runs_from_another_folder(installed):
    r = _run([str(installed["repro"]), "analyze", str(FIXTURE_DUMPS), "--json"], cwd=installed["work"])
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    data = json.loads(r.stdout)
    assert data["diverged"] is True and len(data["ranks"]) == 3, data.get("summary")


@pytest.fixture(scope="module")
def installed_sites(installed) -> subprocess.CompletedProcess:
    """`repro sites` of the #30760 scenario, typed as in a clone, from another folder, stdout a pipe (no terminal)."""
    py = testbed.testbed_python()
    if py is None or not testbed.is_set_up():
        pytest.fail(f"CPU testbed not set up at {testbed.testbed_dir()}: run `{testbed.setup_command()}`")
    return _run([str(installed["repro"]), "sites", "scenarios/sglang/hicache_prefetch_30760.toml", "--python", str(py)],
                cwd=installed["work"])


def test_installed_sites_runs_from_another_folder(installed_sites):
    r = installed_sites
    assert r.returncode == 0 and "Traceback" not in r.stdout + r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
    assert "all 6 injection(s) resolve" in r.stdout


def test_sites_without_a_terminal_prints_every_site_name_on_one_line(installed_sites):
    data = tomllib.loads((ROOT / "scenarios" / "sglang" / "hicache_prefetch_30760.toml").read_text())
    names = set()
    for v in data["variants"]:
        for inj in v.get("injections", []):
            site = inj["site"]
            names.update([site] if isinstance(site, str) else site)
    assert len(names) >= 3
    lines = installed_sites.stdout.splitlines()
    split = [n for n in names if not any(n in line for line in lines)]
    assert not split, f"site names not on one line of `repro sites … | cat`: {split}\n" + installed_sites.stdout[-3000:]


def test_installed_bare_scenario_name_and_unknown_name(installed):
    r = _run([str(installed["repro"]), "sites", "no_such_scenario"], cwd=installed["work"])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "no_such_scenario: scenario file not found" in r.stderr and "smoke_extra_allreduce" in r.stderr, r.stderr


@pytest.mark.hang
def test_installed_demo_from_another_folder_ends_with_both_verdicts(installed):
    """`repro demo` from the installed wheel, run outside the clone: the armed variant DEADLOCKED, the control ALL
    REQUESTS SUCCEEDED (the two variants the demo runs), evidence under the current
    folder's evidence/ (the documented default)."""
    if not testbed.is_set_up():
        pytest.fail(f"CPU testbed not set up at {testbed.testbed_dir()}: run `{testbed.setup_command()}`")
    r = _run([str(installed["repro"]), "demo", "--json"], cwd=installed["work"], timeout_s=900)
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    out = json.loads(r.stdout)
    verdicts = {v["variant"]: v["verdict"] for v in out["variants"]}
    assert verdicts["extra_collective"] == "DEADLOCKED" and verdicts["control"] == "ALL REQUESTS SUCCEEDED", verdicts
    mismatched = {v["variant"]: (v["verdict"], v["expected"]) for v in out["variants"] if v["exit_code"] != 0}
    assert not mismatched and r.returncode == 0 and out["as_expected"] is True, (mismatched, r.stderr[-3000:])
    for v in out["variants"]:
        ev = (installed["work"] / v["evidence"]).resolve()  # relative paths are relative to the demo's folder
        assert ev.is_relative_to(installed["work"].resolve() / "evidence") and (ev / "REPORT.md").is_file(), ev
    # the clone is on no path of the harness or the server: DEADLOCKED (not "injector not loaded") means the rank
    # processes ran the wheel's copy of the injector
