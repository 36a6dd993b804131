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

from repro.compare import OVERLAY_PREFIX, OWNER_FILE
from repro.procs import alive, load_procs, stop_procs

REPO = Path(__file__).resolve().parent.parent
SCENARIO = REPO / "scenarios" / "sglang" / "hicache_prefetch_30760.toml"
PATCH = REPO / "scenarios" / "sglang" / "patches" / "sglang-0.5.23-30760-bulk-prefetch.patch"
TIMEOUT_S = 1500  # seconds for the whole compare (two launches, a stall and a burst)

pytestmark = pytest.mark.hang


def _overlays(owner_pid: int) -> set[str]:
    """Overlays in the temp dir owned by the harness process ``owner_pid`` (others may run compare/hunt meanwhile)."""
    out = set()
    for p in Path(tempfile.gettempdir()).glob(OVERLAY_PREFIX + "*"):
        try:
            if json.loads((p / OWNER_FILE).read_text())["pid"] == owner_pid:
                out.add(p.name)
        except (OSError, ValueError, KeyError):
            continue
    return out


def _compare(variant: str, ev_root: Path) -> dict:
    proc = subprocess.Popen(
        [sys.executable, "-m", "repro.cli", "compare", str(SCENARIO), "--variant", variant, "--before", "installed",
         "--after", f"patch:{PATCH}", "--evidence-dir", str(ev_root), "--json"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.terminate()  # SIGTERM = Ctrl-C for the CLI: it tears its server down
            proc.communicate(timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{stdout[-4000:]}\nstderr:\n{stderr[-4000:]}"
    assert not _overlays(proc.pid), "the patch overlay was left behind"
    out = json.loads(stdout)
    assert Path(out["comparison"]).is_file()
    # issue 33: each side's first divergent lockstep state (or "equal through tick N") stands next to its verdict
    md = Path(out["comparison"]).read_text().splitlines()
    for side in ("before", "after"):
        i = next(k for k, l in enumerate(md) if l.startswith(f"- **{side}**"))
        assert md[i + 1].startswith(("  - state: first divergent state at scheduler tick", "  - state: equal through tick")), md[i + 1]
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


def test_interrupted_compare_tears_down_the_server_and_removes_the_overlay(tmp_path: Path) -> None:
    import os
    import signal
    import time

    ev_root = tmp_path / "evidence"
    proc = subprocess.Popen(
        [sys.executable, "-m", "repro.cli", "compare", str(SCENARIO), "--variant", "allocatable_drift",
         "--before", f"patch:{PATCH}", "--after", "installed", "--evidence-dir", str(ev_root)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        deadline = time.time() + 300
        procs_file = None
        while time.time() < deadline and proc.poll() is None:  # wait until the before-side server has processes
            found = list(ev_root.glob("*/*-before/processes.json"))
            if found:
                procs_file = found[0]
                break
            time.sleep(1)
        assert procs_file is not None, "the before-side server never started"
        assert _overlays(proc.pid), "no overlay while the patched side runs"
        time.sleep(5)
        recorded = load_procs(procs_file)  # pid + start ticks (the launch-marked form the runner writes)
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if procs_file is not None:  # the server runs in its own session: end the recorded tree by pid too
                stop_procs(load_procs(procs_file))
    assert proc.returncode == 143, out[-3000:]  # SIGTERM: 143 (README exit codes), same teardown as Ctrl-C
    assert "interrupted" in out
    assert not _overlays(proc.pid), "the overlay was left behind after an interrupt"
    assert recorded
    still = [p.pid for p in recorded if alive(p)]
    assert not still, f"server processes left running: {still}"
