"""End to end on the CPU testbed (real sglang 0.5.23, TP=2, HiCache + file storage): `repro reproduce` on the
stripped stacks of a real sglang#30760 root-cause hang (tests/fixtures/reproduce/hicache_30760_allocatable_drift:
py-spy text of both ranks, every injector frame removed) proposes the free-slot drift inside the waiting-queue loop,
and that one candidate, run on a real server, hangs with the dump's signature: REPRODUCED, exit 10.

One candidate, one server (deliberately hung, then torn down): marked ``hang``. Nothing of the run may be left.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from repro.procs import processes_mentioning

REPO = Path(__file__).resolve().parent.parent
DUMP = REPO / "tests" / "fixtures" / "reproduce" / "hicache_30760_allocatable_drift"
GNAR = "sglang.srt.managers.scheduler:Scheduler.get_num_allocatable_reqs"
TIMEOUT_S = 900

pytestmark = pytest.mark.hang


def _groups(sig: list[dict]) -> list[tuple]:
    """A signature's groups without rank ids (what equality of signatures compares)."""
    return sorted((len(g["ranks"]), g["state"], g["op"], tuple(g["frames"])) for g in sig)


def test_the_30760_root_cause_dump_is_reproduced_by_its_free_slot_drift_candidate(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "repro.cli", "reproduce", str(DUMP), "--out", str(out), "--json"]
    w = subprocess.run(cmd + ["--no-run"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert w.returncode == 0, w.stderr[-3000:]
    written = json.loads(w.stdout)
    drift = [c for c in written["candidates"] if c["kind"] == "root_cause" and c["injections"][0]["site"][0] == GNAR
             and c["injections"][0]["action"] == {"kind": "return_value", "value": 0}
             and c["injections"][0]["gate"].get("inside_loop") == "req"]
    assert len(drift) == 1, [c["name"] for c in written["candidates"]]
    ev_root = tmp_path / "ev"
    r = subprocess.run(cmd + ["--only", drift[0]["name"], "--evidence-dir", str(ev_root)], cwd=REPO,
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert processes_mentioning(ev_root) == []
    assert r.returncode == 10, f"exit {r.returncode}\nstdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}"
    res = json.loads(r.stdout)
    [t] = res["tried"]
    assert t["candidate"] == drift[0]["name"] and t["verdict"] == "DEADLOCKED" and t["outcome"] == "REPRODUCED", t
    assert _groups(t["signature"]) == _groups(res["signature"]), (t["signature"], res["signature"])
    assert any("_can_terminate_prefetch" in f for g in t["signature"] for f in g["frames"])
    md = Path(res["reproduction"]).read_text()
    assert md.startswith("# REPRODUCED") and drift[0]["name"] in md and "repro compare" in md
    from repro.scenario import load_scenario

    assert [v.name for v in load_scenario(Path(res["kept"])).variants] == [drift[0]["name"]]  # the winner, kept alone
