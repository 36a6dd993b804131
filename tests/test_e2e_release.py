"""End to end on an older release (issue 34): the seed's #30760 story on its own code, sglang 0.5.18's HiRadixCache.

``repro compare scenarios/sglang/hicache_prefetch_30760.toml --variant allocatable_drift --before release:0.5.18
--after release:0.5.18+patch:<the seed's fix for 0.5.18>`` must exit 0: DEADLOCKED before (the peer of the drifting
rank waits in HiRadixCache's prefetch all_reduce called from the scheduler's waiting-queue loop), ALL REQUESTS
SUCCEEDED after (the drift still happens and is harmless), COMPARISON.md naming the release and that it ran in its
own venv, and the 0.5.18 lockstep-state probes read on the real server on both sides.

Needs the 0.5.18 testbed (``bash scripts/cpu_testbed/setup.sh --release 0.5.18``; ``bash scripts/test.sh release``
sets it up). Marked ``release``: the one old-release server test of the suite (two launches, ≈ 3–4 min on 2 cores).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from repro import releases

REPO = Path(__file__).resolve().parent.parent
SCENARIO = REPO / "scenarios" / "sglang" / "hicache_prefetch_30760.toml"
PATCH = REPO / "scenarios" / "sglang" / "patches" / "sglang-0.5.18-30760-bulk-prefetch.patch"
RELEASE = "0.5.18"
TIMEOUT_S = 1500  # seconds for the whole compare (two launches, a stall and a burst)

pytestmark = pytest.mark.release


def _counts(side: dict, injection: str) -> dict[int, dict]:
    return {r["rank"]: r["counts"].get(injection, {"entered": 0, "matched": 0, "fired": 0}) for r in side["ranks"]}


def test_allocatable_drift_on_0_5_18_deadlocks_before_and_is_harmless_after_the_seeds_fix(tmp_path: Path) -> None:
    try:
        py = releases.release_python(RELEASE, "sglang")
    except releases.ReleaseError as e:
        pytest.fail(str(e))
    proc = subprocess.Popen(
        [sys.executable, "-m", "repro.cli", "compare", str(SCENARIO), "--variant", "allocatable_drift",
         "--before", f"release:{RELEASE}", "--after", f"release:{RELEASE}+patch:{PATCH}",
         "--evidence-dir", str(tmp_path / "evidence"), "--json"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.terminate()  # SIGTERM = Ctrl-C for the CLI: it tears its server down
            proc.communicate(timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{stdout[-4000:]}\nstderr:\n{stderr[-4000:]}"
    out = json.loads(stdout)
    before, after = (next(s for s in out["sides"] if s["side"] == n) for n in ("before", "after"))

    assert before["verdict"] == "DEADLOCKED"
    analysis = json.loads((Path(before["evidence"]) / "analysis.json").read_text())
    analysis = json.loads(analysis) if isinstance(analysis, str) else analysis
    ranks = {r["rank"]: r for r in analysis["ranks"]}
    # the rank that did not drift: its prefetch all_reduce, made from inside the loop, has no partner
    tp1 = ranks[1]
    assert tp1["state"] == "collective" and tp1["op"] == "all_reduce"
    for frame in ("HiRadixCache._all_reduce_attn_groups", "HiRadixCache.can_terminate_prefetch",
                  "HiRadixCache.check_prefetch_progress", "Scheduler._get_new_batch_prefill_raw"):
        assert frame in tp1["caller_chain"], tp1["caller_chain"]
    assert _counts(before, "allocatable_zero_once")[0]["fired"] == 1

    assert after["verdict"] == "ALL REQUESTS SUCCEEDED"
    assert after["requests_ok"] == after["requests_total"] == 8
    drift = _counts(after, "allocatable_zero_once")
    assert drift[0]["fired"] == 1 and drift[1]["fired"] == 0  # the drift still happened

    md = Path(out["comparison"]).read_text()
    assert f"sglang {RELEASE} (its own venv)" in md  # the release, and which interpreter ran it
    for side in (before, after):
        env = json.loads((Path(side["evidence"]) / "env.json").read_text())
        assert env["sglang"] == RELEASE and env["target_python"] == py
        assert env["testbed"] == f"sglang {RELEASE} (its own venv)"
    # the 0.5.18 lockstep-state probes resolved on the real server: every side compared them tick by tick
    lines = md.splitlines()
    for name in ("before", "after"):
        i = next(k for k, line in enumerate(lines) if line.startswith(f"- **{name}**"))
        assert lines[i + 1].startswith(("  - state: first divergent state at scheduler tick",
                                        "  - state: equal through tick")), lines[i + 1]
