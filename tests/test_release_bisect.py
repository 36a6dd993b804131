"""``repro bisect`` over releases (issue 34) with a stand-in runner: the first release at which the verdict changes,
each step's evidence, BISECT.md, the exit codes, and a release that is not set up refused before anything runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from repro import releases as rel
from repro.release_bisect import BisectError, BisectOptions, bisect, release_range

REPO = Path(__file__).resolve().parent.parent
SCENARIO = REPO / "scenarios" / "sglang" / "hicache_prefetch_30760.toml"


class StandIn:
    """Runs nothing: a release's verdict is DEADLOCKED while its factory builds HiRadixCache (the site is reached),
    else SUCCEEDED, as a scenario whose site resolves in 0.5.18-0.5.20 but is reached only up to 0.5.18. Each call
    writes an evidence folder with a REPORT.md, as a run does."""

    def __init__(self) -> None:
        self.index = rel.load_index("sglang")
        self.calls: list[tuple[str, str]] = []

    def __call__(self, version: str, ref: str, root: Path) -> tuple[str, Path, str]:
        self.calls.append((version, ref))
        verdict = "DEADLOCKED" if self.index.get(version).builds("HiRadixCache") else "ALL REQUESTS SUCCEEDED"
        folder = root / f"step-{version}"
        folder.mkdir(parents=True)
        (folder / "REPORT.md").write_text(f"# {verdict}\n")
        return verdict, folder, "stand-in"


def _opts(tmp_path: Path, good: str, bad: str) -> BisectOptions:
    return BisectOptions(scenario_path=SCENARIO, good=good, bad=bad, variant="allocatable_drift",
                         evidence_root=tmp_path / "ev")


def test_bisect_between_0_5_18_and_0_5_20_finds_0_5_19(tmp_path: Path) -> None:
    run = StandIn()
    res = bisect(_opts(tmp_path, "release:0.5.18", "release:0.5.20"), runner=run, check=lambda vs: None)
    assert res.releases == ["0.5.18", "0.5.19", "0.5.20"]
    assert (res.first_changed, res.last_same, res.exit_code) == ("0.5.19", "0.5.18", 0)
    assert [v for v, _ in run.calls] == ["0.5.18", "0.5.20", "0.5.19"]
    md = (res.folder / "BISECT.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| 0.5.19 ← first change | `release:0.5.19` |"))
    assert md.startswith("# First change at 0.5.19") and row.split(" | ")[3] == "ALL REQUESTS SUCCEEDED", row
    for s in res.steps:
        assert (s.evidence / "REPORT.md").is_file() and f"{s.evidence}/REPORT.md" in md
    assert json.loads((res.folder / "bisect.json").read_text())["first_changed"] == "0.5.19"


def test_bisect_over_the_whole_index_is_a_binary_search_in_release_order(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("fix.patch").write_text("--- a/sglang/x.py\n+++ b/sglang/x.py\n")  # checked to exist before anything runs
    run = StandIn()
    with pytest.raises(BisectError, match="differ only in the release"):
        bisect(_opts(tmp_path, "release:0.5.14", "release:0.5.23+patch:fix.patch"), runner=run, check=lambda vs: None)
    res = bisect(_opts(tmp_path, "release:0.5.14+patch:fix.patch", "release:0.5.23+patch:fix.patch"), runner=run,
                 check=lambda vs: None)
    assert res.releases == rel.load_index("sglang").versions()
    assert res.first_changed == "0.5.19" and res.last_same == "0.5.18" and res.exit_code == 0
    assert len(run.calls) <= 2 + 4  # both ends + ceil(log2(10))
    assert all(ref.endswith("+patch:fix.patch") for _, ref in run.calls)  # the patch is carried to every release
    md = (res.folder / "BISECT.md").read_text()
    assert md.count("| not run |") == len(res.releases) - len(run.calls)


def test_a_fix_found_walking_backwards_and_ends_that_agree(tmp_path: Path) -> None:
    run = StandIn()
    res = bisect(_opts(tmp_path, "release:0.5.21", "release:0.5.17"), runner=run, check=lambda vs: None)
    assert res.releases == ["0.5.21", "0.5.20", "0.5.19", "0.5.18", "0.5.17"]  # good end first
    assert (res.first_changed, res.last_same) == ("0.5.18", "0.5.19")
    res = bisect(_opts(tmp_path, "release:0.5.14", "release:0.5.18"), runner=StandIn(), check=lambda vs: None)
    assert res.first_changed is None and res.exit_code == 3  # both DEADLOCKED: the verdict's code
    assert (res.folder / "BISECT.md").read_text().startswith("# No change")


@pytest.mark.parametrize("good, bad, needle", [
    ("installed", "release:0.5.20", "bisect walks releases; expected release:V"),
    ("release:0.5.18", "patch:x.patch", "bisect walks releases"),
    ("release:0.5.18", "release:0.5.18", "the same release"),
    ("release:0.5.18", "release:0.6.0", "'0.6.0' is not in the release index"),
])
def test_bad_input_is_refused_before_anything_runs(tmp_path: Path, good: str, bad: str, needle: str) -> None:
    run = StandIn()
    with pytest.raises(BisectError, match=needle) as e:
        bisect(_opts(tmp_path, good, bad), runner=run, check=lambda vs: None)
    assert "\n" not in str(e.value) and run.calls == []


def test_a_release_not_set_up_is_one_line_naming_the_setup_command_and_nothing_runs(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("REPRO_TESTBED_DIR", raising=False)
    run = StandIn()
    with pytest.raises(BisectError) as e:
        bisect(_opts(tmp_path, "release:0.5.18", "release:0.5.20"), runner=run)
    msg = str(e.value)
    assert "\n" not in msg and "every release from 0.5.18 to 0.5.20 set up" in msg
    assert "sglang 0.5.18 is not set up" in msg and "set it up with: bash scripts/cpu_testbed/setup.sh --release 0.5.18" in msg
    assert run.calls == [] and not (tmp_path / "ev").exists()
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    env.pop("REPRO_TESTBED_DIR", None)
    r = subprocess.run([sys.executable, "-m", "repro", "bisect", str(SCENARIO), "--good", "release:0.5.18",
                        "--bad", "release:0.5.20", "--evidence-dir", str(tmp_path / "ev")], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "sglang 0.5.18 is not set up" in lines[0], r.stderr


def test_release_range_is_the_index_order() -> None:
    assert release_range("release:0.5.15", "release:0.5.16", "sglang")[0] == ["0.5.15", "0.5.15.post1", "0.5.16"]


def test_the_bisect_scenario_resolves_in_0_5_18_to_0_5_20_but_runs_only_in_0_5_18() -> None:
    """scenarios/sglang/releases/hiradix_prefetch_30760.toml (the seed's injection on HiRadixCache alone): its site is
    a function of 0.5.14-0.5.20's source (release index) and of no later release; sites' dead-code warning names
    0.5.19 and 0.5.20 (their factory builds UnifiedRadixCache), not 0.5.18."""
    from repro import releases as rel
    from repro.scenario import load_scenario

    sc = load_scenario(REPO / "scenarios" / "sglang" / "releases" / "hiradix_prefetch_30760.toml")
    (site,) = sc.variant("extra_collective").injections[0].site
    idx = rel.load_index("sglang")
    mask = idx.frame_mask(rel.FrameRef("sglang/srt/mem_cache/hiradix_cache.py", site.split(":", 1)[1]))
    assert idx.mask_versions(mask) == ["0.5.14", "0.5.15", "0.5.15.post1", "0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20"]
    assert rel.never_built(site, "0.5.18", "sglang") is None
    assert all("never builds HiRadixCache" in (rel.never_built(site, v, "sglang") or "") for v in ("0.5.19", "0.5.20"))
