"""The injector inside a real SGLang TP=2 server on the CPU testbed (own server, deliberately hung).

Every scheduler process writes a loaded marker; with the smoke scenario armed the fire log shows a fire on rank 0 and
none on rank 1, while the site is entered on both.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import requests

from repro.injection_records import read_injector_dir

REPO = Path(__file__).resolve().parent.parent
SCENARIO = REPO / "scenarios" / "sglang" / "smoke_extra_allreduce.toml"
STARTUP_S = 600.0  # cold start on a loaded 2-core box; a bound, not a goal
RECORDS_S = 120.0


def _wait(pred, what: str, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.hang
def test_smoke_armed_fires_on_rank0_only_and_site_entered_on_both(tmp_path: Path):
    from repro.launcher import start_server
    from repro.runner import RunOptions, prepare, write_arm_file

    p = prepare(RunOptions(scenario_path=SCENARIO, variant="extra_collective", evidence_root=tmp_path, label="injector-e2e"))
    assert p.on_testbed, "this test runs on the CPU testbed (scripts/cpu_testbed/setup.sh)"
    server = start_server(p.adapter, p.spec, p.evidence.file("server.log"))
    threads: list[threading.Thread] = []
    try:
        server.wait_healthy(STARTUP_S)
        ranks = server.rank_pids()
        assert sorted(ranks) == [0, 1]
        rep = read_injector_dir(p.evidence.injector_dir)
        by_pid = {m.pid: m for m in rep.markers}
        for rank, pid in ranks.items():  # every scheduler process loaded the injector and patched the site
            m = by_pid[pid]
            assert m.sites["extra_allreduce_before_run_batch"].patched, m
            assert m.sites["extra_allreduce_before_run_batch"].resolved == "sglang.srt.managers.scheduler:Scheduler.run_batch"
        assert not any(f for f in rep.fires())  # never before arming (the warm-up passed)

        write_arm_file(p.arm_file, ["extra_allreduce_before_run_batch"])
        body = p.adapter.generate_body(list(range(1, 17)), 8, stream=False)

        def send() -> None:
            try:
                requests.post(server.url + "/generate", json=body, timeout=30)
            except requests.RequestException:
                pass  # the server is meant to hang

        for _ in range(2):
            t = threading.Thread(target=send, daemon=True)
            t.start()
            threads.append(t)

        def settled():
            r = read_injector_dir(p.evidence.injector_dir)
            return r if r.fired_ranks("extra_allreduce_before_run_batch") and r.entered_on_all("extra_allreduce_before_run_batch", [0, 1]) else None

        rep = _wait(settled, "a fire on rank 0 and the site entered on both ranks", RECORDS_S)
        assert rep.ranks_loaded([0, 1]) == [0, 1] and rep.ranks_armed([0, 1]) == [0, 1]
        assert rep.fired_ranks("extra_allreduce_before_run_batch") == [0]
        counts = rep.counts_by_rank("extra_allreduce_before_run_batch")
        assert counts["fired"].get(1, 0) == 0 and counts["entered"][1] >= 1
        (fire,) = rep.fires("extra_allreduce_before_run_batch")
        assert fire.rank == 0 and fire.caller == "sglang.srt.managers.scheduler:Scheduler.event_loop_normal"
        time.sleep(2.0)
        again = read_injector_dir(p.evidence.injector_dir).fires("extra_allreduce_before_run_batch")
        assert again[0].completed is None  # rank 0 is still inside the extra all_reduce: the deadlock holds
    finally:
        server.stop()
        for t in threads:
            t.join(timeout=35)
