"""A site that resolves nowhere stops a launched run before its burst, with the nearest names (exit 2 in the CLI).

A small stand-in server (not SGLang) runs with the real injector loaded and a plan whose site has a typo in a
stdlib class (``json.decoder:JSONDecodr.decode``): the injector records it ``absent`` when the stand-in imports the
module, as it does for ``Scheduler`` when sglang imports its scheduler; the session must refuse to go on and name
``JSONDecoder``, the nearest existing name, from the injector's own resolver run in the target interpreter.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from repro import evidence as ev
from repro import resources
from repro.runner import Prepared, Session, UnresolvedSitesError
from repro.scenario import PLAN_ENV, compile_plan, load_scenario
from repro.targets.base import LaunchSpec
from repro.targets.sglang import SGLangAdapter

REPO = Path(__file__).resolve().parent.parent
SMOKE = REPO / "scenarios" / "sglang" / "smoke_extra_allreduce.toml"

SERVER = textwrap.dedent('''
    import http.server, json.decoder, sys, time
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def do_POST(self):  # a generate that never answers (the burst stays in flight)
            time.sleep(60)
        def log_message(self, *a): pass
    http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
''')


class _StandIn(SGLangAdapter):
    def __init__(self, script: Path):
        self.argv = [sys.executable, str(script), "{port}"]

    def launch_command(self, spec: LaunchSpec) -> list[str]:
        return [a.format(port=spec.port) for a in self.argv]

    def rank_pids(self, procs):
        return {0: procs[0].pid}


def _prepared(tmp_path: Path, site: str) -> Prepared:
    scen_file = tmp_path / "s.toml"
    scen_file.write_text(SMOKE.read_text().replace('"sglang.srt.managers.scheduler:Scheduler.run_batch"', f'"{site}"'))
    scen = load_scenario(scen_file)
    variant = scen.variant("control")
    evd = ev.EvidenceDir(tmp_path / "evidence", scen.name, "control")
    arm = evd.path / "ARM"
    plan = compile_plan(scen, variant, evd.injector_dir, arm)
    evd.write_json("plan.json", plan)
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    spec = LaunchSpec(python=sys.executable, model="unused", tp_size=1, env={PLAN_ENV: str(evd.file("plan.json"))},
                      pythonpath_prepend=[str(resources.injectors_dir())])
    return Prepared(scen, variant, evd, plan, spec, _StandIn(script), sys.executable, False, arm)


def test_a_site_absent_in_the_target_stops_the_session_before_any_burst_with_the_nearest_name(tmp_path: Path):
    p = _prepared(tmp_path, "json.decoder:JSONDecodr.decode")
    session = Session(p)
    try:
        with pytest.raises(UnresolvedSitesError) as e:
            session.start()
    finally:
        session.stop()
    msg = str(e.value)
    assert "\n" not in msg
    assert "json.decoder:JSONDecodr.decode" in msg and "JSONDecoder" in msg and "repro sites" in msg
    # the injector itself recorded the site absent in the server process (what the verdict reads)
    from repro import injection_records

    detail = injection_records.read_injector_dir(p.evidence.injector_dir).absent_detail(p.variant.injections[0].id)
    assert detail and "JSONDecodr" in detail


def test_a_resolvable_site_passes_the_check(tmp_path: Path):
    p = _prepared(tmp_path, "json.decoder:JSONDecoder.decode")
    session = Session(p)
    try:
        assert session.start() is None
    finally:
        session.stop()


def test_a_site_absent_at_run_time_is_named_absent_in_the_verdict_not_unexercised():
    from repro.verdict import InjectionCheck, judge_completion

    class R:
        succeeded, status, error, index = True, 200, "", 0

    inj = InjectionCheck("x", "m:Schedular.run_batch", {}, {}, {}, absent="m:Schedular.run_batch: module 'm' has no attribute 'Schedular'")
    v = judge_completion([R()], [0, 1], [0, 1], [0, 1], [inj])
    assert v.verdict == "INCONCLUSIVE" and "absent" in v.reason and "Schedular" in v.reason
    assert "did not exercise" not in v.reason


def test_an_interrupted_burst_reports_the_requests_it_sent_not_none(tmp_path: Path):
    from repro.runner import RunOptions, run_prepared

    p = _prepared(tmp_path, "json.decoder:JSONDecoder.decode")
    sent = []

    def observe(event: str, data: dict) -> None:
        if event == "burst" and data["state"].outstanding >= 2:
            sent.append(data["state"].outstanding)
            raise KeyboardInterrupt  # Ctrl-C while requests are in flight

    with pytest.raises(KeyboardInterrupt):
        run_prepared(p, RunOptions(scenario_path=tmp_path / "s.toml", variant="control", requests=4), observe)
    report = p.evidence.file("REPORT.md").read_text()
    assert "no requests were sent" not in report
    assert "4 requests:" in report and "outstanding" in report
    assert json.loads(p.evidence.file("run.json").read_text())["status"] == "interrupted"


def test_a_run_refused_after_launch_writes_the_exit_code_the_process_exits_with(tmp_path: Path):
    # issue 29 item 3: verdict.json said INCONCLUSIVE / "exit_code": 4 while `repro run` exited 2
    from repro.runner import RunOptions, run_prepared

    p = _prepared(tmp_path, "json.decoder:JSONDecodr.decode")
    with pytest.raises(UnresolvedSitesError):
        run_prepared(p, RunOptions(scenario_path=p.evidence.scenario.path, evidence_root=tmp_path / "evidence"))
    v = ev.read_json(p.evidence.verdict.path)
    assert v["verdict"] == "INCONCLUSIVE" and v["exit_code"] == 2, v
