"""`repro watch` probe logic against small local HTTP endpoints, and one real gloo deadlock captured through it.

The endpoints answer like sglang 0.5.23 (``/generate`` JSON with ``output_ids`` + ``meta_info``, ``/health``,
``/metrics``) but behave as each test says: answer, answer slowly, never answer (a silent hang), answer 503, or
nothing listens at all (server down). The real-capture test hangs a 2-rank gloo job on purpose
(tests/gloo_programs) and checks the watch writes DEADLOCKED evidence before running --on-hang.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest

from repro.targets.sglang import SGLangAdapter
from repro.watch import (
    HEALTH_ERROR,
    SILENT,
    WatchConfigError,
    WatchOptions,
    Watcher,
    classify_health,
    ProbeResult,
)

REPO = Path(__file__).resolve().parent.parent
METRICS_TEXT = "# HELP sglang:num_running_reqs running\n# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 1.0\n"


class Stub:
    """A local HTTP endpoint whose behaviour per path can be changed while it runs.

    ``generate``: ``ok`` | ``slow`` (answers after ``slow_s``) | ``hang`` (never answers until released) | ``500`` |
    ``404`` / ``405`` / ``501`` (at once).
    ``health``: ``200`` | ``503`` | ``hang``.
    """

    def __init__(self) -> None:
        self.generate = "ok"
        self.health = "200"
        self.slow_s = 0.6
        self.release = threading.Event()
        self.generate_calls = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # noqa: D401 - silence
                pass

            def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:
                    pass

            def do_POST(self):  # noqa: N802
                n = int(self.headers.get("Content-Length") or 0)
                req = json.loads(self.rfile.read(n) or b"{}")
                if self.path != "/generate":
                    return self._send(404, b"{}")
                with stub._lock:
                    stub.generate_calls += 1
                    stub.in_flight += 1
                    stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
                try:
                    mode = stub.generate
                    if mode == "hang":
                        stub.release.wait(60)
                        return
                    if mode == "slow":
                        time.sleep(stub.slow_s)
                    if mode == "500":
                        return self._send(500, b'{"error": {"message": "boom"}}')
                    if mode in ("404", "405", "501"):
                        return self._send(int(mode), b'{"detail": "Not Found"}')
                    assert req["sampling_params"]["max_new_tokens"] == 1
                    body = {"output_ids": [7], "meta_info": {"finish_reason": {"type": "length"}, "completion_tokens": 1}}
                    self._send(200, json.dumps(body).encode())
                finally:
                    with stub._lock:
                        stub.in_flight -= 1

            def do_GET(self):  # noqa: N802
                if self.path == "/health":
                    if stub.health == "hang":
                        stub.release.wait(60)
                        return
                    return self._send(int(stub.health), b"")
                if self.path == "/metrics":
                    return self._send(200, METRICS_TEXT.encode(), "text/plain")
                self._send(404, b"")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub() -> Iterator[Stub]:
    s = Stub()
    yield s
    s.close()


def _closed_port_url() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens once the socket is closed


def _watch(url: str, tmp_path: Path, **kw) -> tuple[Watcher, list[dict], int]:
    events: list[dict] = []
    discover = kw.pop("discover", lambda: {})
    opts = WatchOptions(url=url, interval_s=kw.pop("interval_s", 0.2), probe_timeout_s=kw.pop("probe_timeout_s", 0.5),
                        health_timeout_s=kw.pop("health_timeout_s", 0.5), evidence_root=kw.pop("evidence_root", tmp_path / "ev"),
                        confirm_gap_s=kw.pop("confirm_gap_s", 0.0), **kw).validate()
    w = Watcher(opts, events.append, adapter=SGLangAdapter(), discover=discover)
    code = w.run()
    return w, events, code


def _of(events: list[dict], name: str) -> list[dict]:
    return [e for e in events if e["event"] == name]


# ---------------------------------------------------------------------------------------------------------------
# probe outcomes: down vs hung vs slow


def test_server_down_is_unreachable_not_a_hang(tmp_path: Path) -> None:
    w, events, code = _watch(_closed_port_url(), tmp_path, once=True)
    assert code == 6
    probe = _of(events, "probe")[0]
    assert probe["generate"]["outcome"] == "refused"
    assert not _of(events, "hang") and _of(events, "unreachable")
    assert not (tmp_path / "ev").exists(), "no evidence folder for a server that is simply down"


def test_server_down_in_loop_is_reported_once_after_k_refusals(tmp_path: Path) -> None:
    w, events, code = _watch(_closed_port_url(), tmp_path, failures=2, max_rounds=4)
    assert code == 0
    assert [p["state"] for p in _of(events, "probe")] == ["failing", "unreachable", "unreachable", "unreachable"]
    assert len(_of(events, "unreachable")) == 1 and not _of(events, "hang")


def test_slow_but_answering_generate_is_healthy(stub: Stub, tmp_path: Path) -> None:
    stub.generate, stub.slow_s = "slow", 0.6
    w, events, code = _watch(stub.url, tmp_path, probe_timeout_s=2.0, interval_s=0.1, failures=1, max_rounds=3)
    probes = _of(events, "probe")
    assert [p["generate"]["outcome"] for p in probes] == ["ok", "ok", "ok"]
    assert all(p["generate"]["latency_s"] >= 0.5 for p in probes), "the probe waited for the slow answer"
    assert not _of(events, "hang") and w.state == "healthy"
    w2, ev2, code2 = _watch(stub.url, tmp_path, probe_timeout_s=2.0, once=True)
    assert code2 == 0


def test_silent_hang_declared_after_k_failures_while_health_answers_200(stub: Stub, tmp_path: Path) -> None:
    stub.generate, stub.health = "hang", "200"
    w, events, code = _watch(stub.url, tmp_path, failures=3, max_rounds=5)
    probes = _of(events, "probe")
    assert [p["generate"]["outcome"] for p in probes] == ["timeout"] * 5
    assert [p["consecutive_failures"] for p in probes] == [1, 2, 3, 4, 5]
    assert [p.get("transition") for p in probes] == [None, None, "hang", None, None], "declared once, at the 3rd failure"
    hang = _of(events, "hang")
    assert len(hang) == 1 and hang[0]["kind"] == SILENT
    evd = Path(_of(events, "evidence")[0]["path"])
    verdict = json.loads((evd / "verdict.json").read_text())
    assert verdict["verdict"] == "INCONCLUSIVE" and verdict["exit_code"] == 4 and verdict["hang"] == SILENT
    # a run's verdict.json shape (repro.evidence.VerdictRecord), kind = watch
    assert verdict["kind"] == "watch" and verdict["evidence"] == str(evd) and "rank_pids" in verdict and "timings" in verdict
    assert "no rank process found" in verdict["reason"]
    assert (evd / "metrics.txt").read_text() == METRICS_TEXT, "raw /metrics kept as served"
    report = (evd / "REPORT.md").read_text()
    assert report.startswith("# INCONCLUSIVE — watch ") and "silent hang" in report
    assert len((evd / "probes.jsonl").read_text().splitlines()) == 3
    assert json.loads((evd / "run.json").read_text())["status"] == "complete"


def test_hang_with_health_503_is_reported_as_health_error(stub: Stub, tmp_path: Path) -> None:
    stub.generate, stub.health = "hang", "503"
    w, events, code = _watch(stub.url, tmp_path, once=True)
    assert code == 4, "hung without deadlock evidence (no rank processes here)"
    assert _of(events, "hang")[0]["kind"] == HEALTH_ERROR
    hang_json = json.loads((Path(_of(events, "evidence")[0]["path"]) / "hang.json").read_text())
    assert hang_json["health_at_declaration"]["status"] == 503


def test_http_500_counts_as_failure_and_recovery_is_logged(stub: Stub, tmp_path: Path) -> None:
    stub.generate = "500"
    events: list[dict] = []
    opts = WatchOptions(url=stub.url, interval_s=0.1, probe_timeout_s=0.5, health_timeout_s=0.5, failures=2,
                        evidence_root=tmp_path / "ev", confirm_gap_s=0.0).validate()
    w = Watcher(opts, events.append, discover=lambda: {})
    for _ in range(3):
        if w.probe_round().get("transition") == "hang":
            w.handle_hang()
    stub.generate = "ok"
    rec = w.probe_round()
    outcomes = [p["generate"]["outcome"] for p in _of(events, "probe")]
    assert outcomes == ["http_error", "http_error", "http_error", "ok"]
    assert rec.get("transition") == "recovered" and w.state == "healthy"
    assert len(_of(events, "hang")) == 1


def test_probes_never_overlap_and_a_timed_out_probe_is_abandoned(stub: Stub, tmp_path: Path) -> None:
    stub.generate = "hang"
    w, events, code = _watch(stub.url, tmp_path, failures=100, max_rounds=4, interval_s=0.05, probe_timeout_s=0.3)
    probes = _of(events, "probe")
    assert all(p["generate"]["outcome"] in ("timeout", "skipped") for p in probes)
    # Each abandoned probe's connection is closed by the client; the stub's handler threads keep sleeping, so the
    # server sees one request per round and never more than the rounds so far.
    assert stub.generate_calls <= len(probes)
    assert w._health.busy() is False or w._health.round <= len(probes)


def classify(*answers: ProbeResult, since_round: int, in_flight=None) -> str:
    return classify_health(list(answers), since_round, in_flight, probe_timeout_s=1.0).kind


def test_health_classification_uses_the_newest_answer_since_the_first_failure() -> None:
    ok_before = ProbeResult("health", "ok", 200, 0.01, 0.0, round=3)
    err_after = ProbeResult("health", "http_error", 503, 20.0, 0.0, round=5)
    assert classify(ok_before, since_round=5) == "health-unknown", "an answer from before the failures does not count"
    assert classify(ok_before, err_after, since_round=5) == HEALTH_ERROR
    assert classify(ProbeResult("health", "ok", 200, 0.01, 0.0, round=6), since_round=5) == SILENT
    assert classify(since_round=5, in_flight=(5, 4.0)) == "health-timeout"
    assert classify(ProbeResult("health", "ok", 200, 0.01, 0.0, round=6), since_round=5, in_flight=(7, 4.0)) == \
        "health-timeout", "a newer probe still waiting outranks an older 200"
    assert classify(since_round=5, in_flight=(5, 0.2)) == "health-unknown", "not waiting long enough to tell"


# ---------------------------------------------------------------------------------------------------------------
# --on-hang


def _record_cmd(out: Path) -> str:
    script = (
        "import json, os, pathlib, sys; d = pathlib.Path(os.environ['REPRO_EVIDENCE_DIR']); "
        f"pathlib.Path({str(out)!r}).write_text(json.dumps({{'dir': str(d), "
        "'verdict': (d / 'verdict.json').is_file(), 'report': (d / 'REPORT.md').is_file(), "
        "'status': json.loads((d / 'run.json').read_text())['status'], 'verdict_env': os.environ['REPRO_VERDICT']}))"
    )
    return f"{sys.executable} -c {json.dumps(script)}"


def test_on_hang_runs_after_the_evidence_is_on_disk(stub: Stub, tmp_path: Path) -> None:
    stub.generate = "hang"
    marker = tmp_path / "on_hang_saw.json"
    w, events, code = _watch(stub.url, tmp_path, once=True, on_hang=_record_cmd(marker))
    saw = json.loads(marker.read_text())
    evd = _of(events, "evidence")[0]["path"]
    assert saw == {"dir": evd, "verdict": True, "report": True, "status": "complete", "verdict_env": "INCONCLUSIVE"}
    names = [e["event"] for e in events]
    assert names.index("evidence") < names.index("on_hang")
    res = _of(events, "on_hang")[0]
    assert res["rc"] == 0 and json.loads((Path(evd) / "on_hang.json").read_text())["rc"] == 0


def test_on_hang_failing_is_logged_and_the_watch_goes_on(stub: Stub, tmp_path: Path) -> None:
    stub.generate = "hang"
    w, events, code = _watch(stub.url, tmp_path, failures=1, max_rounds=3,
                             on_hang="echo restart failed >&2; exit 7")
    res = _of(events, "on_hang")
    assert len(res) == 1 and res[0]["rc"] == 7 and "restart failed" in res[0]["output_tail"]
    names = [e["event"] for e in events]
    assert names.count("probe") == 3 and names.index("on_hang") < len(names) - 2, "probing continued after it"
    assert json.loads((Path(res[0]["evidence"]) / "on_hang.json").read_text())["rc"] == 7


def test_on_hang_that_runs_too_long_is_ended_by_process_group(stub: Stub, tmp_path: Path) -> None:
    stub.generate = "hang"
    pidfile = tmp_path / "child.pid"
    w, events, code = _watch(stub.url, tmp_path, once=True, on_hang_timeout_s=1.0,
                             on_hang=f"sleep 60 & echo $! > {pidfile}; wait")
    res = _of(events, "on_hang")[0]
    assert res["timed_out"] is True and res["rc"] is not None
    child = int(pidfile.read_text())
    deadline = time.time() + 5
    while time.time() < deadline and Path(f"/proc/{child}").exists():
        time.sleep(0.05)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2], \
        "the command's child (same process group) was ended too"


# ---------------------------------------------------------------------------------------------------------------
# evidence dir unwritable


def test_unwritable_evidence_dir_is_named_and_the_watch_keeps_going(stub: Stub, tmp_path: Path) -> None:
    stub.generate = "hang"
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the evidence root should be")
    marker = tmp_path / "on_hang_saw.json"
    w, events, code = _watch(stub.url, tmp_path, failures=1, max_rounds=3, evidence_root=blocker / "evidence",
                             on_hang=_record_cmd(marker))
    errs = _of(events, "evidence_error")
    assert errs and str(blocker / "evidence") in errs[0]["path"] and errs[0]["fix"]
    fallback = errs[0]["fallback"]
    assert fallback and Path(fallback, "verdict.json").is_file(), "evidence kept in the fallback folder"
    try:
        assert json.loads(marker.read_text())["dir"] == fallback, "--on-hang got the folder that was written"
        assert len(_of(events, "probe")) == 3, "the watch kept probing"
    finally:
        import shutil

        shutil.rmtree(fallback, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------
# CLI: options, JSON lines, signals


def _cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "repro.cli", "watch", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)


@pytest.mark.parametrize("args,needle", [
    (["--url", "localhost:3000"], "--url"),
    (["--url", "http://127.0.0.1:9", "--failures", "0"], "--failures"),
    (["--url", "http://127.0.0.1:9", "--interval", "0"], "--interval"),
    (["--url", "http://127.0.0.1:9", "--pid-root", "999999999"], "--pid-root"),
    (["--url", "http://127.0.0.1:9", "--once", "--pid-root", "-5"], "--pid-root must be a process id >= 1"),
    (["--url", "http://127.0.0.1:9", "--once", "--pid-root", "0"], "--pid-root must be a process id >= 1"),
])
def test_bad_options_exit_2_naming_the_flag(args: list[str], needle: str) -> None:
    p = _cli(*args)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2 and needle in err


def test_options_validation_messages() -> None:
    with pytest.raises(WatchConfigError, match="--probe-timeout"):
        WatchOptions(url="http://x:1", probe_timeout_s=-1).validate()


@pytest.mark.parametrize("field, flag", [("interval_s", "--interval"), ("probe_timeout_s", "--probe-timeout"),
                                         ("health_timeout_s", "--health-timeout"),
                                         ("on_hang_timeout_s", "--on-hang-timeout"),
                                         ("capture_timeout_s", "--capture-timeout"), ("confirm_gap_s", "confirm gap")])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), float("-inf")])
def test_non_finite_seconds_are_refused_naming_the_flag(field: str, flag: str, value: float) -> None:
    """nan slipped past '>= 0' (confirm gap) and inf past '> 0' (an --interval of inf: a watch that never probes
    again); every seconds option is a finite number (repro.option_checks)."""
    with pytest.raises(WatchConfigError, match=f"{flag} must be a finite number of seconds"):
        WatchOptions(url="http://x:1", **{field: value}).validate()


def test_sigterm_stops_the_loop_cleanly_with_one_json_line_per_probe(stub: Stub) -> None:
    p = _cli("--url", stub.url, "--interval", "0.2", "--probe-timeout", "1")
    try:
        lines: list[dict] = []
        assert p.stdout is not None
        while len([e for e in lines if e["event"] == "probe"]) < 3:
            line = p.stdout.readline()
            assert line, f"watch ended early: {p.stderr.read() if p.stderr else ''}"
            lines.append(json.loads(line))
        p.send_signal(signal.SIGTERM)
        rest, err = p.communicate(timeout=30)
        assert p.returncode == 0, err
        tail = [json.loads(x) for x in rest.splitlines() if x.strip()]
        assert tail and tail[-1]["event"] == "stop" and tail[-1]["reason"] == "stop requested"
        assert all(e["generate"]["outcome"] == "ok" for e in lines if e["event"] == "probe")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


# ---------------------------------------------------------------------------------------------------------------
# a real deadlock (2-rank gloo job) caught through the watch


def test_real_gloo_deadlock_is_captured_before_on_hang(stub: Stub, tmp_path: Path, torch_python: str) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    from gloo_programs.job import GlooJob

    stub.generate, stub.health = "hang", "200"
    marker = tmp_path / "on_hang_saw.json"
    with GlooJob(torch_python, 2, tmp_path / "job", mode="extra-allreduce", extra_rank=0) as job:
        job.wait_ready()
        w, events, code = _watch(stub.url, tmp_path, once=True, on_hang=_record_cmd(marker), confirm_gap_s=0.5,
                                 discover=lambda: job.pids)
    assert code == 3, _of(events, "evidence")
    evd = Path(_of(events, "evidence")[0]["path"])
    for k in (0, 1):
        assert (evd / "stacks" / f"rank{k}.txt").is_file() and (evd / "stacks" / f"rank{k}-2.txt").is_file()
    analysis = json.loads((evd / "analysis.json").read_text())
    assert analysis["diverged"] is True
    states = {r["rank"]: (r["state"], r["op"]) for r in analysis["ranks"]}
    assert states[0] == ("collective", "all_reduce") and states[1][0] == "collective"
    assert json.loads((evd / "verdict.json").read_text())["verdict"] == "DEADLOCKED"
    assert json.loads(marker.read_text())["verdict_env"] == "DEADLOCKED"
    assert "# DEADLOCKED — watch" in (evd / "REPORT.md").read_text().splitlines()[0]


# ---------------------------------------------------------------------------------------------------------------
# discovery of rank processes (titles as sglang sets them: argv[0] = "sglang::scheduler_TP<k>")

_FAKE_SERVER = r"""
import socket, subprocess, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
kids = [subprocess.Popen(["bash", "-c", f"exec -a sglang::scheduler_TP{k} sleep 120"]) for k in range(2)]
kids.append(subprocess.Popen(["bash", "-c", "exec -a sglang::detokenizer sleep 120"]))
print(s.getsockname()[1], " ".join(str(k.pid) for k in kids), flush=True)
time.sleep(120)
"""


class FakeServerTree:
    """A process listening on a port with children titled like sglang's scheduler ranks and detokenizer."""

    def __enter__(self) -> "FakeServerTree":
        self.p = subprocess.Popen([sys.executable, "-c", _FAKE_SERVER], stdout=subprocess.PIPE, text=True,
                                  start_new_session=True)
        assert self.p.stdout is not None
        first = self.p.stdout.readline().split()
        self.port, self.kids = int(first[0]), [int(x) for x in first[1:]]
        deadline = time.time() + 10
        while time.time() < deadline and not all(
                Path(f"/proc/{k}/cmdline").read_bytes().startswith(b"sglang::") for k in self.kids):
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait(timeout=10)
        deadline = time.time() + 10  # the children are re-parented; wait until they are gone (or zombies)
        while time.time() < deadline and any(_running(k) for k in self.kids):
            time.sleep(0.02)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_discovery_under_pid_root_and_under_the_listener_of_the_url() -> None:
    from repro.watch import discover_ranks

    with FakeServerTree() as t:
        url = f"http://127.0.0.1:{t.port}"
        by_root = discover_ranks(SGLangAdapter(), url, pid_root=t.p.pid)
        assert by_root.method == "pid-root" and by_root.rank_pids == {0: t.kids[0], 1: t.kids[1]}
        by_listener = discover_ranks(SGLangAdapter(), url)
        assert by_listener.method == "listener" and by_listener.rank_pids == {0: t.kids[0], 1: t.kids[1]}
        only_tp1 = discover_ranks(SGLangAdapter(), url, pid_root=t.p.pid, match="scheduler_TP1")
        assert only_tp1.rank_pids == {1: t.kids[1]}


def test_two_servers_on_one_host_need_pid_root() -> None:
    from repro.watch import DiscoveryError, discover_ranks

    with FakeServerTree() as a, FakeServerTree():
        with pytest.raises(DiscoveryError, match="--pid-root"):
            discover_ranks(SGLangAdapter(), f"http://127.0.0.1:{a.port}", match="sglang::scheduler")


def test_no_rank_process_is_a_note_naming_the_flags(tmp_path: Path) -> None:
    from repro.watch import discover_ranks

    d = discover_ranks(SGLangAdapter(), _closed_port_url(), pid_root=os.getpid(), match="sglang::scheduler")
    assert d.rank_pids == {} and "--pid-root" in d.note


def test_a_listener_without_rank_children_is_not_replaced_by_some_other_server() -> None:
    from repro.watch import discover_ranks

    # The listener runs in its own process (a stub in this process would have the fake server as a descendant).
    web = subprocess.Popen([sys.executable, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1"], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        assert web.stdout is not None
        port = int(web.stdout.readline().split(" port ")[1].split()[0])
        with FakeServerTree():  # another "server" on this host: must not be picked for the listener's URL
            d = discover_ranks(SGLangAdapter(), f"http://127.0.0.1:{port}")
        assert d.method == "listener" and d.rank_pids == {} and "--pid-root" in d.note
    finally:
        os.killpg(web.pid, signal.SIGKILL)
        web.wait(timeout=10)


def test_a_remote_url_is_never_matched_to_local_processes() -> None:
    from repro.watch import discover_ranks

    with FakeServerTree():
        d = discover_ranks(SGLangAdapter(), "http://192.0.2.10:30000")  # TEST-NET-1: never a local address
    assert d.rank_pids == {} and d.method == "none" and "this host" in d.note


# ---------------------------------------------------------------------------------------------------------------
# a server that errors fast is not hung: "not this engine's API / misconfigured URL" (exit 8)


class _Closer:
    """A TCP port that accepts every connection and closes it at once, without a byte of answer."""

    def __init__(self) -> None:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.close()

    def close(self) -> None:
        self.sock.close()


class _NoPost(BaseHTTPRequestHandler):
    """An HTTP server with no POST route at all: http.server answers 501 Unsupported method."""

    def log_message(self, *a):  # noqa: D401 - silence
        pass

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.mark.parametrize("mode", ["404", "405"])
def test_a_fast_404_or_405_before_any_success_is_misconfigured_not_a_hang(stub: Stub, tmp_path: Path, mode: str) -> None:
    from typer.testing import CliRunner

    from repro.cli import app

    stub.generate = mode
    marker = tmp_path / "on-hang-ran"
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    r = CliRunner().invoke(app, ["watch", "--url", stub.url, "--once", "--probe-timeout", "2", "--interval", "2",
                                 "--evidence-dir", str(tmp_path / "ev"), "--on-hang", f"touch {marker}"])
    assert r.exit_code == 8, r.output
    # the watch's stop-the-loop handlers end with the command: an in-process caller gets its Ctrl-C back
    assert {sig: signal.getsignal(sig) for sig in before} == before
    events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert not _of(events, "hang") and _of(events, "misconfigured")
    assert f"HTTP {mode}" in _of(events, "misconfigured")[0]["detail"]
    assert not marker.exists(), "--on-hang ran for a server that answers at once"
    assert not (tmp_path / "ev").exists(), "no hang evidence for a misconfigured URL"


def test_a_server_without_the_route_501_ends_the_loop_with_exit_8(tmp_path: Path) -> None:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _NoPost)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        w, events, code = _watch(f"http://127.0.0.1:{srv.server_address[1]}", tmp_path, failures=2, max_rounds=6)
    finally:
        srv.shutdown()
        srv.server_close()
    assert code == 8 and w.round == 2, "ends after --failures fast 501s"
    assert [p["generate"]["status"] for p in _of(events, "probe")] == [501, 501]
    assert not _of(events, "hang") and not (tmp_path / "ev").exists()


def test_a_port_that_closes_the_connection_at_once_is_misconfigured(tmp_path: Path) -> None:
    closer = _Closer()
    try:
        w, events, code = _watch(closer.url, tmp_path, once=True, on_hang=f"touch {tmp_path / 'ran'}")
    finally:
        closer.close()
    assert code == 8, events
    assert "closed" in _of(events, "misconfigured")[0]["detail"]
    assert not _of(events, "hang") and not (tmp_path / "ran").exists() and not (tmp_path / "ev").exists()


@pytest.mark.parametrize("mode", ["500", "404"])
def test_fast_errors_after_a_success_still_count_toward_a_hang(stub: Stub, tmp_path: Path, mode: str) -> None:
    # a router answers fast 5xx when its workers hang: after one good answer, fast errors are failures
    events: list[dict] = []
    opts = WatchOptions(url=stub.url, interval_s=0.1, probe_timeout_s=0.5, health_timeout_s=0.5, failures=2,
                        evidence_root=tmp_path / "ev", confirm_gap_s=0.0).validate()
    w = Watcher(opts, events.append, discover=lambda: {})
    assert w.probe_round()["generate"]["outcome"] == "ok"
    stub.generate = mode
    transitions = [w.probe_round().get("transition") for _ in range(2)]
    assert transitions == [None, "hang"] and w.state == "hung"
    assert not _of(events, "misconfigured")
