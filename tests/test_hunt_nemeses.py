"""Workload nemeses (repro/nemeses.py) as data and as driver actions, against a small local HTTP stand-in (not
SGLang: the driver's bookkeeping and the data's checks only; tests/test_e2e_hunt_nemeses.py runs every nemesis on
a real server)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from repro import nemeses as N
from repro.driver import TOKEN_ID_RANGE, BurstDriver
from repro.scenario import load_scenario
from repro.verdict import SUCCEEDED, judge_completion
from test_driver_evidence import PlainAdapter

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ROOT / "scenarios" / "sglang" / "hunt_workloads.toml"
BASE = ROOT / "scenarios" / "sglang" / "hicache_prefetch_30760.toml"


class SamplingAdapter(PlainAdapter):
    def with_sampling(self, body, params):
        return {**body, "sampling": dict(params)}


def _server(token_gap_s: float = 0.05, admin_delay_s: float = 0.0):
    """SSE generate at /gen (n tokens, one per ``token_gap_s``), /admin answering 400 while a stream is open else
    200 (``admin_delay_s`` after the call came), /info answering JSON; records the bodies and admin calls it saw."""
    seen: dict = {"bodies": [], "admin": [], "open": 0, "disconnects": 0}
    lock = threading.Lock()

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def _plain(self, code: int, text: str) -> None:
            data = text.encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path.startswith("/info"):
                self._plain(200, json.dumps({"model_path": "/models/tiny"}))
            else:
                self._plain(404, "no")

        def do_PUT(self):
            self.do_POST()

        def do_DELETE(self):
            self.do_POST()

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n)) if n else None
            if self.path.startswith("/admin"):
                with lock:
                    busy = seen["open"] > 0
                    seen["admin"].append({"path": self.path, "method": self.command, "body": body,
                                          "auth": self.headers.get("Authorization"), "busy": busy})
                time.sleep(admin_delay_s)
                self._plain(400 if busy else 200, "busy" if busy else "done")
                return
            with lock:
                seen["bodies"].append(body)
                seen["open"] += 1
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                for i in range(1, body["n"] + 1):
                    time.sleep(token_gap_s)
                    self._chunk(f"data: {json.dumps({'n': i, 'finish': 'length' if i == body['n'] else None})}\n\n".encode())
                self._chunk(b"data: [DONE]\n\n")
                self._chunk(b"")
            except (BrokenPipeError, ConnectionResetError):
                with lock:
                    seen["disconnects"] += 1
            finally:
                with lock:
                    seen["open"] -= 1

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, seen


def _drive(tmp_path, workload: N.Workload, n: int = 8, max_new: int = 4, adapter=None, gap_s: float = 0.05,
           input_len: int = 3, concurrency: int = 4, admin_delay_s: float = 0.0, settle_s: float = 0.3):
    srv, seen = _server(gap_s, admin_delay_s)
    try:
        plans = N.request_plans(n, input_len, max_new, workload)
        prompts = N.make_prompts_for(plans, 7, TOKEN_ID_RANGE)
        d = BurstDriver(adapter or PlainAdapter(), f"http://127.0.0.1:{srv.server_port}", prompts, max_new, concurrency,
                        tmp_path / "r.jsonl", 10, workload=workload)
        d.start()
        deadline = time.time() + 30
        while not d.state().finished and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(settle_s)  # the history's last lines
        st = d.state()
        d.close()
    finally:
        srv.shutdown()
    events = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    return st, seen, events


def test_mixed_requests_cycle_lengths_and_sampling_and_all_succeed(tmp_path):
    wl = N.Workload(mix=N.RequestMix(input_lens=[2, 9], max_new_tokens=[1, 3, 5],
                                     sampling=[{"temperature": 0.0}, {"temperature": 0.8, "top_p": 0.9}]))
    st, seen, _ = _drive(tmp_path, wl, n=6, adapter=SamplingAdapter())
    assert st.finished and st.ok == 6 and st.failed == 0
    by_len = {len(b["ids"]): b for b in seen["bodies"]}
    assert set(by_len) == {2, 9}
    assert sorted(b["n"] for b in seen["bodies"]) == [1, 1, 3, 3, 5, 5]
    assert {json.dumps(b["sampling"], sort_keys=True) for b in seen["bodies"]} == {
        '{"temperature": 0.0}', '{"temperature": 0.8, "top_p": 0.9}'}
    assert [r.max_new_tokens for r in st.requests] == [1, 3, 5, 1, 3, 5]  # each request judged on its own length


def test_sampling_without_the_adapters_with_sampling_is_one_clear_error(tmp_path):
    wl = N.Workload(mix=N.RequestMix(sampling=[{"temperature": 0.5}]))
    with pytest.raises(ValueError, match="with_sampling"):
        BurstDriver(PlainAdapter(), "http://127.0.0.1:1", [[1, 2]], 2, 1, tmp_path / "r.jsonl", 5, workload=wl)


def test_client_abort_mid_stream_disconnects_after_n_tokens_and_is_not_a_failure(tmp_path):
    wl = N.Workload(client_abort=N.ClientAbort(every=2, after_tokens=2))
    st, seen, events = _drive(tmp_path, wl, n=6, max_new=8, gap_s=0.05)
    assert st.finished and st.aborted == 3 and st.ok == 3 and st.failed == 0
    cut = [r for r in st.requests if r.status == "aborted"]
    assert [r.index for r in cut] == [0, 2, 4]
    assert all(r.output_len == 2 and "client abort" in (r.error or "") for r in cut)
    time.sleep(0.2)
    assert seen["disconnects"] >= 1  # the stand-in saw clients leave mid-stream
    assert judge_completion(st.requests, [0], [0], [0], []).verdict == SUCCEEDED


def test_deadline_gives_up_slow_requests_and_says_why(tmp_path):
    wl = N.Workload(deadlines=N.Deadlines(every=3, deadline_s=0.3))
    st, _, events = _drive(tmp_path, wl, n=6, max_new=20, gap_s=0.05)  # 1 s per request: the deadline cuts it
    assert st.finished
    cut = sorted(r.index for r in st.requests if r.status == "aborted")
    assert cut == [0, 3]
    assert all("deadline of 0.3 s" in (r.error or "") for r in st.requests if r.status == "aborted")
    assert st.ok == 4 and st.failed == 0
    done = [e for e in events if e.get("event") == "aborted"]
    assert {e["request"] for e in done} == {0, 3}


def test_admin_calls_under_load_are_recorded_with_status_and_body_filled(tmp_path):
    wl = N.Workload(admin=[
        N.AdminCall(method="DELETE", path="/admin/detach", when_in_flight=2, ok_status=[200, 400],
                    headers={"Authorization": "Bearer k"}),
        N.AdminCall(method="POST", path="/admin/update", when_in_flight=2, fill_from="/info",
                    body={"model_path": "{model_path}", "load_format": "dummy"}, repeat=2, interval_s=0.05)],
        after=1)
    # streams of 10 tokens 0.2 s apart: the calls land while they are open also on a loaded box (0.05 s failed once)
    st, seen, events = _drive(tmp_path, wl, n=6, max_new=10, gap_s=0.2)
    assert st.finished and st.ok == 7 and len(st.requests) == 7  # 6 + 1 after the burst
    calls = seen["admin"]
    assert len(calls) == 3 and all(c["busy"] for c in calls)  # all landed while streams were open
    # the two calls run on their own threads: which reaches the server first is not this test's question
    dele = [c for c in calls if c["method"] == "DELETE"]
    assert len(dele) == 1 and dele[0]["auth"] == "Bearer k"
    assert [c["body"] for c in calls if c["method"] == "POST"] == [{"model_path": "/models/tiny", "load_format": "dummy"}] * 2
    assert [(a["path"], a["http_status"], a["ok"]) for a in sorted(st.admin, key=lambda a: (a["call"], a["n"]))] == [
        ("/admin/detach", 400, True), ("/admin/update", 400, False), ("/admin/update", 400, False)]
    assert len([e for e in events if e.get("event") == "admin"]) == 3


def test_after_requests_start_only_once_the_burst_ended(tmp_path):
    wl = N.Workload(after=2)
    st, _, events = _drive(tmp_path, wl, n=4, max_new=3)
    assert st.finished and st.ok == 6
    sent = {e["request"]: e["t"] for e in events if e.get("event") == "sent"}
    ended = max(e["t"] for e in events if e.get("event") == "done" and e["request"] < 4)
    assert min(sent[4], sent[5]) >= ended


def test_admin_call_that_never_sees_the_load_is_not_made_and_says_so(tmp_path):
    wl = N.Workload(admin=[N.AdminCall(path="/admin/x", when_in_flight=50, wait_s=0.5)])
    st, seen, _ = _drive(tmp_path, wl, n=2, max_new=12)
    assert seen["admin"] == [] and len(st.admin) == 1 and st.admin[0]["done"] is False
    assert "never 50 requests in flight" in st.admin[0]["error"]


def test_a_burst_is_not_finished_while_its_admin_call_waits_for_the_answer(tmp_path):
    # the clean-clone CI race: the burst's requests all ended in 1.6 s, /flush_cache answered later, and the run's
    # snapshot (taken once `finished`) held no admin record; here /admin answers 1.5 s after the last request ended
    wl = N.Workload(admin=[N.AdminCall(path="/admin/slow", when_in_flight=1, timeout_s=10)])
    t0 = time.time()
    st, seen, _ = _drive(tmp_path, wl, n=2, max_new=3, admin_delay_s=1.5, settle_s=0.0)
    assert st.finished and st.ok == 2
    assert len(seen["admin"]) == 1 and time.time() - t0 >= 1.5
    # 400 or 200: whether the stand-in had counted the stream as open yet is a race this test does not judge
    assert len(st.admin) == 1 and st.admin[0]["done"] is True and st.admin[0]["http_status"] in (200, 400)


def test_a_burst_held_open_only_by_its_admin_call_says_so_for_a_budget_time_out(tmp_path):
    """What a run's budget time-out quotes when the requests all ended but an admin call has no answer yet: that call,
    not "requests still outstanding" (repro/runner.py, repro/remote_run.py)."""
    wl = N.Workload(admin=[N.AdminCall(path="/admin/slow", when_in_flight=1, timeout_s=10)])
    srv, _ = _server(0.05, admin_delay_s=3.0)
    try:
        plans = N.request_plans(2, 3, 3, wl)
        d = BurstDriver(PlainAdapter(), f"http://127.0.0.1:{srv.server_port}", N.make_prompts_for(plans, 7, TOKEN_ID_RANGE),
                        3, 4, tmp_path / "r.jsonl", 10, workload=wl)
        d.start()
        deadline = time.time() + 20
        mid = None
        while time.time() < deadline:
            st = d.state()
            if st.finished:
                break
            if st.pending == 0 and st.outstanding == 0 and mid is None:
                mid = st
            time.sleep(0.02)
        d.close()
    finally:
        srv.shutdown()
    assert mid is not None and not mid.finished and mid.admin_live == 1
    assert mid.waiting_for() == "every request ended; 1 admin call(s) still waiting for an answer"
    assert st.finished and st.admin_live == 0


def test_an_admin_call_waiting_for_load_gives_up_once_every_request_ended(tmp_path):
    # wait_s is 60 s, but once the burst is over no load can come: `finished` must not wait a minute for it
    wl = N.Workload(admin=[N.AdminCall(path="/admin/x", when_in_flight=50, wait_s=60)])
    t0 = time.time()
    st, seen, _ = _drive(tmp_path, wl, n=2, max_new=3, settle_s=0.0)
    assert st.finished and time.time() - t0 < 10
    assert seen["admin"] == [] and st.admin[0]["done"] is False
    assert "before every request had ended" in st.admin[0]["error"]


# ---------------------------------------------------------------------------------------------------- the data
def test_the_sglang_workload_file_loads_and_every_workload_is_a_valid_scenario_burst(tmp_path):
    cat = N.load_nemeses(WORKLOADS)
    assert {"mass_abort", "client_abort", "deadlines", "memory_pressure", "chunked_long", "mixed", "flush_cache",
            "storage_attach_detach", "weight_update"} <= set(cat.workloads)
    assert cat.not_run  # what the testbed cannot serve is listed, with why
    base = load_scenario(BASE)
    for name, spec in cat.workloads.items():
        b = base.burst.model_copy(update={"workload": spec.workload})
        assert N.effective_sizes(b, spec.workload)[0] >= 1
    assert cat.workload("mass_abort").abort["count"] == 4


def test_configs_set_replace_and_remove_flags():
    cat = N.load_nemeses(WORKLOADS)
    base = ["--enable-hierarchical-cache", "--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy", "timeout"]
    assert N.config_args(base, cat, "prefetch_best_effort") == [
        "--enable-hierarchical-cache", "--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy", "best_effort"]
    assert N.config_args(base, cat, "no_radix") == ["--disable-radix-cache"]
    assert N.config_args(base, cat, "chunked_64")[-2:] == ["--chunked-prefill-size", "64"]
    with pytest.raises(N.NemesisError, match="needs .*--enable-hierarchical-cache"):
        N.config_args(["--tp-size", "2"], cat, "write_back")


def test_workloads_with_the_same_flags_share_a_server_group():
    cat = N.load_nemeses(WORKLOADS)
    base = ["--enable-hierarchical-cache"]
    groups = N.server_groups(base, cat, ["base", "schedule_fcfs"], ["quiet", "mass_abort", "mixed", "memory_pressure"])
    assert [(g.config, g.workloads) for g in groups] == [
        ("base", ("quiet", "mass_abort", "mixed")), ("base", ("memory_pressure",)),
        ("schedule_fcfs", ("quiet", "mass_abort", "mixed")), ("schedule_fcfs", ("memory_pressure",))]
    assert "--max-total-tokens" in groups[1].args
    # a base that already has the pressure flags runs every workload on one server
    pressured = N.set_args(base, cat.workload("memory_pressure").server_args)
    assert len(N.server_groups(pressured, cat, ["base"], ["quiet", "mass_abort", "memory_pressure"])) == 1


def test_a_bad_workload_field_is_one_error_naming_file_and_field(tmp_path):
    f = tmp_path / "w.toml"
    f.write_text('[workloads.x]\nworkload = { deadlines = { every = 0, deadline_s = 1 } }\n')
    with pytest.raises(N.NemesisError, match=r"w\.toml: workloads\.x\.workload\.deadlines\.every"):
        N.load_nemeses(f)
    f.write_text('[workloads.x]\nspeed = 3\n')
    with pytest.raises(N.NemesisError, match="unknown field"):
        N.load_nemeses(f)
    with pytest.raises(N.NemesisError, match="no workload 'nope'"):
        N.load_nemeses(WORKLOADS).workload("nope")


# ------------------------------------------------------------------------ the hunt under workloads (stand-in runner)
import types  # noqa: E402

from repro import hunt as H  # noqa: E402
from repro.hunt import loop as HL  # noqa: E402
from repro import runner as real_runner  # noqa: E402
from repro.driver import DriverState  # noqa: E402
from repro.verdict import DEADLOCKED, Verdict  # noqa: E402
from test_hunt import PREFILL, FakeRunner, _rank  # noqa: E402


class WorkloadRunner(FakeRunner):
    """FakeRunner whose baseline variants (one per workload) record ``seen`` events under their own probe ids; the
    clean run of ``deadlock_clean`` deadlocks (the engine unsafe under that load with no perturbation)."""

    def __init__(self, script: dict, deadlock_clean: str = "", interrupt_at: Optional[str] = None) -> None:
        super().__init__(script, interrupt_at=interrupt_at)
        base_session = self.Session
        outer = self
        self.workloads_seen: list[tuple[str, Any]] = []

        class S(base_session):  # type: ignore[misc, valid-type]
            def drive(self, variant, run_dir, n=None, native=False):
                if not variant.name.startswith("baseline"):
                    outer.workloads_seen.append((variant.name, variant.workload))
                    return super().drive(variant, run_dir, n, native)
                outer.driven.append(variant.name)
                outer.workloads_seen.append((variant.name, variant.workload))
                if outer.interrupt_at and outer.interrupt_at in variant.name:
                    raise KeyboardInterrupt
                suffix = variant.name[len("baseline"):].replace("-", ".", 1)
                lines = [{"event": "seen", "id": f"probe-get_num_allocatable_reqs{suffix}", "rank": 0, "caller": PREFILL,
                          "stack": [PREFILL, "m:a"], "loops": [["req"], []]}]
                with open(self.p.evidence.injector_dir / "fires-100.jsonl", "a") as fh:
                    fh.write("".join(json.dumps(x) + "\n" for x in lines))
                st = DriverState(8, 0, 0, 6, 0, 1.0, True, aborted=2,
                                 admin=({"call": 0, "n": 0, "method": "POST", "path": "/flush_cache", "http_status": 400, "done": True},))
                if deadlock_clean and variant.name == f"baseline-{deadlock_clean}":
                    analysis = types.SimpleNamespace(to_dict=lambda: {"ranks": [
                        _rank(0, "collective", ["UnifiedRadixCache.check_hicache_events", "Scheduler.get_next_batch_to_run"]),
                        _rank(1, "idle-wait", ["Scheduler.recv_requests"])]})
                    return real_runner.Outcome(Verdict(DEADLOCKED, "ranks disagree"), analysis, st, {"burst_s": 9.0}, False)
                return real_runner.Outcome(Verdict("ALL REQUESTS SUCCEEDED", "ok"), None, st, {"burst_s": 1.0}, True)

        self.Session = S


def _wopts(tmp_path: Path, **kw: Any) -> H.HuntOptions:
    kw.setdefault("spare", False)  # the session counts below are the plain ones (the spare: tests/test_hunt_spare.py)
    return H.HuntOptions(scenario_path=BASE, evidence_root=tmp_path / "ev", only=("get_num_allocatable_reqs",),
                         perturbations=("zero_once",), ranks=(0,), **kw)


def test_each_workload_runs_clean_first_then_trials_under_it_and_groups_share_servers(tmp_path, monkeypatch):
    monkeypatch.setattr(HL, "SETTLE_S", 0.0)
    fr = WorkloadRunner({}, deadlock_clean="mixed")
    res = H.hunt(_wopts(tmp_path, workloads=("mass_abort", "mixed", "memory_pressure"), configs=("schedule_fcfs",)), runs=fr)
    m = json.loads((res.folder / "matrix.json").read_text())
    assert [(g["config"], g["workloads"]) for g in m["groups"]] == [
        ("base", ["quiet", "mass_abort", "mixed"]), ("base", ["memory_pressure"]),
        ("schedule_fcfs", ["quiet", "mass_abort", "mixed"]), ("schedule_fcfs", ["memory_pressure"])]
    assert all(g["status"] == "complete" for g in m["groups"])
    # one baseline server + one trial server per group: the 3 workloads of a group share them
    assert len(fr.sessions) == 8
    first = m["groups"][0]
    assert [b["workload"] for b in first["baselines"]] == ["quiet", "mass_abort", "mixed"]
    assert [b["verdict"] for b in first["baselines"]] == ["ALL REQUESTS SUCCEEDED", "ALL REQUESTS SUCCEEDED", "DEADLOCKED"]
    # the clean deadlock is a finding of its own, with a scenario that carries the workload and no injection
    folder = Path(first["folder"])
    finding = folder / "FINDING-mixed.md"
    assert finding.exists() and "no perturbation" in finding.read_text()
    sc = load_scenario(folder / "scenarios" / "workload-mixed.toml")
    assert sc.variants[0].expect == "deadlock" and sc.variants[0].injections == []
    assert sc.variants[0].workload.mix.input_lens == [8, 64, 200, 16, 120]
    # the mass abort is the driver's AbortPlan (the PD issue's action), carried on the variant
    abort_runs = [wl for name, wl in fr.workloads_seen if name.endswith("mass_abort")]
    assert abort_runs and all(w is not None and w.after == 2 for w in abort_runs)
    trials = load_scenario(folder / "scenarios" / "trials.toml")
    ma = next(v for v in trials.variants if v.name.endswith("-wmass_abort"))
    assert ma.abort is not None and ma.abort.count == 4
    # per group: 1 row × 1 perturbation × 1 rank per workload
    names = [r.trial.name for r in res.results]
    assert len(names) == 8 and sum(n.endswith("-wmixed") for n in names) == 2
    md = (res.folder / "HUNT.md").read_text()
    assert "| `mixed` | DEADLOCKED |" in md and "POST /flush_cache → 400" in md and "Not run on this testbed" in md
    inner = (folder / "HUNT.md").read_text()
    assert "## Workloads: each run clean first" in inner and "`mass_abort`" in inner


def test_a_trial_deadlock_under_a_workload_writes_a_scenario_with_that_workload(tmp_path, monkeypatch):
    monkeypatch.setattr(HL, "SETTLE_S", 0.0)
    fr = WorkloadRunner({"-wclient_abort": DEADLOCKED})
    res = H.hunt(_wopts(tmp_path, workloads=("client_abort",)), runs=fr)
    dl = [r for r in res.results if r.verdict == DEADLOCKED]
    assert len(dl) == 1 and dl[0].trial.workload == "client_abort"
    sc = load_scenario(dl[0].scenario_file)
    assert sc.variants[0].workload.client_abort.after_tokens == 2


def test_an_interrupted_matrix_says_so_and_stops_every_server(tmp_path, monkeypatch):
    monkeypatch.setattr(HL, "SETTLE_S", 0.0)
    fr = WorkloadRunner({}, interrupt_at="baseline-mixed")
    with pytest.raises(KeyboardInterrupt):
        H.hunt(_wopts(tmp_path, workloads=("mixed",), configs=("no_radix",)), runs=fr)
    assert all(not s.running for s in fr.sessions)
    top = next((tmp_path / "ev").glob("*/*-hunt-matrix"))
    assert json.loads((top / "matrix.json").read_text())["status"] == "interrupted"


def test_unknown_workload_or_config_is_refused_before_any_launch(tmp_path):
    fr = WorkloadRunner({})
    with pytest.raises(H.HuntError, match="no workload 'nope'"):
        H.hunt(_wopts(tmp_path, workloads=("nope",)), runs=fr)
    with pytest.raises(H.HuntError, match="no configuration 'nah'"):
        H.hunt(_wopts(tmp_path, configs=("nah",)), runs=fr)
    assert fr.sessions == []


def test_clean_runs_past_the_budget_are_not_run_and_say_so(tmp_path, monkeypatch):
    monkeypatch.setattr(HL, "SETTLE_S", 0.0)
    fr = WorkloadRunner({})
    real = H.Clock.remaining
    calls = {"n": 0}

    def remaining(self):
        calls["n"] += 1
        return real.fget(self) if calls["n"] <= 3 else 0.0

    monkeypatch.setattr(H.Clock, "remaining", property(remaining))
    res = H.hunt(_wopts(tmp_path, workloads=("mass_abort", "mixed"), clean_only=True), runs=fr)
    m = json.loads((res.folder / "matrix.json").read_text())
    verdicts = [b["verdict"] for g in m["groups"] for b in g.get("baselines", [])]
    assert "NOT RUN" in verdicts and verdicts[0] == "ALL REQUESTS SUCCEEDED"
    assert res.results == []  # --clean-only: no trials


WORKLOADS = Path(__file__).resolve().parent.parent / "scenarios" / "sglang" / "hunt_workloads.toml"
SMOKE_SCENARIO = Path(__file__).resolve().parent.parent / "scenarios" / "sglang" / "smoke_extra_allreduce.toml"


@pytest.mark.parametrize("old,new,says", [
    ("count = 4,", "count = true,", "abort.count: Input should be a valid integer"),
    ("before_first_token = true", 'before_first_token = "yes"', "abort.before_first_token: Input should be a valid boolean"),
    ("workload = { requests = 12,", 'workload = { requests = "12",', "workload.requests: Input should be a valid integer"),
    ("deadline_s = 0.5", 'deadline_s = "0.5"', "workload.deadlines.deadline_s: Input should be a valid number"),
    ("input_lens = [8,", 'input_lens = ["8",', "workload.mix.input_lens.0: Input should be a valid integer"),
])
def test_a_workload_number_or_boolean_of_the_wrong_type_is_refused(tmp_path: Path, old, new, says):
    """Lax pydantic read `count = true` as 1 abort, `requests = "12"` as 12: the nemeses' numbers are now strict."""
    text = WORKLOADS.read_text()
    assert old in text
    bad = tmp_path / "w.toml"
    bad.write_text(text.replace(old, new, 1))
    with pytest.raises(N.NemesisError, match=says.replace(".", r"\.")):
        N.load_nemeses(bad)
    assert N.load_nemeses(WORKLOADS)  # the shipped file (ints in float fields: timeout_s = 30) still loads


def test_a_scenario_workload_of_the_wrong_type_is_refused_naming_its_path(tmp_path: Path):
    from repro.scenario import ScenarioError

    bad = tmp_path / "s.toml"
    bad.write_text(SMOKE_SCENARIO.read_text().replace("[burst]", "[burst.workload]\nafter = true\n[burst]", 1))
    with pytest.raises(ScenarioError, match=r"burst\.workload\.after: Input should be a valid integer \(got true, a boolean\)"):
        load_scenario(bad)
