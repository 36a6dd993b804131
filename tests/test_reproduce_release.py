"""``repro reproduce`` picks the release (issue 34): a report's version line first, else the range of releases the
dump's frames fit (module, function, line inside the function's span in the release index), less the releases
whose factory never builds the frames' classes; ``--release`` forces one. Dumps: the TP=4 sglang 0.5.18 #30760
dumps built from the real 0.5.18 wheel (tests/fixtures/reproduce/hicache_30760_sglang_0_5_18). No server."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from repro import releases as rel
from repro.reproduce import read_dumps
from repro.reproduce_release import dump_frames, pick_release
from sglang_wheels import sglang_wheel  # tests/sglang_wheels.py

REPO = Path(__file__).resolve().parent.parent
DUMPS = REPO / "tests" / "fixtures" / "reproduce" / "hicache_30760_sglang_0_5_18"
CHECK_ENV = """Python: 3.11.7 (main, Dec  8 2023, 18:56:58) [GCC 11.4.0]
CUDA available: True
GPU 0,1,2,3: NVIDIA H100 80GB HBM3
PyTorch: 2.13.0+cu128
sglang: 0.5.17
sglang-kernel: 0.4.6.post1
"""


@pytest.fixture()
def no_release_set_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("REPRO_TESTBED_DIR", raising=False)
    return tmp_path / "cache"


def test_the_0_5_18_dumps_infer_0_5_18_and_nothing_that_does_not_build_hiradix(no_release_set_up: Path) -> None:
    _, caps = read_dumps([str(DUMPS)])
    idx = rel.load_index("sglang")
    choice = rel.choose_release(idx, frames=dump_frames(caps))
    assert choice.source == "frames" and choice.version == "0.5.18"
    assert "0.5.18" in choice.candidates and len(choice.candidates) <= 3
    assert not any(idx.get(v).builds("HiRadixCache") is False for v in choice.candidates)
    assert "fit 0.5.18" in choice.reason


def test_without_line_numbers_the_range_stops_at_the_last_release_that_builds_hiradix() -> None:
    idx = rel.load_index("sglang")
    frames = [rel.FrameRef("hiradix_cache.py", "HiRadixCache.check_prefetch_progress"),
              rel.FrameRef("hiradix_cache.py", "HiRadixCache.can_terminate_prefetch")]
    cands, excluded, counted = rel.infer_releases(frames, idx)
    assert counted == 2
    assert cands == ["0.5.14", "0.5.15", "0.5.15.post1", "0.5.16", "0.5.17", "0.5.18"]
    # 0.5.19 and 0.5.20 still ship hiradix_cache.py with these functions, but their factory never builds the class
    assert excluded == {"0.5.19": "its factory does not build HiRadixCache", "0.5.20": "its factory does not build HiRadixCache"}


def test_a_line_that_fits_newer_releases_too_is_cut_by_the_factory() -> None:
    idx = rel.load_index("sglang")
    top = [rel.FrameRef("hiradix_cache.py", "HiRadixCache._all_reduce_attn_groups", 222)]  # by line: 0.5.15, 0.5.17-0.5.20
    cands, excluded, _ = rel.infer_releases(top, idx)
    assert cands == ["0.5.15", "0.5.15.post1", "0.5.17", "0.5.18"] and set(excluded) == {"0.5.19", "0.5.20"}


def test_a_pasted_check_env_block_wins_over_the_frames(tmp_path: Path, no_release_set_up: Path) -> None:
    report = tmp_path / "issue.txt"
    report.write_text("The server hung after 2 h.\n\n" + CHECK_ENV)
    _, caps = read_dumps([str(DUMPS)])
    py, choice = pick_release("sglang", caps, [str(DUMPS)], reports=[str(report)], python=sys.executable)
    assert py is None and choice.version == "0.5.17" and choice.source == "report"
    assert "'sglang: 0.5.17'" in choice.reason and str(report) in choice.reason
    idx = rel.load_index("sglang")
    assert rel.version_in_text("pip freeze: sglang==0.5.20 torch==2.13.0", idx)[0] == "0.5.20"
    assert rel.version_in_text("[2026-12-01 10:00:00] sglang version: 0.5.15.post1", idx)[0] == "0.5.15.post1"
    assert rel.version_in_text("Process 1: sglang::scheduler_TP0", idx) is None


def test_release_forced_and_an_unknown_one_refused() -> None:
    _, caps = read_dumps([str(DUMPS)])
    _, choice = pick_release("sglang", caps, [str(DUMPS)], forced="0.5.20", python=sys.executable)
    assert (choice.version, choice.source) == ("0.5.20", "forced")
    with pytest.raises(rel.ReleaseError, match="'9.9.9' is not in the release index"):
        pick_release("sglang", caps, [str(DUMPS)], forced="9.9.9", python=sys.executable)


def test_reproduce_cli_on_a_release_not_set_up_says_which_why_and_the_setup_command(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    env.pop("REPRO_TESTBED_DIR", None)
    r = subprocess.run([sys.executable, "-m", "repro", "reproduce", str(DUMPS), "--no-run", "--out", str(tmp_path / "out")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert "sglang 0.5.18: the dump's" in lines[0] and "sglang 0.5.18 is not set up" in lines[0]
    assert "set it up with: bash scripts/cpu_testbed/setup.sh --release 0.5.18" in lines[0] and "--release V" in lines[0]
    assert not (tmp_path / "out" / "reproduce.toml").exists()


def test_the_0_5_18_dumps_are_what_the_wheel_says(tmp_path: Path) -> None:
    """The fixture is what its generator writes from the real 0.5.18 wheel (each sglang frame at the line calling
    the next frame), so the dumps cannot drift from the source they claim."""
    import importlib.util

    wheel = sglang_wheel("0.5.18")
    spec = importlib.util.spec_from_file_location("make_0_5_18", DUMPS / "_make.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(str(wheel), tmp_path)
    for k in range(4):
        assert (tmp_path / f"rank{k}.txt").read_text() == (DUMPS / f"rank{k}.txt").read_text()
    src = zipfile.ZipFile(wheel).read("sglang/srt/managers/scheduler.py").decode().splitlines()
    assert "check_prefetch_progress(req.rid)" in src[3318 - 1]  # the seed's line, inside `for req in self.waiting_queue`


def test_a_report_naming_a_release_outside_the_index_is_one_line_with_the_fix(tmp_path: Path) -> None:
    report = tmp_path / "env.txt"
    report.write_text(CHECK_ENV.replace("sglang: 0.5.17", "sglang: 0.4.9"))
    _, caps = read_dumps([str(DUMPS)])
    with pytest.raises(rel.ReleaseError, match=r"names sglang 0.4.9 \('sglang: 0.4.9'\), which is not in the release "
                                               r"index \(0.5.14–0.5.23\); force one with --release V"):
        pick_release("sglang", caps, [str(DUMPS)], reports=[str(report)], python=sys.executable)


REAL = REPO / "tests" / "fixtures" / "reproduce" / "hicache_30760_sglang_0_5_18_real"


def test_real_0_5_18_stacks_name_at_most_3_releases_with_0_5_18_and_none_without_hiradix(no_release_set_up: Path) -> None:
    """py-spy text of a real hung 0.5.18 run (#30760 allocatable_drift on the 0.5.18 testbed, before the fix), the
    harness's frames and threads removed by the fixture's _make.py: inference over the whole index keeps 0.5.18 and
    nothing whose factory does not build HiRadixCache."""
    text = "".join(p.read_text() for p in sorted(REAL.glob("rank*.txt")))
    assert "HiRadixCache.check_prefetch_progress" in text
    assert "repro_injector" not in text and "repro_testbed_compat" not in text and '"repro-' not in text
    idx = rel.load_index("sglang")
    assert len(idx.versions()) >= 8 and idx.versions()[0] == "0.5.14" and idx.versions()[-1] == "0.5.23"
    _, caps = read_dumps([str(REAL)])
    choice = rel.choose_release(idx, frames=dump_frames(caps))
    assert choice.source == "frames" and choice.version == "0.5.18", choice.reason
    assert "0.5.18" in choice.candidates and 1 <= len(choice.candidates) <= 3, choice.candidates
    assert all(idx.get(v).builds("HiRadixCache") for v in choice.candidates)


def test_the_real_fixture_maker_drops_the_harness_frames_and_threads_only() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_real", REAL / "_make.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    dump = ("Process 1: sglang::scheduler_TP0\n\nThread 1 (idle): \"MainThread\"\n"
            "    all_reduce (torch/distributed/distributed_c10d.py:3252)\n"
            "    repro_ledger[torch.distributed.all_reduce] (repro_injector/_ledger.py:574)\n"
            "    HiRadixCache._all_reduce_attn_groups (hiradix_cache.py:222)\n"
            "    _patch_scheduler.<locals>.wrapper (repro_testbed_compat/__init__.py:150)\n"
            "Thread 2 (idle): \"repro-ledger\"\n    Ledger._loop (repro_injector/_ledger.py:841)\n"
            "Thread 3 (idle): \"Thread-4 (prefetch_thread_func)\"\n    Condition.wait (threading.py:331)\n")
    out = mod.strip(dump)
    assert "repro_" not in out and "Thread 2" not in out
    assert out.splitlines() == ["Process 1: sglang::scheduler_TP0", "", 'Thread 1 (idle): "MainThread"',
                                "    all_reduce (torch/distributed/distributed_c10d.py:3252)",
                                "    HiRadixCache._all_reduce_attn_groups (hiradix_cache.py:222)",
                                'Thread 3 (idle): "Thread-4 (prefetch_thread_func)"', "    Condition.wait (threading.py:331)"]
