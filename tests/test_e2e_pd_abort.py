"""PD disaggregation: the mass-abort variant (4 of 8 in-flight clients disconnect at once, no injection) on a real
prefill + decode + router stack. Marked ``pd_abort`` and kept out of the CI stages: in 1 of 2 clean-clone CI runs the
aborted requests never reached the decode server's ``Scheduler.abort_request``, so its observe-only site was not
entered and the run was (honestly) INCONCLUSIVE — the counting site must move to where an abort before the first
token is handled (open work on the PD issue). Run apart: ``python -m pytest -m pd_abort``."""

from __future__ import annotations

import json

import pytest

from repro.verdict import DEADLOCKED, SUCCEEDED
from test_e2e_pd import run_pd_variants  # tests/ is on sys.path (see tests/conftest.py)

pytestmark = pytest.mark.pd_abort


@pytest.fixture(scope="module")
def pd_results(tmp_path_factory):
    return run_pd_variants(tmp_path_factory, "pd-abort-evidence", ["mass_abort"])


def test_pd_mass_abort_with_no_fault_gives_a_verdict_and_counts_aborts_per_rank(pd_results):
    _, by = pd_results
    r = by["mass_abort"]
    assert r.verdict.verdict in (SUCCEEDED, DEADLOCKED, "DESYNCED"), r.verdict.reason
    events = [json.loads(x) for x in (r.evidence / "requests.jsonl").read_text().splitlines()]
    cut = [e for e in events if e.get("event") == "abort"]
    assert len(cut) == 1 and len(cut[0]["requests"]) == 4
    assert "count_aborts" in (r.evidence / "servers" / "decode" / "REPORT.md").read_text()  # aborts per rank
    assert "count_bootstrap_pops" in (r.evidence / "servers" / "prefill" / "REPORT.md").read_text()
    top = (r.evidence / "REPORT.md").read_text()
    assert "## After the mass abort" in top and all(f"prefill TP{k}:" in top for k in range(4))
