"""Real SGLang TP=2 across two namespaced hosts (scripts/multihost/rig.py): one rank per host, gloo on the data
link, the harness in a namespace of its own reaching the hosts only through ssh (or the stand-in kubectl), so every
stack it holds was taken by py-spy on the rank's own host. Root only; starts real servers (run under the e2e lock)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from repro import testbed
from tests.multihost_fixtures import REPO, rig2, run_in_rig  # noqa: F401 (rig2 is a fixture)

pytestmark = pytest.mark.multihost

SMOKE = REPO / "scenarios" / "sglang" / "smoke_extra_allreduce.toml"


@pytest.fixture(autouse=True)
def _testbed():
    if not testbed.is_set_up():
        pytest.skip(f"CPU testbed not set up ({testbed.setup_command()})")


def _evidence(res) -> Path:
    assert res is not None, "the harness printed no result line"
    return Path(res["evidence"])


def _assert_hosts_clean(rig):
    for h in rig.state.hosts:
        procs = rig.host_procs(h.name)
        assert procs == [], f"{h.name} still runs {procs} besides its sshd"


def _deadlock_checks(rig, rc, res, err):
    assert rc == 3, err[-3000:]
    assert res["verdict"] == "DEADLOCKED"
    evd = _evidence(res)
    hosts = json.loads((evd / "hosts.json").read_text())
    assert {r["host"] for r in hosts["ranks"].values()} == {"h0", "h1"}
    cap = json.loads((evd / "stacks" / "capture-1.json").read_text())
    by_rank = {p["rank"]: p for p in cap["processes"]}
    assert by_rank[0]["host"] == "h0" and by_rank[1]["host"] == "h1"
    assert all(p["ok"] and p["method"] == "py-spy" for p in cap["processes"])
    for k in (0, 1):  # each capture names the pid its host reported for that rank (its own PID namespace)
        assert by_rank[k]["pid"] == hosts["ranks"][str(k)]["pid"]
    analysis = json.loads((evd / "analysis.json").read_text())
    assert "all_reduce" in json.dumps(analysis)
    assert (evd / "hosts" / "h0" / "server.log").stat().st_size > 0
    assert (evd / "hosts" / "h1" / "server.log").stat().st_size > 0
    assert list((evd / "hosts" / "h0" / "injector").glob("fires-*.jsonl"))
    assert list((evd / "hosts" / "h1" / "injector").glob("fires-*.jsonl"))
    _assert_hosts_clean(rig)


def test_tp2_across_two_hosts_deadlocks_with_both_stacks_taken_over_ssh(rig2, tmp_path):
    rc, res, err = run_in_rig(rig2, [SMOKE, "--variant", "extra_collective"], tmp_path)
    _deadlock_checks(rig2, rc, res, err)


def test_tp2_across_two_hosts_control_succeeds(rig2, tmp_path):
    rc, res, err = run_in_rig(rig2, [SMOKE, "--variant", "control"], tmp_path)
    assert rc == 0 and res["verdict"] == "ALL REQUESTS SUCCEEDED", err[-3000:]
    _assert_hosts_clean(rig2)


def test_cut_data_link_mid_burst_is_inconclusive_naming_the_host(rig2, tmp_path):
    cut = threading.Event()

    def on_line(line: str) -> None:
        if "burst_started" in line and not cut.is_set():
            rig2.set_data_link("h1", up=False)
            cut.set()

    rc, res, err = run_in_rig(rig2, [SMOKE, "--variant", "control", "--requests", "64"], tmp_path, on_line=on_line)
    assert cut.is_set(), err[-3000:]
    assert rc == 4 and res["verdict"] == "INCONCLUSIVE", err[-3000:]
    assert "host h1's data link is lost" in res["reason"] and "data0 is down" in res["reason"]
    _assert_hosts_clean(rig2)


def test_tp2_through_the_kubectl_template_deadlocks(rig2, tmp_path):
    rc, res, err = run_in_rig(rig2, [SMOKE, "--variant", "extra_collective"], tmp_path, via="kubectl")
    _deadlock_checks(rig2, rc, res, err)
    hosts = json.loads((_evidence(res) / "hosts.json").read_text())
    assert all("kubectl" in n["reach"] and "exec" in n["reach"] for n in hosts["nodes"])
