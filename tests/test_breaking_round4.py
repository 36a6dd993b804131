"""Breaking pass, round 4 (issue 29): what a new user found on the release verbs, each pinned here. No server.

- ``reproduce --report`` naming two releases (two pasted ``check_env`` blocks) is refused, never one chosen silently;
- a ``--report`` that names no release (junk version, binary file) is said in the release line;
- frames that no indexed release holds at their lines are never said to "fit" the closest releases.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from repro import releases as rel
from repro.reproduce import read_dumps
from repro.reproduce_release import dump_frames, pick_release

REPO = Path(__file__).resolve().parent.parent
DUMPS = REPO / "tests" / "fixtures" / "reproduce" / "hicache_30760_sglang_0_5_18_real"


@pytest.fixture()
def no_release_set_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("REPRO_TESTBED_DIR", raising=False)
    return tmp_path / "cache"


def test_a_report_naming_two_releases_is_refused_naming_both(tmp_path: Path, no_release_set_up: Path) -> None:
    report = tmp_path / "env.txt"
    report.write_text("Python: 3.11\nsglang: 0.5.18\n\nPython: 3.11\nsglang: 0.5.23\n")
    _, caps = read_dumps([str(DUMPS)])
    with pytest.raises(rel.ReleaseError) as e:
        pick_release("sglang", caps, [str(DUMPS)], reports=[str(report)], python="/usr/bin/python3")
    msg = str(e.value)
    assert "0.5.18" in msg and "0.5.23" in msg and "--release V" in msg and "\n" not in msg


def test_one_release_named_twice_is_no_conflict() -> None:
    idx = rel.load_index("sglang")
    choice = rel.choose_release(idx, texts=[("a.txt", "sglang: 0.5.18\n"), ("b.log", "pip: sglang==0.5.18\n")])
    assert choice.source == "report" and choice.version == "0.5.18"


@pytest.mark.parametrize("content", [b"Python: 3.11\nsglang: 0.5.banana\n", bytes(range(256)) * 4], ids=["junk-version", "binary"])
def test_a_report_that_names_no_release_is_said(tmp_path: Path, no_release_set_up: Path, content: bytes) -> None:
    report = tmp_path / "report.txt"
    report.write_bytes(content)
    _, caps = read_dumps([str(DUMPS)])
    _, choice = pick_release("sglang", caps, [str(DUMPS)], reports=[str(report)], python="/usr/bin/python3")
    assert choice.source == "frames"
    assert f"{report} named no sglang release" in choice.reason


def test_frames_no_release_holds_are_not_said_to_fit() -> None:
    idx = rel.load_index("sglang")
    _, caps = read_dumps([str(DUMPS)])
    frames = dump_frames(caps)
    moved = [rel.FrameRef(f.path, f.function, f.line + 90000 if f.line else f.line) for f in frames[:-3]] + frames[-3:]
    choice = rel.choose_release(idx, frames=moved)
    assert " fit " not in choice.reason and "holds all" in choice.reason and "the closest" in choice.reason
    exact = rel.choose_release(idx, frames=frames)
    assert "fit 0.5.18" in exact.reason  # frames that all fit still say so


# ---------------------------------------------------------------------------------------------------- bisect
from repro.release_bisect import BisectError, BisectOptions, bisect  # noqa: E402
from repro.refs import RefError, materialize, parse_ref  # noqa: E402

SCENARIO = REPO / "scenarios" / "sglang" / "hicache_prefetch_30760.toml"


def _bisect_opts(tmp_path: Path, good: str = "release:0.5.18", bad: str = "release:0.5.20", **kw) -> BisectOptions:
    return BisectOptions(scenario_path=SCENARIO, good=good, bad=bad, variant="allocatable_drift",
                         evidence_root=tmp_path / "ev", **kw)


@pytest.mark.parametrize("kw,good,bad,needle", [
    ({"tp": 0}, "release:0.5.18", "release:0.5.20", "--tp must be ≥ 1 (got 0)"),
    ({"requests": -1}, "release:0.5.18", "release:0.5.20", "--requests must be ≥ 1 (got -1)"),
    ({}, "release:0.5.18+patch:nope.patch", "release:0.5.20+patch:nope.patch", "patch:nope.patch: not found"),
    ({}, "release:0.5.18+patch:scenarios", "release:0.5.20+patch:scenarios", "is a folder"),
    ({}, "release:0.5.18+patch:", "release:0.5.20+patch:", "expected patch:FILE"),
    ({}, "release:0.5.18+git:/tmp@HEAD", "release:0.5.20+git:/tmp@HEAD", "only patch:FILE composes"),
], ids=["tp", "requests", "missing-patch", "folder-patch", "empty-patch", "git"])
def test_bisect_checks_cheap_input_before_asking_for_a_set_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              kw: dict, good: str, bad: str, needle: str) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no release set up: input errors come first
    monkeypatch.delenv("REPRO_TESTBED_DIR", raising=False)
    monkeypatch.chdir(REPO)
    with pytest.raises(BisectError) as e:
        bisect(_bisect_opts(tmp_path, good, bad, **kw), runner=lambda *a: pytest.fail("ran"))
    assert needle in str(e.value) and "not set up" not in str(e.value) and "\n" not in str(e.value)


def test_bisect_names_every_release_not_set_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("REPRO_TESTBED_DIR", raising=False)
    with pytest.raises(BisectError) as e:
        bisect(_bisect_opts(tmp_path), runner=lambda *a: pytest.fail("ran"))
    assert "3 of 3 are not (0.5.18, 0.5.19, 0.5.20)" in str(e.value)


def test_a_refused_step_is_named_in_bisect_md(tmp_path: Path) -> None:
    def refuse(version: str, ref: str, root: Path):
        raise BisectError(f"site X is absent in {version}; nothing was launched")

    with pytest.raises(BisectError):
        bisect(_bisect_opts(tmp_path), runner=refuse, check=lambda vs: None)
    folder = next((tmp_path / "ev").glob("*/*-bisect-*"))
    assert "Stopped: site X is absent in 0.5.18" in (folder / "BISECT.md").read_text()


# ------------------------------------------------------------------------------------------------------ REFs
def test_two_patches_in_one_ref_are_one_line_naming_the_fix() -> None:
    with pytest.raises(RefError, match="one patch per REF"):
        parse_ref("release:0.5.23+patch:a.patch+patch:b.patch")


def test_a_folder_as_patch_is_named_a_folder(tmp_path: Path) -> None:
    class Loc:
        package = "sglang"

    class Adapter:
        ref_location = Loc()

    with pytest.raises(RefError, match="is a folder, not a patch file"):
        materialize(parse_ref(f"patch:{tmp_path}"), "/usr/bin/python3", Adapter(), choose=lambda p: "/usr/bin/python3")


# ------------------------------------------------------------------------------------------- --release ''
import subprocess  # noqa: E402
import sys  # noqa: E402


@pytest.mark.parametrize("argv", [  # verbs that launch nothing even when the check regresses (run, demo, serve
    ["sites", "scenarios/sglang/smoke_extra_allreduce.toml"],  # and hunt share sites' _release_python check)
    ["reproduce", "tests/fixtures/reproduce/hicache_30760_sglang_0_5_18_real", "--no-run"],
], ids=["sites", "reproduce"])
def test_an_empty_release_is_refused_not_read_as_none(tmp_path: Path, argv: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", "repro", *argv, "--release", "", *(
        ["--out", str(tmp_path / "out")] if argv[0] == "reproduce" else [])], cwd=REPO, capture_output=True,
        text=True, timeout=120, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 2 and lines == ["error: --release '': expected a release such as 0.5.23 (or leave "
                                           "--release out for the default interpreter)"], r.stdout + r.stderr


def test_a_patch_that_fails_on_one_release_is_refused_before_any_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import repro.refs
    import repro.release_bisect as rb

    monkeypatch.chdir(tmp_path)
    Path("fix.patch").write_text("--- a/sglang/x.py\n+++ b/sglang/x.py\n")
    monkeypatch.setattr(rb, "release_python", lambda v, a: "/usr/bin/python3")  # every release "set up"

    class Made:
        def close(self) -> None:
            pass

    def materialize(ref, python, adapter, **kw):
        if ref.release == "0.5.20":
            raise RefError("fix.patch does not apply: hunk #1 of sglang/x.py failed at line 3")
        return Made()

    monkeypatch.setattr(repro.refs, "materialize", materialize)
    with pytest.raises(BisectError) as e:
        bisect(_bisect_opts(tmp_path, "release:0.5.18+patch:fix.patch", "release:0.5.20+patch:fix.patch"),
               runner=lambda *a: pytest.fail("a step ran before the patch was checked on every release"))
    assert "release:0.5.20+patch:fix.patch: fix.patch does not apply" in str(e.value)


# ------------------------------------------------------------------------------------ cleanup after kill -9
def test_the_verdict_cleanup_writes_records_the_exit_code_the_killed_run_ended_with(tmp_path: Path) -> None:
    import json
    import time

    from repro.cleanup import _write_killed_report

    _write_killed_report(tmp_path, {"pid": 4242, "time": time.time() - 30}, [], time.time())
    v = json.loads((tmp_path / "verdict.json").read_text())
    assert v["verdict"] == "INCONCLUSIVE" and v["harness_killed"] is True
    assert v["exit_code"] == 137, v  # what the shell saw (128 + SIGKILL), never INCONCLUSIVE's 4


# ------------------------------------------------------------------------------------------ small wording
def test_a_v_prefixed_release_gets_a_did_you_mean() -> None:
    idx = rel.load_index("sglang")
    for typed in ("v0.5.18", "V0.5.18", "sglang-v0.5.18"):
        with pytest.raises(rel.ReleaseError, match="did you mean 0.5.18\\?"):
            idx.get(typed)
    with pytest.raises(rel.ReleaseError) as e:
        idx.get("latest")
    assert "did you mean" not in str(e.value)


def test_a_forced_release_the_frames_contradict_is_said() -> None:
    idx = rel.load_index("sglang")
    _, caps = read_dumps([str(DUMPS)])
    choice = rel.choose_release(idx, forced="0.5.23", frames=dump_frames(caps))
    assert choice.version == "0.5.23" and "point to 0.5.18, not 0.5.23" in choice.reason
    assert "note" not in rel.choose_release(idx, forced="0.5.18", frames=dump_frames(caps)).reason


def test_sigterm_is_named_sigterm_when_it_interrupts() -> None:
    import signal
    import textwrap

    prog = textwrap.dedent("""
        import os, signal, sys
        sys.path.insert(0, %r)
        from repro import cli
        cli._sigterm_to_interrupt()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            signal.pause()
        except KeyboardInterrupt:
            sys.exit(cli._interrupted_exit())
    """ % str(REPO))
    r = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=60,
                       env={**__import__("os").environ, "COLUMNS": "200"})
    assert r.returncode == 143 and "interrupt (SIGTERM): tearing down" in r.stdout + r.stderr, r
