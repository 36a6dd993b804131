"""End to end on the CPU testbed (real sglang 0.5.23, TP=2, HiCache + file storage): the #30760 story.

For both variants of scenarios/sglang/hicache_prefetch_30760.toml,
``repro compare … --before installed --after patch:<our 0.5.23 patch>`` must exit 0 with the facts issue 6 lists.
Each case launches two servers one after the other (≈ 4–5 min on 2 cores); marked ``hang`` (own, deliberately hung
servers).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from repro.compare import OVERLAY_PREFIX

REPO = Path(__file__).resolve().parent.parent
SCENARIO = REPO / "scenarios" / "sglang" / "hicache_prefetch_30760.toml"
PATCH = REPO / "scenarios" / "sglang" / "patches" / "sglang-0.5.23-30760-bulk-prefetch.patch"
TIMEOUT_S = 1500  # seconds for the whole compare (two launches, a stall and a burst)

pytestmark = pytest.mark.hang


def _overlays() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).iterdir() if p.name.startswith(OVERLAY_PREFIX)}


def _compare(variant: str, ev_root: Path) -> dict:
    left = _overlays()
    r = subprocess.run(
        [sys.executable, "-m", "repro.cli", "compare", str(SCENARIO), "--variant", variant, "--before", "installed",
         "--after", f"patch:{PATCH}", "--evidence-dir", str(ev_root), "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}"
    assert _overlays() == left, "the patch overlay was left behind"
    out = json.loads(r.stdout)
    assert Path(out["comparison"]).is_file()
    return out


def _side(out: dict, name: str) -> dict:
    return next(s for s in out["sides"] if s["side"] == name)


def _analysis(side: dict) -> dict:
    data = json.loads((Path(side["evidence"]) / "analysis.json").read_text())
    data = json.loads(data) if isinstance(data, str) else data
    return {r["rank"]: r for r in data["ranks"]}


def _counts(side: dict, injection: str) -> dict[int, dict]:
    return {r["rank"]: r["counts"].get(injection, {"entered": 0, "matched": 0, "fired": 0}) for r in side["ranks"]}


def test_extra_collective_deadlocks_before_and_passes_after_because_the_loop_site_is_gone(tmp_path: Path) -> None:
    out = _compare("extra_collective", tmp_path / "evidence")
    before, after = _side(out, "before"), _side(out, "after")
    assert before["verdict"] == "DEADLOCKED"
    ranks = _analysis(before)
    tp0 = ranks[0]
    # TP0 fired the extra all_reduce inside check_prefetch_progress called from the loop; gloo paired it with its
    # peer's prefetch all_reduce, so TP0 waits in the prefetch all_reduce under the same call: no partner left.
    assert tp0["state"] == "collective" and tp0["op"] == "all_reduce"
    assert "UnifiedRadixCache.check_prefetch_progress" in tp0["caller_chain"]
    assert "Scheduler._get_new_batch_prefill_raw" in tp0["caller_chain"]
    assert ranks[1]["caller_chain"] != tp0["caller_chain"]
    fired = _counts(before, "extra_allreduce_in_prefetch_check")
    assert fired[0]["fired"] == 1 and fired[1]["fired"] == 0

    assert after["verdict"] == "ALL REQUESTS SUCCEEDED"
    assert after["requests_ok"] == after["requests_total"] == 8
    c = _counts(after, "extra_allreduce_in_prefetch_check")
    assert c[0]["entered"] > 0 and c[1]["entered"] > 0  # still called on every rank: by the bulk pre-pass
    assert c[0]["matched"] == 0 and c[1]["matched"] == 0  # never from inside the loop
    assert any("gate never matched" in n for n in after["notes"])


def test_allocatable_drift_deadlocks_before_and_is_harmless_after_the_fix(tmp_path: Path) -> None:
    out = _compare("allocatable_drift", tmp_path / "evidence")
    before, after = _side(out, "before"), _side(out, "after")
    assert before["verdict"] == "DEADLOCKED"
    ranks = _analysis(before)
    tp1 = ranks[1]  # the rank that did not drift: its extra prefetch all_reduce has no partner
    assert tp1["state"] == "collective" and tp1["op"] == "all_reduce"
    for frame in ("UnifiedRadixCache._can_terminate_prefetch", "UnifiedRadixCache.check_prefetch_progress",
                  "Scheduler._get_new_batch_prefill_raw"):
        assert frame in tp1["caller_chain"], tp1["caller_chain"]
    assert "UnifiedRadixCache._can_terminate_prefetch" not in ranks[0]["caller_chain"]  # the drifting rank is elsewhere
    assert _counts(before, "allocatable_zero_once")[0]["fired"] == 1

    assert after["verdict"] == "ALL REQUESTS SUCCEEDED"
    assert after["requests_ok"] == after["requests_total"] == 8
    drift = _counts(after, "allocatable_zero_once")
    assert drift[0]["fired"] == 1 and drift[1]["fired"] == 0  # the drift still happened
    checks = _counts(after, "count_prefetch_checks")
    assert checks[0]["entered"] == checks[1]["entered"] > 0  # every rank made the same prefetch checks
