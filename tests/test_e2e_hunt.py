"""End to end on the CPU testbed (real sglang 0.5.23, TP=2, HiCache + file storage): `repro hunt` rediscovers
sglang#30760 without being told where, and the #30760 patch (overlay) makes that row stop diverging in the prefetch
collective.

Only rank 0 × return-0 of `get_num_allocatable_reqs` (the full catalogue runs from benchmarks/hunt_full.py). Each
hunt launches a baseline server and a trial server (≈ 3–5 min on 2 cores); marked ``hang`` (own, deliberately hung
servers). Both tests also check that no process of the hunt is left running.
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
PATCH = REPO / "scenarios" / "sglang" / "patches" / "sglang-0.5.23-30760-bulk-prefetch.patch"
TIMEOUT_S = 1800  # seconds for one whole hunt (two launches, one stall)
PREFILL = "sglang.srt.managers.scheduler:Scheduler._get_new_batch_prefill_raw"

pytestmark = pytest.mark.hang


def _hunt(ev_root: Path, *extra: str) -> tuple[int, dict]:
    r = subprocess.run(
        [sys.executable, "-m", "repro.cli", "hunt", str(SCENARIO), "--only", "get_num_allocatable_reqs", "--rank", "0",
         "--perturbation", "zero_once", "--evidence-dir", str(ev_root), "--json", *extra],
        cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert r.returncode in (0, 3), f"exit {r.returncode}\nstdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}"
    assert processes_mentioning(ev_root) == []
    return r.returncode, json.loads(r.stdout)


def _in_loop(out: dict) -> dict:
    rows = [x for x in out["results"] if x["caller"] == PREFILL and x["loop_var"] == "req"]
    assert len(rows) == 1, out["results"]
    return rows[0]


def _is_30760(row: dict) -> bool:
    d = row.get("diagnosis") or {}
    return (row["verdict"] == "DEADLOCKED" and d.get("family") == "scheduling/cache"
            and str(d.get("collective", "")).startswith("prefetch all_reduce")
            and "UnifiedRadixCache._can_terminate_prefetch" in str(d.get("chain", "")) and d.get("known") == "sglang#30760")


def test_hunt_rediscovers_30760_in_the_admission_loop_row(tmp_path: Path) -> None:
    code, out = _hunt(tmp_path / "ev")
    # the baseline split the point into the call before the loop and the one inside `for req in waiting_queue`
    assert {(r["caller"], r["loop_var"]) for r in out["rows"]} >= {(PREFILL, None), (PREFILL, "req")}
    row = _in_loop(out)
    assert row["fired"] == {"0": 1, "1": 0} or row["fired"].get("0") == 1
    # the in-loop drift on rank 0 hangs the TP group in the prefetch all_reduce: DEADLOCKED, sglang#30760
    assert _is_30760(row), row
    assert code == 3  # a scheduling/cache deadlock was found
    hunt_md = Path(out["hunt_md"]).read_text()
    assert "prefetch all_reduce" in hunt_md and "sglang#30760" in hunt_md
    # the finding is a ready-to-run scenario
    from repro.scenario import load_scenario

    s = load_scenario(row["scenario_file"])
    assert s.variants[0].expect == "deadlock" and s.variants[0].injections[0].gate.inside_loop == row["loop_var"]
    lines = [json.loads(x) for x in (Path(out["folder"]) / "hunt.jsonl").read_text().splitlines()]
    assert [x["event"] for x in lines][-1] == "end"


def test_with_the_30760_patch_the_admission_loop_row_no_longer_diverges_in_the_prefetch_collective(tmp_path: Path) -> None:
    _, out = _hunt(tmp_path / "ev", "--ref", f"patch:{PATCH}")
    row = _in_loop(out)
    assert row["fired"].get("0") == 1, row  # the drift still happened on rank 0
    d = row["diagnosis"]
    assert row["verdict"] == "ALL REQUESTS SUCCEEDED" or not (d and d["collective"].startswith("prefetch all_reduce")), row
