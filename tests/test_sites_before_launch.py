"""Issue 29 item 3: a site that cannot exist is refused before any server or evidence folder, by the resolver
``repro sites`` runs (``injectors/repro_injector/resolve.py`` in the target interpreter, ``mode="source"``: nothing
imported), for every verb that launches (they all pass through ``repro.runner.prepare``).

Runs against real installations: a small package written here (this interpreter), and the CPU testbed's sglang
0.5.23 (scripts/cpu_testbed/setup.sh, as the fast stage's discover tests also need). No server is started.
"""

from __future__ import annotations

import difflib
import json
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from repro import testbed
from repro.cli import app
from repro.scenario import load_scenario
from repro.sites import SitesUnresolved, check_before_launch, check_sites

REPO = Path(__file__).resolve().parent.parent
SMOKE = REPO / "scenarios" / "sglang" / "smoke_extra_allreduce.toml"
SCHED = "sglang.srt.managers.scheduler:Scheduler"

PKG = {
    "srcpkg/__init__.py": "",
    "srcpkg/base.py": """
        class Mixin:
            def from_mixin(self):
                pass
    """,
    "srcpkg/sched.py": """
        import functools
        from srcpkg.base import Mixin
        from json.decoder import JSONDecoder as Reexported

        def make_base():
            return object

        class Scheduler(Mixin):
            def run_batch(self):
                pass

        def _late(self):
            pass

        Scheduler.added_after_the_class = _late  # bound when the module runs: the live injector sees it

        class Dynamic(make_base()):
            pass

        @functools.lru_cache
        def top_function():
            pass

        class Rebound:
            pass

        Rebound = type("Rebound", (Rebound,), {"extra": lambda self: None})  # rebound at import: the live class decides
    """,
    "srcpkg/lazy.py": """
        def __getattr__(name):  # PEP 562: names made up when asked for
            raise AttributeError(name)
    """,
}


def _scenario(tmp_path: Path, sites: list) -> Path:
    lines = ['name = "srcpkg"', "", "[[variants]]", 'name = "v"', 'expect = "success"']
    for k, site in enumerate(sites):
        lines += ["", "[[variants.injections]]", f'id = "i{k}"', f"site = {json.dumps(site)}", 'action = { kind = "none" }']
    f = tmp_path / "s.toml"
    f.write_text("\n".join(lines) + "\n")
    return f


@pytest.fixture()
def pkg_env(tmp_path: Path) -> dict:
    import os

    for rel, text in PKG.items():
        f = tmp_path / "pkgs" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(textwrap.dedent(text))
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(tmp_path / "pkgs")}


def _testbed_python() -> str:
    py = testbed.testbed_python()
    assert py is not None, "the CPU testbed is not set up: bash scripts/cpu_testbed/setup.sh"
    return str(py)


def test_source_mode_refuses_only_what_cannot_exist_and_keeps_what_only_the_live_module_binds(tmp_path, pkg_env):
    cases = {
        "srcpkg.sched:Scheduler.run_batch": "resolved",
        "srcpkg.sched:Scheduler.from_mixin": "resolved",  # through a base in another module
        "srcpkg.sched:Scheduler.added_after_the_class": "resolved",  # assigned at module level, after the class
        "srcpkg.sched:top_function": "resolved",
        "srcpkg.sched:Reexported.decode": "resolved",  # a class re-exported from the stdlib, followed to its source
        "srcpkg.sched:Scheduler.run_bach": "absent",
        "srcpkg.schedzz:Scheduler.run_batch": "absent",
        "srcpkg.sched:Schedulerzz.run_batch": "absent",
        "srcpkg.sched:Dynamic.anything": "unverified",  # a base made by a call: only the live module can tell
        "nosuchpkg_h29.mod:C.m": "absent",
        "srcpkg.sched:Rebound.anything": "unverified",
        "srcpkg.lazy:anything": "unverified",
    }
    sc = load_scenario(_scenario(tmp_path, list(cases)))
    for mode in ("source", "import"):
        rep = check_sites(sc, sys.executable, env=pkg_env, mode=mode)
        got = {i.alternatives[0].site: i.alternatives[0] for i in rep.injections}
        for site, want in cases.items():
            if mode == "import" and want == "unverified":
                want = "absent"  # imported, the attribute is simply not there
            assert got[site].status == want, (mode, site, got[site])
    src = {i.alternatives[0].site: i.alternatives[0]
           for i in check_sites(sc, sys.executable, env=pkg_env, mode="source").injections}
    assert src["srcpkg.sched:Scheduler.run_bach"].suggestions[0] == "Scheduler.run_batch"
    assert "srcpkg.sched" in src["srcpkg.schedzz:Scheduler.run_batch"].suggestions


def test_an_injection_is_refused_only_when_every_alternative_is_absent(tmp_path, pkg_env):
    ok = _scenario(tmp_path, [["srcpkg.sched:Scheduler.run_bach", "srcpkg.sched:Scheduler.run_batch"]])
    check_before_launch(load_scenario(ok), ok, ["v"], sys.executable, env=pkg_env)  # one resolves: no refusal
    bad = _scenario(tmp_path, [["srcpkg.sched:Scheduler.run_bach", "srcpkg.schedzz:X.y"]])
    with pytest.raises(SitesUnresolved) as e:
        check_before_launch(load_scenario(bad), bad, ["v"], sys.executable, env=pkg_env)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{bad}: variants.v.injections.i0.site: ")
    assert "srcpkg.sched:Scheduler.run_bach is absent" in msg and "nearest: Scheduler.run_batch" in msg
    assert "srcpkg.schedzz:X.y is absent" in msg and "nothing was launched" in msg
    # a resolver that cannot run refuses nothing (the launch-time check decides)
    check_before_launch(load_scenario(bad), bad, ["v"], str(tmp_path / "no-python"), env=pkg_env)


def test_every_shipped_sglang_scenario_passes_on_the_testbed():
    py = _testbed_python()
    files = [f for f in sorted((REPO / "scenarios" / "sglang").glob("*.toml")) if "[[variants]]" in f.read_text()
             or "[variants." in f.read_text()]  # scenarios, not the discover rules / hunt catalogue beside them
    assert len(files) >= 5, files
    for f in files:
        sc = load_scenario(f)
        check_before_launch(sc, f, [v.name for v in sc.variants], py)


def test_run_with_a_typo_in_a_site_refuses_in_seconds_before_any_folder_or_server(tmp_path):
    py = _testbed_python()
    scen = tmp_path / "s.toml"
    scen.write_text(SMOKE.read_text().replace("Scheduler.run_batch\"", "Scheduler.run_batchzz\"", 1))
    assert "run_batchzz" in scen.read_text()
    evd = tmp_path / "evidence"
    t0 = time.monotonic()
    r = CliRunner().invoke(app, ["run", str(scen), "--variant", "extra_collective", "--python", py,
                                 "--evidence-dir", str(evd)])
    took = time.monotonic() - t0
    assert r.exit_code == 2, r.output
    out = " ".join(r.output.split())
    assert f"{scen}: variants.extra_collective.injections.extra_allreduce_before_run_batch.site:" in out, out
    assert f"{SCHED}.run_batchzz is absent" in out and "nearest: Scheduler.run_batch" in out, out
    assert "nothing was launched" in out, out
    # no folder at all: no processes.json (no server tree), no verdict.json that could disagree with exit 2
    assert not evd.exists() or not any(evd.rglob("*")), sorted(evd.rglob("*"))
    assert took < 30, took  # a server start on the testbed is 30–100 s; interpreter check + preflight ~6 s


def test_a_site_only_a_patched_overlay_defines_is_not_refused(tmp_path):
    # compare's after side (patch:FILE): the fix adds the method the site names; the check reads the server's
    # PYTHONPATH (the overlay first), not the installed sglang (the old source check read only the installed one)
    import shutil
    import subprocess

    from repro.compare import make_overlay, patch_strip
    from repro.targets.sglang import SGLangAdapter
    from repro.runner import RunOptions, prepare

    py = _testbed_python()
    pkg_dir = Path(subprocess.run([py, "-c", "import importlib.util as u; print(u.find_spec('sglang').origin)"],
                                  capture_output=True, text=True, check=True).stdout.strip()).parent
    sched = pkg_dir / "srt" / "managers" / "scheduler.py"
    old = sched.read_text().splitlines(keepends=True)
    at = next(k for k, line in enumerate(old) if line.startswith("    def run_batch("))
    new = old[:at] + ["    def run_batch_fixed(self):\n", "        pass\n", "\n"] + old[at:]
    patch = tmp_path / "fix.patch"
    text = "".join(difflib.unified_diff(old, new, "a/sglang/srt/managers/scheduler.py", "b/sglang/srt/managers/scheduler.py"))
    patch.write_text(text)
    scen = tmp_path / "s.toml"
    scen.write_text(SMOKE.read_text().replace("Scheduler.run_batch\"", "Scheduler.run_batch_fixed\"", 1))
    with pytest.raises(SitesUnresolved, match="run_batch_fixed is absent"):  # the installed code has no such method
        check_before_launch(load_scenario(scen), scen, ["extra_collective"], py)
    loc = SGLangAdapter().ref_location
    overlay = make_overlay(pkg_dir, patch, text, patch_strip(patch, text, loc), tmp_path, loc)
    try:
        p = prepare(RunOptions(scenario_path=scen, variant="extra_collective", python=py,
                               evidence_root=tmp_path / "ev", pythonpath_prepend=(str(overlay),)))
        assert p.evidence.plan.exists() and not p.evidence.processes.exists()  # prepared; nothing launched
    finally:
        shutil.rmtree(overlay, ignore_errors=True)


def test_compare_refuses_a_site_absent_on_the_after_side_before_the_before_side_runs(tmp_path):
    # the after side's patch renames the method the site names: nothing may run (the old code ran the before
    # side's whole server first, then refused the after side)
    import subprocess

    from repro.compare import CompareOptions, default_check_side, run_compare
    from repro.runner import RunError

    py = _testbed_python()
    pkg_dir = Path(subprocess.run([py, "-c", "import importlib.util as u; print(u.find_spec('sglang').origin)"],
                                  capture_output=True, text=True, check=True).stdout.strip()).parent
    old = (pkg_dir / "srt" / "managers" / "scheduler.py").read_text().splitlines(keepends=True)
    new = [line.replace("    def run_batch(", "    def run_batch_renamed(") for line in old]
    assert new != old
    patch = tmp_path / "rename.patch"
    patch.write_text("".join(difflib.unified_diff(old, new, "a/sglang/srt/managers/scheduler.py",
                                                  "b/sglang/srt/managers/scheduler.py")))
    ran = []
    opts = CompareOptions(SMOKE, "installed", f"patch:{patch}", variant="extra_collective", python=py,
                          evidence_root=tmp_path / "ev", tmp_parent=tmp_path)
    with pytest.raises(RunError, match="Scheduler.run_batch is absent"):
        run_compare(opts, run_side=lambda ro, observe: ran.append(ro), check_side=default_check_side)
    assert ran == []  # no side ran
    assert not (tmp_path / "ev").exists() or not any((tmp_path / "ev").rglob("*"))
