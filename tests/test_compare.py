"""`repro compare` without a server: REF parsing, patch overlay, git worktree, fail-fast errors, cleanup, COMPARISON.md.

The sglang files used here are the real ones of the CPU testbed's installed sglang 0.5.23 (the two files our
#30760 patch touches), copied into a small package tree the test owns; nothing here launches a server. The CLI
tests run `repro compare` in a subprocess with `--python` = this interpreter and PYTHONPATH = that tree, and prove
that no server started by the evidence root staying empty (a run's evidence folder is created before its launch).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from repro import compare as cmp
from repro.compare import CompareError, CompareOptions, Ref, materialize, parse_ref, run_compare
from repro.verdict import DEADLOCKED, INCONCLUSIVE, SUCCEEDED, Verdict
from repro.targets.sglang import SGLangAdapter

SGLANG = SGLangAdapter()  # the run's adapter these REFs are made for

REPO = Path(__file__).resolve().parent.parent
PATCH = REPO / "scenarios" / "sglang" / "patches" / "sglang-0.5.23-30760-bulk-prefetch.patch"
SCENARIO = REPO / "scenarios" / "sglang" / "hicache_prefetch_30760.toml"
TOUCHED = ("srt/managers/scheduler.py", "srt/mem_cache/base_prefix_cache.py")


@pytest.fixture(scope="session")
def installed_sglang() -> Path:
    """The CPU testbed's installed sglang package folder (fails, does not skip, when the testbed is missing)."""
    from repro import testbed

    py = testbed.testbed_python()
    if py is None:
        pytest.fail("the CPU testbed is not set up: run `bash scripts/cpu_testbed/setup.sh` (README, Set up)")
    return cmp.package_location(str(py), loc=SGLANG.ref_location)


@pytest.fixture()
def site(tmp_path: Path, installed_sglang: Path) -> Path:
    """A folder holding a `sglang/` package with the real 0.5.23 files the patch touches (and empty __init__s)."""
    root = tmp_path / "site"
    for rel in TOUCHED:
        dst = root / "sglang" / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(installed_sglang / rel, dst)
    for d in [root / "sglang", *(p for p in (root / "sglang").rglob("*") if p.is_dir())]:
        (d / "__init__.py").touch()
    return root


def _env_with(site: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO)])
    tmp = site.parent / "tmp"  # the CLI's temp dir (TMPDIR): overlays/worktrees it makes land here, nowhere shared
    tmp.mkdir(exist_ok=True)
    env["TMPDIR"] = str(tmp)
    return env


def _tree_hash(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(folder)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def _leftovers(tmp: Path) -> set[str]:
    """Overlay/worktree folders in ``tmp`` (a temp dir this test owns: other engineers' runs use the system one)."""
    return {p.name for p in tmp.iterdir() if p.name.startswith((cmp.OVERLAY_PREFIX, cmp.WORKTREE_PREFIX))}


def _git_repo(tmp_path: Path, site: Path) -> Path:
    """A git repo in sglang's source layout (python/sglang/…) from the installed files; 2nd commit = our patch."""
    repo = tmp_path / "sglang-src"
    shutil.copytree(site / "sglang", repo / "python" / "sglang")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}

    def git(*a: str) -> None:
        subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True, env=env)

    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", "sglang 0.5.23 (installed files)")
    git("tag", "v0.5.23")
    git("apply", str(PATCH))
    git("add", "-A")
    git("commit", "-q", "-m", "#30760 bulk prefetch check")
    return repo


def _break_hunk_2(text: str) -> str:
    """Our patch with one context line of scheduler.py's 2nd hunk changed, as if made for another sglang version."""
    ctx = "                 req.time_stats.observe_storage_prefetch_ready(prefetch_done)\n"
    assert text.count(ctx) == 1
    return text.replace(ctx, "                 req.time_stats.observe_prefetch_ready(prefetch_done)\n")


def _cli(args: list[str], site: Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "repro.cli", "compare", *args], cwd=cwd, env=_env_with(site),
                          capture_output=True, text=True, timeout=300)


# ------------------------------------------------------------------------------------------------ REF parsing
def test_parse_ref_accepts_the_four_kinds(tmp_path: Path) -> None:
    assert parse_ref("installed") == Ref("installed", "installed")
    r = parse_ref("patch:fix.patch")
    assert (r.kind, r.path) == ("patch", Path("fix.patch"))
    r = parse_ref("git:/src/sglang@v0.5.23")
    assert (r.kind, r.path, r.rev) == ("git", Path("/src/sglang"), "v0.5.23")
    r = parse_ref("git:/a@b/sglang@abc123")  # the last @ separates the rev
    assert (r.path, r.rev) == (Path("/a@b/sglang"), "abc123")
    r = parse_ref("python:/venv/bin/python")
    assert (r.kind, r.path) == ("python", Path("/venv/bin/python"))


@pytest.mark.parametrize("text, needle", [
    ("svn:/x", "unknown REF kind 'svn'"),
    ("latest", "unknown REF"),
    ("git:/src/sglang", "expected git:PATH@REV"),
    ("git:/src/sglang@", "expected git:PATH@REV"),
    ("patch:", "expected patch:FILE"),
    ("python:", "expected python:PATH"),
])
def test_parse_ref_rejects_bad_refs_with_the_accepted_forms(text: str, needle: str) -> None:
    with pytest.raises(CompareError) as e:
        parse_ref(text)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_patch_strip_level_follows_the_sglang_folder() -> None:
    text = PATCH.read_text()
    assert cmp.patch_strip(PATCH, text, SGLANG.ref_location) == 2
    assert cmp.patch_files(text) == ["b/python/sglang/srt/managers/scheduler.py", "b/python/sglang/srt/mem_cache/base_prefix_cache.py"]
    assert cmp.patch_strip(PATCH, text.replace("/python/sglang/", "/sglang/"), SGLANG.ref_location) == 1
    with pytest.raises(CompareError, match="not inside a sglang/ package folder"):
        cmp.patch_strip(PATCH, "--- a/foo/x.py\n+++ b/foo/x.py\n@@ -1 +1 @@\n-a\n+b\n", SGLANG.ref_location)
    with pytest.raises(CompareError, match="no unified diff found"):
        cmp.patch_strip(PATCH, "hello\n", SGLANG.ref_location)


# ------------------------------------------------------------------------------------------------ patch overlay
def test_patch_overlay_is_patched_first_on_path_and_removed_while_the_install_is_untouched(on_site: Path) -> None:
    site = on_site
    before_hash = _tree_hash(site / "sglang")
    m = materialize(parse_ref(f"patch:{PATCH}"), sys.executable, SGLANG, choose=lambda p: p)
    try:
        root = Path(m.pythonpath_prepend[0])
        assert m.package_dir == str(root / "sglang")
        sched = root / "sglang" / "srt" / "managers" / "scheduler.py"
        assert not sched.is_symlink()
        text = sched.read_text()
        assert "bulk_check_prefetch_progress(" in text
        assert "prefetch_done = prefetch_done_by_handle.get(" in text
        assert "bulk_check_prefetch_progress" in (root / "sglang" / "srt" / "mem_cache" / "base_prefix_cache.py").read_text()
        assert not list(root.rglob("*.orig")) and not list(root.rglob("*.rej"))
    finally:
        m.close()
    assert not root.exists()
    assert _tree_hash(site / "sglang") == before_hash
    m.close()  # idempotent


@pytest.fixture()
def on_site(site: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Make interpreters started by the test (sglang_location) see the test's sglang tree first."""
    monkeypatch.setenv("PYTHONPATH", str(site))
    return site


def test_overlay_mirrors_the_installed_tree_with_symlinks(on_site: Path) -> None:
    m = materialize(parse_ref(f"patch:{PATCH}"), sys.executable, SGLANG, choose=lambda p: p)
    try:
        root = Path(m.pythonpath_prepend[0])
        init = root / "sglang" / "__init__.py"
        assert init.is_symlink() and Path(os.readlink(init)) == on_site / "sglang" / "__init__.py"
        for rel in TOUCHED:
            assert not (root / "sglang" / rel).is_symlink()
            assert (on_site / "sglang" / rel).read_text() != (root / "sglang" / rel).read_text()
    finally:
        m.close()


def test_a_patch_that_does_not_apply_names_the_hunk(on_site: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.patch"
    bad.write_text(_break_hunk_2(PATCH.read_text()))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    with pytest.raises(CompareError) as e:
        materialize(parse_ref(f"patch:{bad}"), sys.executable, SGLANG, choose=lambda p: p, tmp_parent=tmp)
    msg = str(e.value)
    assert "hunk #2 of sglang/srt/managers/scheduler.py failed at line" in msg, msg
    assert "\n" not in msg
    assert _leftovers(tmp) == set()


# ------------------------------------------------------------------------------------------------ git worktree
def test_git_ref_makes_a_worktree_at_the_rev_and_removes_it(site: Path, tmp_path: Path) -> None:
    repo = _git_repo(tmp_path, site)
    head_before = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True).stdout
    fixed = materialize(parse_ref(f"git:{repo}@HEAD"), sys.executable, SGLANG, choose=lambda p: p)
    old = materialize(parse_ref(f"git:{repo}@v0.5.23"), sys.executable, SGLANG, choose=lambda p: p)
    try:
        pf, po = Path(fixed.pythonpath_prepend[0]), Path(old.pythonpath_prepend[0])
        assert pf.name == "python" and po.name == "python"
        assert "bulk_check_prefetch_progress" in (pf / "sglang" / "srt" / "managers" / "scheduler.py").read_text()
        assert "bulk_check_prefetch_progress" not in (po / "sglang" / "srt" / "managers" / "scheduler.py").read_text()
        assert not str(pf).startswith(str(repo))
    finally:
        fixed.close()
        old.close()
    assert not pf.exists() and not po.exists() and not pf.parent.parent.exists()
    wt = subprocess.run(["git", "-C", str(repo), "worktree", "list"], capture_output=True, text=True).stdout.strip().splitlines()
    assert len(wt) == 1  # only the user's own work tree is left
    assert subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True).stdout == head_before


def test_missing_git_rev_is_one_clear_line(site: Path, tmp_path: Path) -> None:
    repo = _git_repo(tmp_path, site)
    with pytest.raises(CompareError) as e:
        materialize(parse_ref(f"git:{repo}@v9.9.9"), sys.executable, SGLANG, choose=lambda p: p)
    assert "revision 'v9.9.9' not found" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(CompareError, match="is not a git checkout"):
        materialize(parse_ref(f"git:{tmp_path}@HEAD"), sys.executable, SGLANG, choose=lambda p: p)


def test_python_ref_needs_an_interpreter_with_sglang(tmp_path: Path, on_site: Path) -> None:
    m = materialize(parse_ref(f"python:{sys.executable}"), None, SGLANG)
    assert m.python == sys.executable and m.package_dir == str(on_site / "sglang")
    with pytest.raises(CompareError, match="does not exist"):
        materialize(parse_ref(f"python:{tmp_path / 'nope' / 'python'}"), None, SGLANG)


# ------------------------------------------------------------------------------------------------ CLI fail-fast
@pytest.mark.parametrize("kind", ["bad_patch", "missing_rev", "unknown_kind"])
def test_cli_fails_fast_with_one_line_and_starts_no_server(kind: str, site: Path, tmp_path: Path) -> None:
    ev_root = tmp_path / "evidence"
    if kind == "bad_patch":
        bad = tmp_path / "bad.patch"
        bad.write_text(_break_hunk_2(PATCH.read_text()))
        after, needle = f"patch:{bad}", "hunk #2 of sglang/srt/managers/scheduler.py failed at line"
    elif kind == "missing_rev":
        repo = _git_repo(tmp_path, site)
        after, needle = f"git:{repo}@no-such-rev", "revision 'no-such-rev' not found"
    else:
        after, needle = "hg:somewhere", "unknown REF kind 'hg'"
    r = _cli([str(SCENARIO), "--variant", "allocatable_drift", "--before", "installed", "--after", after,
              "--python", sys.executable, "--evidence-dir", str(ev_root)], site, tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.stderr
    assert not ev_root.exists() or not any(ev_root.rglob("*")), "a run folder was created: something launched"
    assert _leftovers(tmp_path / "tmp") == set()


# ------------------------------------------------------------------------------------------------ orchestration
@dataclass
class _FakeRun:
    """Stands in for repro.runner.run (the harness's own runner, not sglang): records what each side was given."""

    verdicts: list
    seen: list = field(default_factory=list)
    interrupt_on: int = -1

    def __call__(self, ro, observe):
        from repro.runner import RunResult

        i = len(self.seen)
        prepend = list(ro.pythonpath_prepend)
        self.seen.append((ro, prepend, [Path(p).exists() for p in prepend]))
        if i == self.interrupt_on:
            raise KeyboardInterrupt
        evd = Path(ro.evidence_root) / "hicache_prefetch_30760" / f"fake-{ro.label}"
        (evd / "injector").mkdir(parents=True, exist_ok=True)
        (evd / "REPORT.md").write_text("report\n")
        v = self.verdicts[i]
        return RunResult(Verdict(v, f"fake {v}"), 0, evd, ro.expect, None, {"to_verdict_s": 12.5}, 8 if v == SUCCEEDED else 2, 8)


def test_compare_runs_both_sides_with_the_overlay_and_writes_comparison(on_site: Path, tmp_path: Path) -> None:
    fake = _FakeRun([DEADLOCKED, SUCCEEDED])
    opts = CompareOptions(SCENARIO, before="installed", after=f"patch:{PATCH}", variant="allocatable_drift",
                          python=sys.executable, evidence_root=tmp_path / "ev")
    res = run_compare(opts, run_side=fake)
    assert res.exit_code == 0
    (ro_b, pre_b, _), (ro_a, pre_a, exists_a) = fake.seen
    assert pre_b == [] and ro_b.expect == "deadlock" and ro_b.label == "allocatable_drift-before"
    assert len(pre_a) == 1 and exists_a == [True] and ro_a.expect == "success" and ro_a.variant == "allocatable_drift"
    assert "--only after" in ro_a.command_line and "--only before" in ro_b.command_line
    assert not Path(pre_a[0]).exists()  # overlay removed after the run
    md = (res.folder / "COMPARISON.md").read_text()
    assert md.startswith("# hicache_prefetch_30760 / allocatable_drift: as expected")
    assert "**before** (`installed`): **DEADLOCKED**" in md and "**after**" in md and "ALL REQUESTS SUCCEEDED" in md
    assert "(../fake-allocatable_drift-before/REPORT.md)" in md and "(../fake-allocatable_drift-after/REPORT.md)" in md
    assert "| requests ok / stalled | 2 / 6 of 8 | 8 / 0 of 8 |" in md
    assert "Collectives per rank per scheduler tick" in md and "--only before" in md
    assert (res.folder / "compare.json").is_file()


def test_compare_mismatch_exits_5(on_site: Path, tmp_path: Path) -> None:
    fake = _FakeRun([DEADLOCKED, INCONCLUSIVE])
    opts = CompareOptions(SCENARIO, before="installed", after="installed", variant="allocatable_drift",
                          python=sys.executable, evidence_root=tmp_path / "ev")
    res = run_compare(opts, run_side=fake)
    assert res.exit_code == 5
    assert "MISMATCH" in (res.folder / "COMPARISON.md").read_text().splitlines()[0]
    opts.expect_after = "inconclusive"
    assert run_compare(opts, run_side=_FakeRun([DEADLOCKED, INCONCLUSIVE])).exit_code == 0


@pytest.mark.parametrize("interrupt_on", [0, 1])
def test_interrupted_compare_removes_overlay_and_worktree(interrupt_on: int, site: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    repo = _git_repo(tmp_path, site)
    monkeypatch.setenv("PYTHONPATH", str(site))
    fake = _FakeRun([DEADLOCKED, SUCCEEDED], interrupt_on=interrupt_on)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    opts = CompareOptions(SCENARIO, before=f"git:{repo}@v0.5.23", after=f"patch:{PATCH}", variant="allocatable_drift",
                          python=sys.executable, evidence_root=tmp_path / "ev", tmp_parent=tmp)
    with pytest.raises(KeyboardInterrupt):
        run_compare(opts, run_side=fake)
    made = [Path(p) for _, pre, _ in fake.seen for p in pre]
    assert made and all(exists for _, _, e in fake.seen for exists in e)
    # both REFs were materialised before the first side ran, and both are gone now
    assert not any(Path(p).exists() for p in made)
    assert _leftovers(tmp) == set() and all(tmp in Path(p).parents for p in made)
    assert not list(tmp_path.glob("ev/*/*compare*"))
    wt = subprocess.run(["git", "-C", str(repo), "worktree", "list"], capture_output=True, text=True).stdout.strip().splitlines()
    assert len(wt) == 1


def test_bad_expect_word_and_bad_variant_fail_before_materialising(tmp_path: Path) -> None:
    with pytest.raises(CompareError, match="--expect-after must be deadlock, success or inconclusive"):
        run_compare(CompareOptions(SCENARIO, "installed", "installed", expect_after="pass"), run_side=_FakeRun([]))
    with pytest.raises(CompareError, match="nope"):
        run_compare(CompareOptions(SCENARIO, "installed", "installed", variant="nope"), run_side=_FakeRun([]))


def test_folders_of_a_killed_harness_are_swept_at_the_next_compare(on_site: Path, tmp_path: Path) -> None:
    import json as _json

    m = materialize(parse_ref(f"patch:{PATCH}"), sys.executable, SGLANG, choose=lambda p: p, tmp_parent=tmp_path)
    root = Path(m.pythonpath_prepend[0])
    assert cmp.sweep_stale(tmp_path) == [] and root.exists()  # our own (live) overlay is kept
    owner = root / cmp.OWNER_FILE
    data = _json.loads(owner.read_text())
    data["create_time"] -= 1000.0  # as if the pid had been reused by another process: the owner is gone
    data["start_ticks"] -= 100_000  # (the identity checked: start ticks since boot)
    owner.write_text(_json.dumps(data))
    assert cmp.sweep_stale(tmp_path) == [root] and not root.exists()
    m.close()
