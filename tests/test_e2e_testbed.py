"""End-to-end on the CPU testbed: real SGLang TP=2 through the adapter + launcher (marked ``sglang``).

The server is the shared session fixture ``sglang_server`` (tests/sglang_fixtures.py): it is started through
``start_server`` + ``SGLangAdapter.testbed_profile`` and, at teardown, stopped with every snapshotted process
verified gone. These tests must not hang it.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import requests

from repro import testbed
from repro.launcher import LaunchError, start_server
from repro.procs import alive
from repro.targets.sglang import SGLangAdapter

from sglang_fixtures import SESSION_ENV, make_testbed_spec, session_leftovers

pytestmark = pytest.mark.sglang
ADAPTER = SGLangAdapter()


def _generate(url: str, input_ids: list[int], max_new_tokens: int, stream: bool):
    body = ADAPTER.generate_body(input_ids, max_new_tokens, stream)
    with requests.post(url + ADAPTER.generate_path, json=body, timeout=120, stream=stream) as r:
        assert r.status_code == 200, r.text[:500]
        if not stream:
            return ADAPTER.parse_response(r.json())
        last = None
        for line in r.iter_lines():
            u = ADAPTER.parse_stream_line(line)
            if u is not None and u.output_ids is not None:
                last = u
        return last


def test_five_generates_return_exactly_the_requested_number_of_ids(sglang_server):
    cases = [([11, 12, 13, 14], 4, False), ([21, 22], 7, True), ([31] * 30, 1, False), ([41, 42, 43], 12, True),
             ([51, 52, 53, 54, 55], 5, False)]
    with ThreadPoolExecutor(max_workers=5) as pool:
        results = list(pool.map(lambda c: _generate(sglang_server.url, *c), cases))
    assert len(results) == 5
    for (ids, n, stream), u in zip(cases, results):
        assert u is not None, f"no update for stream={stream}"
        assert u.error is None
        assert u.output_ids == n, (ids, n, stream, u)
        assert u.finish_reason == "length"


def test_both_scheduler_pids_map_to_tp0_and_tp1(sglang_server):
    ranks = sglang_server.rank_pids()
    assert sorted(ranks) == [0, 1]
    titles = {p.pid: p.title for p in sglang_server.procs()}
    assert titles[ranks[0]] == "sglang::scheduler_TP0"
    assert titles[ranks[1]] == "sglang::scheduler_TP1"
    assert any(t == "sglang::detokenizer" for t in titles.values())
    assert len(set(ranks.values())) == 2 and sglang_server.pid not in ranks.values()


def test_server_runs_the_cpu_stand_in_and_tiny_model(sglang_server):
    info = requests.get(sglang_server.url + "/model_info", timeout=10).json()
    assert Path(info["model_path"]) == testbed.tiny_model_dir()
    env = sglang_server.env
    assert env["PYTHONPATH"].split(":")[0] == str(testbed.stub_dir())
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"


def test_session_leak_check_sees_this_sessions_servers(sglang_server):
    """The end-of-session check is not vacuous: while the shared server runs, it is found."""
    left = session_leftovers(os.environ[SESSION_ENV])
    pids = {int(x.split()[0]) for x in left}
    assert sglang_server.pid in pids
    assert set(sglang_server.rank_pids().values()) <= pids


def test_real_server_failing_at_startup_gives_one_line_with_cause(tmp_path: Path):
    bad = replace(make_testbed_spec(), model=str(tmp_path / "no-such-model"))
    with start_server(ADAPTER, bad, tmp_path / "server.log") as server:
        snap = server.procs()
        with pytest.raises(LaunchError) as e:
            server.wait_healthy(240)
    msg = str(e.value)
    assert "\n" not in msg and "exited with code" in msg and str(tmp_path / "server.log") in msg
    assert not any(alive(p) for p in snap)
