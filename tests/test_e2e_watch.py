"""`repro watch` on a real SGLang TP=2 server (CPU testbed): no false alarm while healthy, then a live `repro arm`
is caught, for both /health modes of sglang 0.5.23.

- /health generating: the smoke scenario's extra all_reduce, watched by probes alone (the hang is declared after
  ``FAILURES`` probe time-outs).
- /health liveness-only: ``scenarios/sglang/state_leak_then_hang.toml`` (rank 0 keeps 16 KV slots, then one extra
  all_reduce), watched with ``--ledger-dir``: the state divergence is logged before the hang line, the hang is
  declared within 1 s of the ledger record that completes the proof (issue 33), and a second ``watch --once`` on the
  hung server exits 3 with the ledger proof (issue 28).

sglang 0.5.23 ``srt/entrypoints/http_server.py`` ``health_generate``: by default ``/health`` runs a 1-token generate
and answers 503 after ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s) without output; with
``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0`` it returns 200 at once (the silent kind). The server is started with
``repro serve`` (injector loaded, unarmed) in its own session and always stopped with SIGTERM → its teardown, then
``repro cleanup`` on the recorded process tree as a fallback.
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

REPO = Path(__file__).resolve().parent.parent
SMOKE = REPO / "scenarios" / "sglang" / "smoke_extra_allreduce.toml"
LEAK = REPO / "scenarios" / "sglang" / "state_leak_then_hang.toml"
# (scenario, variant, watched with the server's ledgers) per /health mode
SERVED = {"1": (SMOKE, "extra_collective", False), "0": (LEAK, "leak_then_hang", True)}
PROOF_TO_HANG_S = 1.0  # issue 33: the hang line at most this long after the ledger record that completes the proof
SERVE_TIMEOUT_S = 600.0
INTERVAL_S = 6.0
PROBE_TIMEOUT_S = 5.0  # <= INTERVAL_S, so the bound is FAILURES × INTERVAL_S + PROBE_TIMEOUT_S; healthy probes take
                       # ~0.1–0.4 s here (2 shared cores)
FAILURES = 2
# probe rounds watched healthy before arming: >= 10 with /health generating (it competes with the probes: the
# false-alarm case, issue 7), fewer with the liveness-only /health, which answers 200 at once
HEALTHY_ROUNDS = {"1": 10, "0": 4}

pytestmark = pytest.mark.hang


class Lines:
    """A child's stdout read line by line in a thread, so the test can wait with a timeout."""

    def __init__(self, stream) -> None:
        self.q: "queue.Queue[Optional[str]]" = queue.Queue()
        self.all: list[str] = []

        def pump() -> None:
            for line in stream:
                self.q.put(line)
            self.q.put(None)

        threading.Thread(target=pump, daemon=True).start()

    def next(self, timeout_s: float) -> Optional[str]:
        try:
            line = self.q.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if line is not None:
            self.all.append(line)
        return line


def _repro(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "repro.cli", *args], cwd=REPO, stdout=subprocess.PIPE,
                            text=True, start_new_session=True, **kw)


def _stop(p: Optional[subprocess.Popen], wait_s: float) -> None:
    if p is None or p.poll() is not None:
        return
    os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)


def _ts(event: dict) -> float:
    """A watch JSON line's ``ts`` (ISO 8601) in seconds since the epoch."""
    from datetime import datetime

    return datetime.fromisoformat(event["ts"].replace("Z", "+00:00")).timestamp()


def _record_cmd(out: Path) -> str:
    script = (
        "import json, os, pathlib; d = pathlib.Path(os.environ['REPRO_EVIDENCE_DIR']); "
        f"pathlib.Path({str(out)!r}).write_text(json.dumps({{'dir': str(d), 't': __import__('time').time(), "
        "'files': sorted(p.name for p in d.iterdir()), 'stacks': sorted(p.name for p in (d / 'stacks').iterdir()), "
        "'status': json.loads((d / 'run.json').read_text())['status'], 'verdict_env': os.environ['REPRO_VERDICT']}))"
    )
    return f"{sys.executable} -c {json.dumps(script)}"


@pytest.mark.parametrize("health_generation", ["1", "0"], ids=["health-generates", "health-liveness-only"])
def test_watch_catches_a_live_armed_deadlock(health_generation: str, tmp_path: Path) -> None:
    # COLUMNS: rich would wrap the long evidence path `repro serve` prints.
    env = dict(os.environ, SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=health_generation, COLUMNS="4000")
    serve_log = open(tmp_path / "serve.stderr", "w")
    serve = watch = None
    serve_evidence: Optional[Path] = None
    marker = tmp_path / "on_hang_saw.json"
    scenario, variant, with_ledger = SERVED[health_generation]
    try:
        serve = _repro("serve", str(scenario), "--variant", variant, "--evidence-dir", str(tmp_path / "serve"),
                       env=env, stderr=serve_log)
        out = Lines(serve.stdout)
        url = None
        deadline = time.time() + SERVE_TIMEOUT_S
        while time.time() < deadline and (url is None or serve_evidence is None):
            line = out.next(5.0)
            if line is None and serve.poll() is not None:
                pytest.fail(f"repro serve exited {serve.returncode}: {(tmp_path / 'serve.stderr').read_text()[-3000:]}")
            if line and line.startswith("serving "):
                url = line.split()[1]
            if line and line.startswith("evidence: "):
                found = sorted((tmp_path / "serve").glob("*/*/serve.json"))
                serve_evidence = found[-1].parent if found else Path(line.split(":", 1)[1].strip())
        assert url and serve_evidence, f"repro serve did not report its URL: {out.all}"
        info = json.loads((serve_evidence / "serve.json").read_text())
        ledger = ["--ledger-dir", str(serve_evidence / "injector")] if with_ledger else []

        watch = _repro("watch", "--url", url, "--interval", str(INTERVAL_S), "--probe-timeout", str(PROBE_TIMEOUT_S),
                       "--failures", str(FAILURES), "--pid-root", str(info["pid"]), *ledger, "--evidence-dir",
                       str(tmp_path / "watch"), "--on-hang", _record_cmd(marker), stderr=subprocess.DEVNULL)
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

        # 1. healthy: HEALTHY_ROUNDS probe rounds, no false alarm
        for _ in range(HEALTHY_ROUNDS[health_generation]):
            assert until(lambda e: e["event"] == "probe", 60.0), f"no probe line; events: {events}"
        probes = [e for e in events if e["event"] == "probe"]
        assert all(p["generate"]["outcome"] == "ok" for p in probes), probes
        assert not [e for e in events if e["event"] in ("hang", "evidence")]
        disc = next(e for e in events if e["event"] == "discovery")
        assert sorted(disc["rank_pids"]) == ["0", "1"] and disc["rank_pids"] == {str(k): v for k, v in info["rank_pids"].items()}

        # 2. arm while watching
        t_arm = time.time()
        arm = subprocess.run([sys.executable, "-m", "repro.cli", "arm", str(serve_evidence)], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
        assert arm.returncode == 0, arm.stderr
        assert "(read by TP0, TP1)" in arm.stdout, arm.stdout  # returned only after both ranks' injectors armed
        arm_round = probes[-1]["round"]
        hang = until(lambda e: e["event"] == "hang", FAILURES * INTERVAL_S + PROBE_TIMEOUT_S + 120)
        assert hang, f"no hang declared; events: {events[-10:]}"
        t_hang = time.time()
        after = [e for e in events if e["event"] == "probe" and e["round"] > arm_round]
        if with_ledger:
            # the ledger proves the hang as it forms, between probe rounds: the digest's warning comes first
            # (rank 0's 16 kept KV slots), and no request time-out is waited for
            st = [e for e in events if e["event"] == "state_divergence"]
            assert st and events.index(st[0]) < events.index(hang), f"no state warning before the hang: {events[-10:]}"
            assert any("token_to_kv_pool_allocator" in str(f) for f in st[0]["fields"]), st[0]
            assert len(after) <= FAILURES + 1, after
        else:
            # The hang fires on the first batch after arming, i.e. at the first probe that starts after it; the
            # failures needed to declare follow at once: bound failures × interval + probe timeout (+1 round that
            # may have started just before the arm file was written).
            assert after[-1].get("transition") == "hang"
            assert len(after) <= FAILURES + 1, after
            assert all(p["generate"]["outcome"] in ("timeout", "skipped") for p in after[-FAILURES:]), after
            assert hang["kind"] in ("health-timeout", "health-error"), hang

        # 3. evidence, then --on-hang
        evid = until(lambda e: e["event"] == "evidence", 180.0)
        assert evid, f"no evidence event; events: {events[-10:]}"
        assert evid["verdict"] == "DEADLOCKED" and evid["complete"], evid
        t_evidence = time.time()
        ran = until(lambda e: e["event"] in ("on_hang", "on_hang_skipped"), 120.0)
        assert ran and ran["event"] == "on_hang" and ran["rc"] == 0, ran
        saw = json.loads(marker.read_text())
        evd = Path(evid["path"])
        assert saw["dir"] == str(evd) and saw["status"] == "complete" and saw["verdict_env"] == "DEADLOCKED"
        assert {"verdict.json", "REPORT.md", "analysis.json", "hang.json", "probes.jsonl"} <= set(saw["files"])
        assert {"rank0.txt", "rank1.txt", "rank0-2.txt", "rank1-2.txt"} <= set(saw["stacks"])
        analysis = json.loads((evd / "analysis.json").read_text())
        assert analysis["diverged"] is True
        by_rank = {r["rank"]: r for r in analysis["ranks"]}
        assert by_rank[0]["state"] == "collective" and by_rank[0]["injected"] is True
        assert by_rank[1]["state"] == "collective"
        report = (evd / "REPORT.md").read_text()
        assert report.startswith("# DEADLOCKED — watch ") and "## Diagnosis" in report
        if with_ledger:
            hj = json.loads((evd / "hang.json").read_text())
            assert hj["proof"] and hj["state_divergence"]["fields"], hj
            assert hj["timings_s"]["declared_after_proof_record"] <= PROOF_TO_HANG_S, hj["timings_s"]

        # 4. what /health does through the deadlock (both modes: sglang 0.5.23 facts)
        want = 200 if health_generation == "0" else 503
        seen = until(lambda e: e["event"] == "probe" and e["health"].get("status") == want
                     and e["health"].get("round", 0) > arm_round, 60.0)
        assert seen, f"/health never answered {want} during the deadlock: {[e.get('health') for e in events[-8:]]}"
        timings = {"mode": "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=" + health_generation,
                   "arm_to_hang_s": round(t_hang - t_arm, 1), "arm_to_evidence_s": round(t_evidence - t_arm, 1),
                   "bound_s": FAILURES * INTERVAL_S + PROBE_TIMEOUT_S,
                   "capture_s": evid["capture_s"], "hang_kind": hang["kind"], "health_status_seen": want}
        if with_ledger:
            # 5. a second watch, --once, on the already hung server: the ledger proves it at once (issue 28)
            _stop(watch, 30.0)
            watch = None
            t0 = time.time()
            once = subprocess.run([sys.executable, "-m", "repro.cli", "watch", "--url", url, "--once", "--probe-timeout",
                                   str(PROBE_TIMEOUT_S), "--pid-root", str(info["pid"]), *ledger, "--evidence-dir",
                                   str(tmp_path / "watch-once")], cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=180)
            timings["once_wall_s"] = round(time.time() - t0, 1)
            assert once.returncode == 3, (once.returncode, once.stdout[-3000:], once.stderr[-3000:])
            once_ev = [json.loads(x) for x in once.stdout.splitlines() if x.startswith("{")]
            done = [e for e in once_ev if e["event"] == "evidence"]
            assert done and done[-1]["verdict"] == "DEADLOCKED", once_ev
            hj = json.loads((Path(done[-1]["path"]) / "hang.json").read_text())
            assert hj["proof"], hj
            assert {"proof_record_t", "declared_t", "declared_after_proof_record"} <= set(hj["timings_s"]), hj
            # declared from the ledgers as soon as they were read, not after a probe's time-out: the hang line
            # follows the watch's first line by less than the probe time-out (measured: ~0.3 s)
            hang_line = next(e for e in once_ev if e["event"] == "hang")
            since_start_s = (_ts(hang_line) - _ts(once_ev[0]))
            timings["once_start_to_hang_s"] = round(since_start_s, 2)
            assert since_start_s < PROBE_TIMEOUT_S - 1.0, (since_start_s, once_ev[:4])
        print("WATCH_TIMINGS " + json.dumps(timings))
    finally:
        _stop(watch, 30.0)
        _stop(serve, 90.0)
        serve_log.close()
        if serve_evidence is not None and (serve_evidence / "processes.json").exists():
            subprocess.run([sys.executable, "-m", "repro.cli", "cleanup", str(serve_evidence)], cwd=REPO,
                           capture_output=True, timeout=120)
