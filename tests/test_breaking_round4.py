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
