"""End to end on the CPU testbed (real sglang 0.5.23, TP=2, HiCache + file storage): with the #30760 patch (an
overlay), the hand catalogue's admission-loop row of `get_num_allocatable_reqs` no longer diverges in the prefetch
collective. The unpatched rediscovery of sglang#30760 is tests/test_e2e_discover.py's hunt (the same row, found by
discovery alone); the full catalogue runs from benchmarks/hunt_full.py.

Only rank 0 × return-0, plus one *natural* trial on the same trial server (issue 35): the same row delayed 2 s
(``delay_once``, a natural nemesis): it fires once on rank 0, is labelled natural, and leaves the lockstep state
equal or reconciled (≤ 1 min more: one burst on the running server). The hunt launches a baseline server and a trial server (≈ 2–3 min on 2 cores); marked
``hang`` (own servers). The test also checks that no process of the hunt is left running.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from repro.natural_effect import STATUSES
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
         "--perturbation", "zero_once", "--perturbation", "delay_once", "--evidence-dir", str(ev_root), "--json", *extra],
        cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert r.returncode in (0, 3), f"exit {r.returncode}\nstdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}"
    assert processes_mentioning(ev_root) == []
    return r.returncode, json.loads(r.stdout)


def _in_loop(out: dict, perturbation: str = "zero_once") -> dict:
    rows = [x for x in out["results"] if x["caller"] == PREFILL and x["loop_var"] == "req" and x["perturbation"] == perturbation]
    assert len(rows) == 1, out["results"]
    return rows[0]


def test_with_the_30760_patch_the_admission_loop_row_no_longer_diverges_in_the_prefetch_collective(tmp_path: Path) -> None:
    _, out = _hunt(tmp_path / "ev", "--ref", f"patch:{PATCH}")
    # the baseline split the hand point into the call before the loop and the one inside `for req in waiting_queue`
    assert {(r["caller"], r["loop_var"]) for r in out["rows"]} >= {(PREFILL, None), (PREFILL, "req")}, out["rows"]
    row = _in_loop(out)
    assert row["fired"].get("0") == 1, row  # the drift still happened on rank 0
    d = row["diagnosis"]
    assert row["verdict"] == "ALL REQUESTS SUCCEEDED" or not (d and d["collective"].startswith("prefetch all_reduce")), row
    natural = _in_loop(out, "delay_once")
    assert natural["nature"] == "natural" and natural["fired_on_target"] == 1, natural
    assert natural["verdict"] == "ALL REQUESTS SUCCEEDED", natural  # slow is not stuck
    # a delay is absorbed: nothing lockstep stays different (transient episodes are inputs the engine reconciles; so
    # is a reduction whose inputs differed while rank 0 slept and which gave every rank one answer, `input reconciled`)
    assert natural["effect_status"] in ("none moved", "reconciled", "transient reconciled", "transient open",
                                        "input reconciled"), natural
    assert natural["effect_status"] in STATUSES, natural
