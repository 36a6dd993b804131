"""End to end on the CPU testbed (real sglang 0.5.23, TP=2, HiCache + file storage): with the hand catalogue's
points dropped, discovery alone (an AST scan of the installed sglang, run in the testbed's interpreter) proposes the
#30760 decision point inside the admission loop, and one short hunt of that row rediscovers sglang#30760 (the
hunt's own rediscovery case: diagnosis, HUNT.md, the ready-to-run finding scenario; tests/test_e2e_hunt.py runs the
hand catalogue's row against the #30760 patch).

One row × return-0 × rank 0: a baseline server and a trial server, one deadlock (the last trial: no restart).
Marked ``hang`` (own, deliberately hung servers); checks that nothing of the hunt is left running.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from repro.procs import processes_mentioning

REPO = Path(__file__).resolve().parent.parent
SCENARIO = REPO / "scenarios" / "sglang" / "hicache_prefetch_30760.toml"
PREFILL = "sglang.srt.managers.scheduler:Scheduler._get_new_batch_prefill_raw"
GNAR = "sglang.srt.managers.scheduler:Scheduler.get_num_allocatable_reqs"
TIMEOUT_S = 1200

pytestmark = pytest.mark.hang


def test_discovery_alone_finds_the_30760_loop_row_and_the_hunt_rediscovers_30760(tmp_path: Path) -> None:
    d = subprocess.run([sys.executable, "-m", "repro.cli", "discover", str(SCENARIO), "--json"], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert d.returncode == 0, d.stderr[-3000:]
    disc = json.loads(d.stdout)
    point = next(p for p in disc["points"] if p["site"] == GNAR and p["caller"] == PREFILL and p["loop_vars"] == ["req"])
    ev_root = tmp_path / "ev"
    r = subprocess.run(
        [sys.executable, "-m", "repro.cli", "hunt", str(SCENARIO), "--discover", "--no-hand-catalogue",
         "--only", point["name"], "--perturbation", "zero_once", "--rank", "0", "--evidence-dir", str(ev_root), "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode in (0, 3), f"exit {r.returncode}\nstdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}"
    assert processes_mentioning(ev_root) == []
    out = json.loads(r.stdout)
    assert [(x["caller"], x["loop_var"]) for x in out["rows"]] == [(PREFILL, "req")]  # the point kept only its loop row
    row = out["results"][0]
    dg = row.get("diagnosis") or {}
    assert row["fired"].get("0") == 1, row
    assert row["verdict"] == "DEADLOCKED" and dg.get("known") == "sglang#30760", row
    assert str(dg.get("collective", "")).startswith("prefetch all_reduce"), row
    assert dg.get("family") == "scheduling/cache" and "UnifiedRadixCache._can_terminate_prefetch" in str(dg.get("chain")), dg
    hunt_md = Path(out["hunt_md"]).read_text()
    assert "prefetch all_reduce" in hunt_md and "sglang#30760" in hunt_md
    # the finding is a ready-to-run scenario, gated inside the loop the row names
    from repro.scenario import load_scenario

    s = load_scenario(row["scenario_file"])
    assert s.variants[0].expect == "deadlock" and s.variants[0].injections[0].gate.inside_loop == row["loop_var"] == "req"
    assert r.returncode == 3
    assert out["discovery"]["points"]["deadlocked_points"] == [point["name"]]
    folder = Path(out["folder"])
    assert (folder / "discovery" / "catalogue.toml").is_file() and (folder / "discovery" / "PRECISION.md").is_file()
    assert [json.loads(x)["event"] for x in (folder / "hunt.jsonl").read_text().splitlines()][-1] == "end"
