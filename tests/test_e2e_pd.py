"""PD disaggregation end to end on the CPU testbed: a real prefill server (TP=4, HiCache), decode server (TP=1) and
SGLang's router, Mooncake moving the KV over TCP (marked ``pd``; `bash scripts/test.sh pd`).

ONE stack serves the cases of the module fixture: the control first, the mass abort (no fault) next — both leave
the stack clean and re-armable — then ``repro watch`` (the CLI, its own session) is started on the stack's router
and the hanging case is armed while it watches: the run's divergence deadlocks the prefill server, the run judges
it, and the watch, probing the router, declares the same hang, keeps both servers' evidence and runs ``--on-hang``
before the stack is torn down. The last test runs ``repro compare`` with a no-op patch: it needs a stack per side
(a patch is a different sglang on the servers' PYTHONPATH), so it starts two more, prefill TP=2 to keep them short.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import pytest

from repro import testbed
from repro.procs import alive, load_procs, processes_mentioning
from repro.runner import RunOptions, run_many
from repro.verdict import DEADLOCKED, SUCCEEDED

REPO = Path(__file__).resolve().parent.parent
DISAGG = REPO / "scenarios" / "sglang" / "disagg_bootstrap_divergence.toml"
NOOP_PATCH = REPO / "tests" / "fixtures" / "pd" / "noop-comment.patch"
DIVERGENCE_ID = "pop_bootstrapped_empty_on_ranks_2_3"

# The watch on the router: a healthy 1-token probe through the PD stack takes ~0.5–3 s here (2 shared cores). Four
# failures 10 s apart declare 30–48 s after arming — after the run's own capture of the same ranks (its stall rule:
# 15 s without progress, verdict ~19 s after arming, measured), never during it (two py-spy on one pid collide).
WATCH_INTERVAL_S = 10.0
WATCH_PROBE_TIMEOUT_S = 8.0
WATCH_FAILURES = 4
WATCH_HEALTHY_ROUNDS = 2
WATCH_BOUND_S = WATCH_FAILURES * WATCH_INTERVAL_S + WATCH_PROBE_TIMEOUT_S  # the watch's declare bound (probe <= interval)

pytestmark = pytest.mark.pd


def _testbed_python() -> str:
    py = testbed.testbed_python()
    if py is None or not testbed.is_set_up():
        pytest.fail(f"CPU testbed not set up at {testbed.testbed_dir()}: run `{testbed.setup_command()}`")
    return str(py)


def _record_cmd(out: Path) -> str:
    """An --on-hang command that records what it found in REPRO_EVIDENCE_DIR when it ran."""
    script = (
        "import json, os, pathlib, time; d = pathlib.Path(os.environ['REPRO_EVIDENCE_DIR']); "
        f"pathlib.Path({str(out)!r}).write_text(json.dumps({{'dir': str(d), 't': time.time(), "
        "'files': sorted(p.name for p in d.iterdir()), 'servers': sorted(p.name for p in (d / 'servers').iterdir()), "
        "'status': json.loads((d / 'run.json').read_text())['status'], 'verdict_env': os.environ['REPRO_VERDICT']}))"
    )
    return f"{sys.executable} -c {json.dumps(script)}"


class LiveWatch:
    """``repro watch`` (the CLI, in its own session) on a stack's router; its JSON lines collected with arrival times.

    ``start`` returns once it found the ranks and answered ``WATCH_HEALTHY_ROUNDS`` healthy probes; ``stop`` ends its
    process group (SIGTERM, then SIGKILL). Errors from the fixture's callbacks are kept in ``error`` (the run goes on).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.marker = root / "on_hang_saw.json"
        self.proc: Optional[subprocess.Popen] = None
        self.events: list[dict] = []
        self.q: "queue.Queue[Optional[dict]]" = queue.Queue()
        self.error: Optional[str] = None
        self.url: Optional[str] = None
        self.t_arm: Optional[float] = None
        self.arm_round = 0

    def start(self, url: str, timeout_s: float = 120.0) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = url
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "repro.cli", "watch", "--url", url, "--interval", str(WATCH_INTERVAL_S),
             "--probe-timeout", str(WATCH_PROBE_TIMEOUT_S), "--failures", str(WATCH_FAILURES),
             "--evidence-dir", str(self.root / "evidence"), "--on-hang", _record_cmd(self.marker)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=open(self.root / "watch.stderr", "w"), text=True,
            start_new_session=True)

        def pump() -> None:
            for line in self.proc.stdout:
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                e["_t"] = time.time()
                self.events.append(e)
                self.q.put(e)
            self.q.put(None)

        threading.Thread(target=pump, daemon=True).start()
        ok = 0
        end = time.time() + timeout_s
        while ok < WATCH_HEALTHY_ROUNDS:
            e = self.next(end)
            if e["event"] == "probe":
                ok = ok + 1 if e["generate"]["outcome"] == "ok" else 0

    def next(self, end: float) -> dict:
        """The next event before ``end`` (time.time()); raises AssertionError on a timeout or an ended watch."""
        while True:
            try:
                e = self.q.get(timeout=max(0.1, end - time.time()))
            except queue.Empty:
                raise AssertionError(f"watch: no event in time; last events: {self.events[-5:]}") from None
            if e is None:
                raise AssertionError(f"watch exited {self.proc.poll()}; last events: {self.events[-5:]}")
            return e

    def armed(self) -> None:
        """The divergence was armed now (while the watch runs)."""
        self.t_arm = time.time()
        probes = [e for e in self.events if e["event"] == "probe"]
        self.arm_round = probes[-1]["round"] if probes else 0

    def wait_on_hang(self, timeout_s: float) -> None:
        end = time.time() + timeout_s
        while self.next(end)["event"] not in ("on_hang", "on_hang_skipped"):
            pass

    def of(self, name: str) -> list[dict]:
        return [e for e in self.events if e["event"] == name]

    def stop(self) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
            try:
                os.killpg(p.pid, sig)
                p.wait(timeout=wait_s)
                return
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue


@pytest.fixture(scope="module")
def pd_results(tmp_path_factory):
    """control, mass_abort, then (``repro watch`` running on the router) divergence, on ONE real PD stack:
    (evidence root, variant -> RunResult, the LiveWatch)."""
    py = _testbed_python()
    root = tmp_path_factory.mktemp("pd-evidence")
    watch = LiveWatch(root / "watch")
    seen: dict = {}

    def observe(event: str, data: dict) -> None:
        if event == "wait_healthy":
            seen["url"] = data["url"]
        elif event == "armed" and DIVERGENCE_ID in (data.get("injections") or []) and watch.proc is not None:
            watch.armed()

    def on_result(d) -> None:  # called with the stack still up, before the next variant
        try:
            if d.variant.name == "mass_abort":
                watch.start(seen["url"])
            elif d.variant.name == "divergence" and watch.proc is not None:
                watch.wait_on_hang(WATCH_BOUND_S + WATCH_INTERVAL_S + 180.0)
        except Exception as e:  # noqa: BLE001 - the watch test reports it; the other cases still run
            watch.error = watch.error or f"{d.variant.name}: {type(e).__name__}: {e}"

    try:
        results = run_many(RunOptions(DISAGG, evidence_root=root, python=py), ["control", "mass_abort", "divergence"],
                           observe=observe, on_result=on_result)
    finally:
        watch.stop()
    return root, {r.evidence.name.split("-", 1)[1]: r for r in results}, watch


def _capture_meta(stacks: Path, tag: str, rank: int) -> object:
    """What ``capture<tag>.json`` says of ``rank`` (ok, error, warnings, duration), or why it cannot be read."""
    try:
        procs = json.loads((stacks / f"capture{tag}.json").read_text())["processes"]
    except (OSError, ValueError, KeyError) as e:
        return f"capture{tag}.json: {e}"
    return [{k: p.get(k) for k in ("ok", "error", "warnings", "duration_s")} for p in procs if p.get("rank") == rank]


def _servers(run: Path) -> dict:
    return json.loads((run / "verdict.json").read_text())["servers"]


def test_pd_control_succeeds_through_the_router_with_the_site_entered_on_every_prefill_rank(pd_results):
    _, by, _ = pd_results
    r = by["control"]
    assert r.verdict.verdict == SUCCEEDED, r.verdict.reason
    assert r.requests_ok == r.requests_total == 8
    servers = _servers(r.evidence)
    assert servers["prefill"]["ranks"] == [f"prefill TP{k}" for k in range(4)]
    assert servers["decode"]["ranks"] == ["decode TP0"]
    assert servers["prefill"]["verdict"] == servers["decode"]["verdict"] == SUCCEEDED


def test_pd_mass_abort_with_no_fault_gives_a_verdict_and_counts_the_aborts_per_rank_of_both_servers(pd_results):
    _, by, _ = pd_results
    r = by["mass_abort"]
    # not INCONCLUSIVE: the aborts reached the decode server (its FINISH_ABORT site, required, was entered)
    assert r.verdict.verdict in (SUCCEEDED, DEADLOCKED, "DESYNCED"), r.verdict.reason
    events = [json.loads(x) for x in (r.evidence / "requests.jsonl").read_text().splitlines()]
    cut = [e for e in events if e.get("event") == "abort"]
    assert len(cut) == 1 and len(cut[0]["requests"]) == 4
    firsts = [e["t"] for e in events if e.get("event") == "first_token"]
    assert not firsts or cut[0]["t"] < min(firsts)  # the clients left before any first token
    aborted = {e["request"] for e in events if e.get("event") == "aborted"}
    assert aborted == set(cut[0]["requests"])
    if r.verdict.verdict == SUCCEEDED:
        assert r.requests_ok == 4  # the other four still answered in full
    # per rank, the counted sites (aborts handled, AbortReqs, bootstrap pops) in the run's report and each server's
    top = (r.evidence / "REPORT.md").read_text()
    assert "## After the mass abort" in top
    lines = {ln.split(":", 1)[0][2:]: ln for ln in top.splitlines() if ln.startswith("- ") and "`aborts_handled`" in ln
             or ln.startswith("- ") and "`prefill_aborts_handled`" in ln}
    assert set(lines) == {"decode TP0", *(f"prefill TP{k}" for k in range(4))}, top[-2000:]
    assert "`abort_requests`" in lines["decode TP0"] and "`count_bootstrap_pops`" in lines["prefill TP0"]
    handled = int(lines["decode TP0"].split("`aborts_handled` ", 1)[1].split(",")[0])
    assert handled >= 1
    assert "aborts_handled" in (r.evidence / "servers" / "decode" / "REPORT.md").read_text()
    assert "prefill_aborts_handled" in (r.evidence / "servers" / "prefill" / "REPORT.md").read_text()


def test_pd_divergence_deadlocks_the_prefill_server_in_the_waiting_queue_bootstrap_poll(pd_results):
    _, by, _ = pd_results
    r = by["divergence"]
    assert r.verdict.verdict == DEADLOCKED, r.verdict.reason
    v = json.loads((r.evidence / "verdict.json").read_text())
    assert v["diverged_server"] == "prefill"
    # proven by the prefill server's own ledgers (repro.proof, scoped to that server), before any stall capture: the
    # proof in the run's verdict.json and the prefill server's, its wait edges in REPORT.md, its ranks captured
    proof = v.get("proof")
    assert proof and v["reason"].startswith("Ledger proof of a deadlock"), v["reason"]
    assert "proof_latency_s" in v["timings"] and set(map(int, proof["ranks"])) <= {0, 1, 2, 3}, v["timings"]
    pre_v = json.loads((r.evidence / "servers" / "prefill" / "verdict.json").read_text())
    assert pre_v["verdict"] == DEADLOCKED and pre_v["proof"] == proof
    assert json.loads((r.evidence / "servers" / "prefill" / "proof.json").read_text()) == proof
    assert v["servers"]["decode"]["verdict"] != DEADLOCKED, v["servers"]["decode"]
    stacks = r.evidence / "servers" / "prefill" / "stacks"
    assert sorted(f.name for f in stacks.glob("rank*-proof.txt")) == [f"rank{k}-proof.txt" for k in range(4)]
    report = (r.evidence / "REPORT.md").read_text()
    assert "wait edge: rank" in report, report[:3000]
    assert "resolve_waiting_queue_bootstrap" in report and "poll_and_all_reduce_attn_cp_tp_group" in report
    assert "The prefill server diverged" in report
    pre = json.loads((r.evidence / "servers" / "prefill" / "analysis.json").read_text())
    assert pre  # the prefill server's own analysis
    assert (r.evidence / "servers" / "prefill" / "ledger.json").is_file()


def test_watch_on_the_router_armed_live_keeps_both_servers_evidence_within_its_bound_then_runs_on_hang(pd_results):
    _, by, w = pd_results
    assert w.error is None, w.error
    assert w.t_arm is not None, "the divergence was not armed while the watch ran"
    # it found the ranks of both servers through the router's GET /workers, the same processes the run drove
    disc = w.of("discovery")[0]
    run_servers = json.loads((by["divergence"].evidence / "verdict.json").read_text())["servers"]
    run_pids = {pid for s in run_servers.values() for pid in s["rank_pids"].values()}
    assert disc["method"] == "router-workers" and set(disc["rank_pids"].values()) == run_pids, disc
    assert "prefill TP0..3" in disc["note"] and "decode TP0..0" in disc["note"], disc["note"]
    probes = [e for e in w.of("probe")]
    before = [e for e in probes if e["round"] <= w.arm_round]
    assert len(before) >= 2 and all(e["generate"]["outcome"] == "ok" for e in before[-2:]), before
    # armed live: the hang is declared within the bound after arming. The round in flight at arming may still
    # succeed; the first failing round then starts within one interval, and F failures later (F-1 intervals + one
    # probe timeout) it is declared: at most F x interval + probe timeout after arming (+3 s: event delivery).
    hang = w.of("hang")
    assert len(hang) == 1, [e["event"] for e in w.events]
    after = [e for e in probes if e["round"] > w.arm_round and e["_t"] <= hang[0]["_t"]]
    assert after and after[-1].get("transition") == "hang" and len(after) <= WATCH_FAILURES + 1, after
    assert all(e["generate"]["outcome"] in ("timeout", "skipped") for e in after[-WATCH_FAILURES:]), after
    arm_to_hang = hang[0]["_t"] - w.t_arm
    assert arm_to_hang <= WATCH_BOUND_S + 3.0, arm_to_hang
    # both servers' evidence, each judged on its own: the prefill server deadlocked, the decode server idle
    evid = w.of("evidence")
    assert len(evid) == 1 and evid[0]["verdict"] == DEADLOCKED and evid[0]["complete"], evid
    evd = Path(evid[0]["path"])
    for role, n in (("prefill", 4), ("decode", 1)):
        stacks = evd / "servers" / role / "stacks"
        for k in range(n):
            for tag in ("", "-2"):  # a missing dump shows what the capture said of it
                assert (stacks / f"rank{k}{tag}.txt").is_file(), (role, k, tag, _capture_meta(stacks, tag, k))
    hj = json.loads((evd / "hang.json").read_text())
    assert hj["diverged_server"] == "prefill" and hj["servers"]["decode"]["deadlocked"] is False, hj.get("servers")
    pre = {r["rank"]: r for r in json.loads((evd / "servers" / "prefill" / "analysis.json").read_text())["ranks"]}
    for k in (0, 1):
        assert pre[k]["state"] == "collective" and pre[k]["op"] == "all_reduce", pre[k]
        assert "poll_and_all_reduce_attn_cp_tp_group" in str(pre[k]["caller_chain"]), pre[k]["caller_chain"]
    assert "**The prefill server diverged**" in (evd / "REPORT.md").read_text()
    # then --on-hang, with the evidence complete on disk
    ran = w.of("on_hang")
    assert ran and ran[0]["rc"] == 0, w.events[-3:]
    saw = json.loads(w.marker.read_text())
    assert saw["dir"] == str(evd) and saw["status"] == "complete" and saw["verdict_env"] == DEADLOCKED
    assert saw["servers"] == ["decode", "prefill"] and {"hang.json", "verdict.json", "REPORT.md"} <= set(saw["files"])
    assert saw["t"] >= evid[0]["_t"] - 1.0
    print("WATCH_PD_TIMINGS " + json.dumps({
        "arm_to_hang_s": round(arm_to_hang, 1), "arm_to_evidence_s": round(evid[0]["_t"] - w.t_arm, 1),
        "bound_s": WATCH_BOUND_S, "capture_s": evid[0]["capture_s"], "hang_kind": hang[0]["kind"]}))


def test_pd_stack_left_nothing_running(pd_results):
    root, by, w = pd_results
    assert w.proc is None or w.proc.poll() is not None
    assert processes_mentioning(root) == []
    # the stack wedged by the divergence (the last variant) is stopped with the short grace (issue 36): the stop itself
    # takes <= 2 s (here the watch test keeps the stack up after the verdict, so the stop's own time is what is bounded)
    session = Path(json.loads((by["divergence"].evidence / "session.json").read_text())["session"])
    teardown = json.loads((session / "teardown.json").read_text())
    assert teardown.get("wedged") is True and teardown["left_running"] == [] and teardown["stop_s"] <= 2.0, teardown


def test_compare_with_a_noop_patch_on_the_pd_scenario_runs_both_sides_on_stacks_of_their_own(tmp_path: Path):
    # `repro compare` applies the patch to both engine servers (an overlay first on their PYTHONPATH): each side is a
    # stack of its own. sglang's launcher warns from its own file at start-up: the path in each server's log says
    # which sglang that server ran.
    py = _testbed_python()
    root = tmp_path / "compare"
    cmd = [sys.executable, "-m", "repro.cli", "compare", str(DISAGG), "--variant", "control", "--before", "installed",
           "--after", f"patch:{NOOP_PATCH}", "--expect-before", "success", "--expect-after", "success", "--tp", "2",
           "--python", py, "--evidence-dir", str(root), "--json"]
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=1200)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGTERM)  # compare tears its stack down and removes the overlay on SIGTERM
        out, err = p.communicate(timeout=120)
        pytest.fail(f"repro compare did not end in 1200 s: {err[-3000:]}")
    assert p.returncode == 0, f"exit {p.returncode}: {out[-2000:]} {err[-3000:]}"
    res = json.loads(out)
    sides = {s["side"]: s for s in res["sides"]}
    assert set(sides) == {"before", "after"}
    for name, s in sides.items():
        assert s["verdict"] == SUCCEEDED and s["matched"], (name, s["reason"])
        assert s["requests_ok"] == s["requests_total"] == 8, name
        v = json.loads((Path(s["evidence"]) / "verdict.json").read_text())
        assert v["servers"]["prefill"]["ranks"] == ["prefill TP0", "prefill TP1"], v["servers"]
        assert v["servers"]["decode"]["ranks"] == ["decode TP0"]
    assert "overlay" in sides["after"]["description"] and "overlay" not in sides["before"]["description"]
    for role in ("prefill", "decode"):
        after_log = (Path(sides["after"]["evidence"]) / "servers" / role / "server.log").read_text(errors="replace")
        before_log = (Path(sides["before"]["evidence"]) / "servers" / role / "server.log").read_text(errors="replace")
        assert "repro-overlay-" in after_log and "repro-overlay-" not in before_log, role
    assert (Path(res["folder"]) / "COMPARISON.md").is_file()
    assert processes_mentioning(root) == []
    print("COMPARE_PD_TIMINGS " + json.dumps({"wall_s": res["wall_s"], **{
        n: {k: s["timings"].get(k) for k in ("healthy_s", "to_verdict_s", "total_s")} for n, s in sides.items()}}))


def test_a_deadlocked_pd_stack_is_gone_within_2_s_of_its_verdict(tmp_path: Path):
    """Issue 36: no process of a deadlocked PD tree (prefill TP ranks, decode, router) is alive 2 s after the run's
    verdict.json is written. The module's shared stack keeps the wedged stack up for the watch case, so this is the
    divergence variant as a run of its own (`repro run`, one stack, stopped right after its verdict)."""
    py = _testbed_python()
    root = tmp_path / "alone"
    r = subprocess.run([sys.executable, "-m", "repro.cli", "run", str(DISAGG), "--variant", "divergence", "--python", py,
                        "--evidence-dir", str(root), "--json", "--expect", "deadlock"],
                       cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-3000:]}"
    out = json.loads(r.stdout)
    assert out["verdict"] == DEADLOCKED, out.get("reason")
    run = Path(out["evidence"])
    written = (run / "verdict.json").stat().st_mtime
    teardown = json.loads((run / "teardown.json").read_text())  # a run of its own: the stack's records are the run's
    assert teardown.get("wedged") is True and teardown["left_running"] == [], teardown
    assert teardown["time"] - written <= 2.0, (teardown, written)
    procs = [p for f in sorted(run.rglob("processes.json")) for p in load_procs(f)]
    assert len(procs) >= 5, f"{run}: processes.json lists {len(procs)} processes (expected the router, 4 prefill and 1 decode rank's tree)"
    left = [(p.pid, p.title) for p in procs if alive(p)]
    assert not left, f"left running: {left}"
    assert processes_mentioning(root) == []
