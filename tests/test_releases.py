"""Releases as data (issue 34): the release index beside the adapter, ``release:V`` REFs composing with ``patch:``,
and a release that is not set up refused in one line naming the command that sets it up. No server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from repro import releases as rel
from repro.compare import CompareError, Ref, materialize, parse_ref
from repro.targets.sglang import SGLangAdapter
from sglang_wheels import sglang_wheel  # tests/sglang_wheels.py

SGLANG = SGLangAdapter()  # the run's adapter these REFs are made for

REPO = Path(__file__).resolve().parent.parent
SCENARIO = REPO / "scenarios" / "sglang" / "hicache_prefetch_30760.toml"


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty per-user cache: no release is set up except the ones a test makes (REPRO_TESTBED_DIR unset)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("REPRO_TESTBED_DIR", raising=False)
    return tmp_path / "cache"


def _set_up(cache: Path, version: str) -> Path:
    """A release 'set up' by hand: its venv's python (this interpreter) and the stamp."""
    d = cache / "tp-deadlock-repro" / "testbed" / f"sglang-{version}"
    (d / "venv" / "bin").mkdir(parents=True)
    (d / "venv" / "bin" / "python").symlink_to(sys.executable)
    (d / ".setup-stamp").write_text("by hand\n")
    return d / "venv" / "bin" / "python"


def test_index_has_the_eleven_releases_in_order_and_hiradix_builders() -> None:
    idx = rel.load_index("sglang")
    assert idx.versions() == ["0.5.14", "0.5.15", "0.5.15.post1", "0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20",
                              "0.5.21", "0.5.22", "0.5.23"]
    builders = [r.version for r in idx.releases if r.builds("HiRadixCache")]
    assert builders == idx.versions()[:6]  # up to 0.5.18; 0.5.19/0.5.20 ship hiradix_cache.py but never build it
    assert not any("StreamingSession" in b for r in idx.releases for b in r.factory_builds)  # a wrapper, not a cache
    assert idx.get("0.5.18").requires == ("sglang-kernel==0.4.6.post1", "torch==2.13.0")
    assert idx.get("0.5.20").builds("RadixCache")  # a base of a built class (LMCRadixCache) counts


def test_parse_ref_release_alone_and_composed_with_a_patch() -> None:
    assert parse_ref("release:0.5.18") == Ref("release", "release:0.5.18", release="0.5.18")
    r = parse_ref("release:0.5.18+patch:fix.patch")
    assert (r.kind, r.path, r.release) == ("patch", Path("fix.patch"), "0.5.18")
    for bad, needle in [("release:", "expected release:V"), ("release:0.5.18+git:/x@y", "only patch:FILE composes"),
                        ("release:0.5.18+patch:", "expected patch:FILE")]:
        with pytest.raises(CompareError, match=needle):
            parse_ref(bad)


def test_a_release_that_is_not_set_up_is_one_line_naming_how_to_set_it_up(cache: Path) -> None:
    with pytest.raises(rel.ReleaseError) as e:
        rel.release_python("0.5.18", "sglang")
    msg = str(e.value)
    assert "\n" not in msg and "sglang 0.5.18 is not set up" in msg
    assert msg.endswith("set it up with: bash scripts/cpu_testbed/setup.sh --release 0.5.18")  # its recipe
    with pytest.raises(rel.ReleaseError) as e:  # an overlay on 0.5.18: set up the base first, in the same line
        rel.release_python("0.5.20", "sglang")
    assert str(e.value).endswith("bash scripts/cpu_testbed/setup.sh --release 0.5.18 && "
                                 "bash scripts/cpu_testbed/setup.sh --release 0.5.20")
    with pytest.raises(rel.ReleaseError) as e:  # no recipe: the command by hand, with the release's own pins
        rel.release_python("0.5.16", "sglang")
    msg = str(e.value)
    assert "\n" not in msg and "sglang 0.5.16 is not set up" in msg and "have a testbed recipe today" in msg
    assert "pip install 'sglang==0.5.16'" in msg and "'torch==2.11.0'" in msg
    with pytest.raises(rel.ReleaseError) as e:
        rel.release_python("0.5.23", "sglang")
    assert "set it up with: bash scripts/cpu_testbed/setup.sh" in str(e.value)
    with pytest.raises(rel.ReleaseError, match="'0.5.99' is not in the release index; known: 0.5.14"):
        rel.release_python("0.5.99", "sglang")
    with pytest.raises(CompareError, match=r"^REF 'release:0.5.18\+patch:x.patch': sglang 0.5.18 is not set up"):
        materialize(parse_ref("release:0.5.18+patch:x.patch"), None, SGLANG)


def _fake_sglang(root: Path) -> Path:
    f = root / "sglang" / "srt" / "x.py"
    f.parent.mkdir(parents=True)
    (root / "sglang" / "__init__.py").write_text("")
    (root / "sglang" / "srt" / "__init__.py").write_text("")
    f.write_text("def tick():\n    return 1\n")
    return f


def test_release_ref_runs_the_releases_interpreter_and_patch_composes_on_it(cache: Path, tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    py = _set_up(cache, "0.5.18")
    site = tmp_path / "site"
    _fake_sglang(site)
    monkeypatch.setenv("PYTHONPATH", str(site))
    m = materialize(parse_ref("release:0.5.18"), "/ignored/python", SGLANG)
    assert m.python == str(py) and m.package_dir == str(site / "sglang") and "sglang 0.5.18 release" in m.description
    diff = tmp_path / "fix.patch"
    diff.write_text("--- a/sglang/srt/x.py\n+++ b/sglang/srt/x.py\n@@ -1,2 +1,2 @@\n def tick():\n-    return 1\n+    return 2\n")
    m = materialize(parse_ref(f"release:0.5.18+patch:{diff}"), None, SGLANG, tmp_parent=tmp_path)
    try:
        assert m.python == str(py) and "sglang 0.5.18 release" in m.description and "fix.patch (overlay)" in m.description
        assert "return 2" in (Path(m.pythonpath_prepend[0]) / "sglang" / "srt" / "x.py").read_text()
    finally:
        m.close()
    assert "return 1" in (site / "sglang" / "srt" / "x.py").read_text()


def test_compare_cli_on_a_release_not_set_up_exits_2_with_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    env.pop("REPRO_TESTBED_DIR", None)
    r = subprocess.run([sys.executable, "-m", "repro", "compare", str(SCENARIO), "--variant", "allocatable_drift",
                        "--before", "release:0.5.18", "--after", "release:0.5.18+patch:x.patch",
                        "--evidence-dir", str(tmp_path / "ev")], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "sglang 0.5.18 is not set up" in lines[0] and "set it up with: bash scripts/cpu_testbed/setup.sh --release 0.5.18" in lines[0]
    assert not (tmp_path / "ev").exists() or not any((tmp_path / "ev").rglob("*"))


@pytest.mark.parametrize("verb", ["run", "demo", "serve", "sites", "discover", "hunt"])
def test_every_engine_verb_takes_release_and_refuses_one_not_set_up_in_one_line(verb: str, cache: Path) -> None:
    from typer.testing import CliRunner

    from repro.cli import app

    args = [verb] + ([] if verb == "demo" else [str(SCENARIO)])
    r = CliRunner().invoke(app, args + ["--release", "0.5.18"])
    text = r.output + (getattr(r, "stderr", "") if getattr(r, "stderr_bytes", None) is not None else "")
    assert r.exit_code == 2, text
    assert "sglang 0.5.18 is not set up" in text and "set it up with: bash scripts/cpu_testbed/setup.sh --release 0.5.18" in text.replace("\n", " ")
    r = CliRunner().invoke(app, args + ["--release", "0.5.23", "--python", sys.executable])
    assert r.exit_code == 2 and "not both" in r.output


def test_a_site_on_a_class_the_releases_factory_never_builds_is_named_dead_code() -> None:
    hi = "sglang.srt.mem_cache.hiradix_cache:HiRadixCache.check_prefetch_progress"
    w = rel.never_built(hi, "0.5.20", "sglang")
    assert w and "sglang 0.5.20's tree-cache factory never builds HiRadixCache" in w and "0.5.14–0.5.18" in w
    assert rel.never_built(hi, "0.5.18", "sglang") is None
    assert rel.never_built("sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.check_prefetch_progress", "0.5.20", "sglang") is None
    assert rel.never_built("sglang.srt.managers.scheduler:Scheduler.get_num_allocatable_reqs", "0.5.20", "sglang") is None  # no cache
    assert rel.never_built(hi, "9.9", "sglang") is None and rel.never_built(hi, None, "sglang") is None


def test_sites_preflight_warns_when_the_resolving_alternative_is_never_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """The preflight's answer (the injector's resolver in the target interpreter) stands in for a 0.5.20 venv: both
    alternatives resolve there, and the report says which one that release never builds."""
    from repro import sites
    from repro.scenario import load_scenario

    scen = load_scenario(SCENARIO)
    var = scen.variant("extra_collective")

    def preflight(python, request, timeout_s, env=None):
        return {"python": "3.11.7", "versions": {"sglang": "0.5.20"}, "injections": [
            {"alternatives": [{"site": s, "status": "resolved", "static": True} for s in inj["alternatives"]],
             "patterns": [], "method": None} for inj in request["injections"]]}

    monkeypatch.setattr(sites, "_run_preflight", preflight)
    rep = sites.check_sites(scen, sys.executable, var.name)
    warned = [w for i in rep.injections for w in i.warnings if "never builds HiRadixCache" in w]
    assert warned and all("0.5.20" in w for w in warned)
    assert any("hiradix_cache:HiRadixCache" in a for i in rep.injections for a in (x.site for x in i.alternatives))


PATCH_0_5_18 = REPO / "scenarios" / "sglang" / "patches" / "sglang-0.5.18-30760-bulk-prefetch.patch"


def test_the_seeds_fix_for_0_5_18_applies_as_release_plus_patch_on_the_wheels_files(cache: Path, tmp_path: Path,
                                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """release:0.5.18+patch:the seed's fix, on a 'set up' 0.5.18 holding the wheel's own scheduler.py and
    hiradix_cache.py: the overlay is patched, compiles, and the loop reads the per-tick map instead of checking."""
    import py_compile
    import zipfile

    _set_up(cache, "0.5.18")
    site = tmp_path / "site"
    z = zipfile.ZipFile(sglang_wheel("0.5.18"))
    for rel_path in ("sglang/srt/managers/scheduler.py", "sglang/srt/mem_cache/hiradix_cache.py"):
        f = site / rel_path
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(z.read(rel_path))
    for d in [site / "sglang", *(p for p in (site / "sglang").rglob("*") if p.is_dir())]:
        (d / "__init__.py").touch()
    monkeypatch.setenv("PYTHONPATH", str(site))
    m = materialize(parse_ref(f"release:0.5.18+patch:{PATCH_0_5_18}"), None, SGLANG, tmp_parent=tmp_path)
    try:
        root = Path(m.pythonpath_prepend[0]) / "sglang" / "srt"
        sched, hi = root / "managers" / "scheduler.py", root / "mem_cache" / "hiradix_cache.py"
        for f in (sched, hi):
            py_compile.compile(str(f), cfile=str(tmp_path / (f.name + "c")), doraise=True)
        text = sched.read_text()
        assert text.count("bulk_check_prefetch_progress(") == 1 and "prefetch_progress_map.get(req.rid, True)" in text
        assert text.index("bulk_check_prefetch_progress(") < text.index("for req in self.waiting_queue:\n            if self.enable_lora")
        # before the early return a rank-local batch_is_full takes, and that sticky flag cleared on an empty batch
        assert text.index("bulk_check_prefetch_progress(") < text.index("running_batch.batch_is_full or len(self.waiting_queue) == 0")
        assert "if running_batch.is_empty():\n" in text
        assert "def bulk_check_prefetch_progress(self, req_ids: list) -> dict:" in hi.read_text()
    finally:
        m.close()


PATCH_0_5_20 = REPO / "scenarios" / "sglang" / "patches" / "sglang-0.5.20-30760-bulk-prefetch.patch"


def test_the_fix_for_0_5_20_applies_as_release_plus_patch_on_the_wheels_files(cache: Path, tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """release:0.5.20+patch:our 0.5.20 port, on the wheel's own scheduler.py and base_prefix_cache.py: patched,
    compiles, the pre-pass comes before the loop and the early return, the loop reads the map."""
    import py_compile
    import zipfile

    _set_up(cache, "0.5.20")
    site = tmp_path / "site"
    z = zipfile.ZipFile(sglang_wheel("0.5.20"))
    for rel_path in ("sglang/srt/managers/scheduler.py", "sglang/srt/mem_cache/base_prefix_cache.py"):
        f = site / rel_path
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(z.read(rel_path))
    for d in [site / "sglang", *(p for p in (site / "sglang").rglob("*") if p.is_dir())]:
        (d / "__init__.py").touch()
    monkeypatch.setenv("PYTHONPATH", str(site))
    m = materialize(parse_ref(f"release:0.5.20+patch:{PATCH_0_5_20}"), None, SGLANG, tmp_parent=tmp_path)
    try:
        root = Path(m.pythonpath_prepend[0]) / "sglang" / "srt"
        sched, base = root / "managers" / "scheduler.py", root / "mem_cache" / "base_prefix_cache.py"
        for f in (sched, base):
            py_compile.compile(str(f), cfile=str(tmp_path / (f.name + "c")), doraise=True)
        text = sched.read_text()
        assert text.count("bulk_check_prefetch_progress(") == 1 and "prefetch_done_by_handle.get(" in text
        assert text.index("bulk_check_prefetch_progress(") < text.index("running_batch.batch_is_full or len(self.waiting_queue) == 0")
        assert "def bulk_check_prefetch_progress(" in base.read_text()
    finally:
        m.close()


def test_the_0_5_18_state_probes_name_methods_that_0_5_18_has() -> None:
    """The lockstep-state probes of "The cause, not the symptom" for 0.5.18: every called method of every probe path
    is a function of the 0.5.18 source (release index), and the tick function is 0.5.18's."""
    import re

    from repro.targets.sglang import SGLangAdapter

    ps = SGLangAdapter().release_data().probe_sets()["0.5.18"]
    idx = rel.load_index("sglang")
    bit = 1 << idx.versions().index("0.5.18")

    def in_0_5_18(name: str) -> bool:
        return any(sp[2] & bit for m in idx.modules.values() for q, spans in m.items()
                   if q == name or q.endswith("." + name) for sp in spans)

    called = {n for p in ps.probe for n in re.findall(r"(\w+)\(\)", p.path)}
    assert called >= {"available_size", "evictable_size", "protected_size"}
    assert all(in_0_5_18(n) for n in called), [n for n in called if not in_0_5_18(n)]
    assert in_0_5_18(ps.tick_function.split(":", 1)[1])
    assert "len(tree_cache.ongoing_prefetch)" in {p.path for p in ps.probe}  # HiRadixCache keys it by the rid (a str)
