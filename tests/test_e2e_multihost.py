"""Real SGLang TP=2 across two namespaced hosts (scripts/multihost/rig.py): one rank per host, gloo on the data
link, the harness in a namespace of its own reaching the hosts only through ssh (or the stand-in kubectl), so every
stack it holds was taken by py-spy on the rank's own host. Root only; starts real servers (run under the e2e lock)."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from repro import testbed
from tests.multihost_fixtures import REPO, rig2_shared, run_in_rig  # noqa: F401 (rig2_shared is a fixture)

pytestmark = pytest.mark.multihost

SMOKE = REPO / "scenarios" / "sglang" / "smoke_extra_allreduce.toml"


def _need_testbed():
    if not testbed.is_set_up():
        pytest.fail(f"CPU testbed not set up: run `{testbed.setup_command()}` (the multihost stage needs it)")


@pytest.fixture(scope="module")
def rig(rig2_shared):
    """The module's rig, with the testbed checked first (a missing testbed fails the stage, it does not skip)."""
    _need_testbed()
    return rig2_shared


@pytest.fixture(scope="module")
def ssh_pair(rig, tmp_path_factory):
    """control, then control again with rank 1 SIGKILLed on its host mid-burst, on ONE TP=2 server over ssh (one
    harness run: the server is started once and re-armed between them; the kill is its last step, and the harness
    stops that server after its last variant anyway, so no server start is added for it). Returns (exit code,
    [the two variants' result lines], session line, stderr, the killed rank's (pid on h1, pid in the root namespace)).

    The kill: at the second ``burst_started`` line, the newest run folder's ``session.json`` names rank 1's pid on
    its host (h1's own PID namespace); the test finds that process among h1's (NSpid) and SIGKILLs it from here."""
    tmp = tmp_path_factory.mktemp("mh_ssh_pair")
    starts: list[str] = []
    killed: dict = {}

    def kill_rank1() -> None:
        runs = [f for f in (tmp / "evidence").glob("*/*/session.json") if "rank_pids" in f.read_text()]
        newest = max(runs, key=lambda f: f.stat().st_mtime)  # the second variant's, written before its burst
        host_pid = int(json.loads(newest.read_text())["rank_pids"]["1"])
        for pid, _cmd in rig.host_procs("h1"):
            try:
                nspid = [ln for ln in open(f"/proc/{pid}/status") if ln.startswith("NSpid:")][0].split()[1:]
            except (OSError, IndexError):
                continue
            if int(nspid[-1]) == host_pid:
                os.kill(pid, signal.SIGKILL)
                killed.update(host_pid=host_pid, root_pid=pid)
                return
        killed["error"] = f"no process of h1 has pid {host_pid} in its namespace"

    def on_line(line: str) -> None:
        if "] burst_started " not in line:
            return
        starts.append(line)
        if len(starts) == 2 and not killed:
            try:  # never raise here: this thread is the only reader of the harness's stderr
                kill_rank1()
            except Exception as e:
                killed["error"] = f"{type(e).__name__}: {e}"

    rc, lines, err = run_in_rig(rig, [SMOKE, "--variant", "control", "--variant", "control"], tmp,
                                timeout_s=540, all_lines=True, on_line=on_line)
    results = [ln for ln in lines if "variant" in ln]
    session = next((ln for ln in lines if "session" in ln), None)
    return rc, results, session, err, killed


def _evidence(res) -> Path:
    assert res is not None, "the harness printed no result line"
    return Path(res["evidence"])


def _assert_hosts_clean(rig):
    for h in rig.state.hosts:
        procs = rig.host_procs(h.name)
        assert procs == [], f"{h.name} still runs {procs} besides its sshd"
        # each host's /dev/shm is its own tmpfs, empty when the rig came up: every file a run's node made (SGLang's
        # load snapshots, the resource tracker's semaphores; a killed rank's too) is removed at the stop
        assert rig.host_shm(h.name) == [], f"{h.name}'s /dev/shm still holds {rig.host_shm(h.name)}"


def _deadlock_checks(rig, rc, res, err):
    assert rc == 3, err[-3000:]
    assert res["verdict"] == "DEADLOCKED"
    evd = _evidence(res)
    hosts = json.loads((evd / "hosts.json").read_text())
    assert {r["host"] for r in hosts["ranks"].values()} == {"h0", "h1"}
    # proven by the ranks' ledgers, followed live from their hosts (repro.host_ledgers), as a local run's: the proof
    # in verdict.json and REPORT.md, the ledger diagnosis beside it; the stacks taken on each rank's host for it
    v = json.loads((evd / "verdict.json").read_text())
    proof = v.get("proof")
    assert proof and proof["kind"] == "missing_partner" and proof["ranks"] == [0, 1], v["reason"]
    assert v["reason"].startswith("Ledger proof of a deadlock") and "proof_latency_s" in v["timings"], v["reason"]
    assert json.loads((evd / "proof.json").read_text()) == proof
    report = (evd / "REPORT.md").read_text()
    assert "wait edge: rank 0 in all_reduce #" in report and "**Collective ledger:**" in report, report[:3000]
    assert (evd / "ledger.json").is_file() and (evd / "timeline.svg").is_file()
    cap = json.loads((evd / "stacks" / "capture-proof.json").read_text())
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


def _rank_pids(res) -> dict:
    return json.loads((_evidence(res) / "session.json").read_text())["rank_pids"]


def test_tp2_across_two_hosts_control_succeeds(ssh_pair, rig):
    rc, res, session, err, _ = ssh_pair
    assert res and res[0]["variant"] == "control", err[-3000:]
    assert res[0]["exit_code"] == 0 and res[0]["verdict"] == "ALL REQUESTS SUCCEEDED", err[-3000:]
    assert session is not None and not any(session["left_running"].values()), session
    _assert_hosts_clean(rig)


def test_a_rank_killed_on_its_host_is_named_with_its_host_pid_and_never_waits(ssh_pair, rig):
    """The ssh server's last variant: control re-armed, rank 1 SIGKILLed on h1 as its burst starts (rides the
    ssh_pair server, which is stopped after its last variant anyway: no server start is added). The run names the
    death as a local run does (tests/test_e2e_rank_death.py): exit 4, "rank 1 (pid <its pid on h1>) died: on host
    h1", never that rank 1 waits; the server is torn down and every host is clean after."""
    rc, res, session, err, killed = ssh_pair
    assert killed and "error" not in killed, f"rank 1 was not killed on h1 at the second burst: {killed}\n{err[-3000:]}"
    assert len(res) == 2, err[-3000:]
    dead = res[1]
    assert rc == 4 and dead["exit_code"] == 4 and dead["verdict"] == "INCONCLUSIVE", (dead, err[-3000:])
    reason = dead["reason"]
    assert f"rank 1 (pid {killed['host_pid']}) died" in reason and "on host h1" in reason, reason
    assert "waits" not in reason.split("server log tail")[0], reason
    evd = _evidence(dead)
    hosts = json.loads((evd / "hosts.json").read_text())
    assert hosts["ranks"]["1"]["host"] == "h1" and hosts["ranks"]["1"]["pid"] == killed["host_pid"]
    v = json.loads((evd / "verdict.json").read_text())
    assert v["exit_code"] == 4 and v["reason"] == reason
    deaths = json.loads((evd / "rank_deaths.json").read_text())
    # rank 0 may die too within the same second (its gloo peer is gone: a crash there, measured on the rig)
    (d1,) = [d for d in deaths if d["rank"] == 1]
    assert d1["pid"] == killed["host_pid"] and d1["reason"].startswith("on host h1: ") and "SIGKILL" in d1["reason"], deaths
    assert all(d["rank"] == 1 or d["reason"].startswith("on host h0: ") for d in deaths), deaths
    report = (evd / "REPORT.md").read_text()
    assert f"rank 1 (pid {killed['host_pid']}) died" in report and "rank 1 never did and waits" not in report, report[:3000]
    led = json.loads((evd / "ledger.json").read_text())  # the ledger diagnosis marks it dead (no wait of rank 1)
    assert "rank 1 never did and waits" not in led["divergence"]["summary"], led["divergence"]
    # the same server as the control's: re-armed, not restarted (same rank pids, one launch per host in the session)
    assert _rank_pids(dead) == _rank_pids(res[0]) != {}
    assert err.count("node_launch") == 2, "expected one launch per host for both variants"
    assert session is not None and not any(session["left_running"].values()), session
    _assert_hosts_clean(rig)


def test_cut_data_link_mid_burst_is_inconclusive_naming_the_host(rig, tmp_path):
    cut = threading.Event()

    def on_line(line: str) -> None:
        if "burst_started" in line and not cut.is_set():
            rig.set_data_link("h1", up=False)
            cut.set()

    try:
        rc, res, err = run_in_rig(rig, [SMOKE, "--variant", "control", "--requests", "64"], tmp_path, on_line=on_line)
    finally:
        rig.set_data_link("h1", up=True)  # the module's later tests share the rig
    assert cut.is_set(), err[-3000:]
    assert rc == 4 and res["verdict"] == "INCONCLUSIVE", err[-3000:]
    assert "host h1's data link is lost" in res["reason"] and "data0 is down" in res["reason"]
    teardown = json.loads((_evidence(res) / "teardown.json").read_text())
    assert teardown["by_host"] == {"h0": [], "h1": []}  # each host's session checked empty over ssh
    _assert_hosts_clean(rig)


def test_tp2_through_the_kubectl_template_deadlocks(rig, tmp_path):
    """The module's deadlock: proven by the ledgers followed live from the hosts, stacks taken with py-spy on each
    rank's host (_deadlock_checks), reached through the kubectl template (the stand-in kubectl's channel is each
    host's sshd, so this is also the over-ssh deadlock; the ssh server's last variant is the killed rank)."""
    rc, res, err = run_in_rig(rig, [SMOKE, "--variant", "extra_collective"], tmp_path, via="kubectl")
    _deadlock_checks(rig, rc, res, err)
    hosts = json.loads((_evidence(res) / "hosts.json").read_text())
    assert all("kubectl" in n["reach"] and "exec" in n["reach"] for n in hosts["nodes"])
