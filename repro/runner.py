"""One run, end to end (DESIGN §1): scenario → plan → server → arm → burst → stall? → capture ×2 → verdict → evidence.

The runner wires the roles together and owns the life-cycle: the server tree is torn down on every outcome,
on Ctrl-C and on SIGTERM (the CLI turns SIGTERM into ``KeyboardInterrupt``), and the evidence folder is kept and
marked ``interrupted`` when the run does not finish. It renders nothing: progress goes to an optional observer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import psutil

from repro import evidence as ev
from repro.driver import BurstDriver, DriverState, make_prompts
from repro.scenario import Scenario, Variant, compile_plan, load_scenario, PLAN_ENV
from repro.verdict import (
    DEADLOCKED,
    INCONCLUSIVE,
    SUCCEEDED,
    InjectionCheck,
    StallJudgement,
    Verdict,
    exit_code_for,
    judge_completion,
    judge_stall,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
INJECTORS_DIR = REPO_ROOT / "injectors"
ARM_FILE_NAME = "ARM"
CONFIRM_GAP_S = 1.0  # seconds between the first capture and the confirming one
POLL_S = 0.2


class RunError(Exception):
    """A run could not be prepared (bad input); the message names the fix. Nothing was launched."""


@dataclass
class RunOptions:
    """What ``repro run`` was asked to do. ``None`` fields fall back to the scenario file."""

    scenario_path: Path
    variant: Optional[str] = None
    python: Optional[str] = None
    model: Optional[str] = None
    tp: Optional[int] = None
    label: Optional[str] = None
    evidence_root: Path = ev.DEFAULT_EVIDENCE_DIR
    requests: Optional[int] = None
    expect: Optional[str] = None
    native: bool = False
    command_line: str = ""
    pythonpath_prepend: Sequence[str] = ()
    extra_env: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RunResult:
    """The outcome: verdict, exit code (honouring ``--expect``), evidence folder and timings (seconds)."""

    verdict: Verdict
    exit_code: int
    evidence: Path
    expected: Optional[str]
    analysis: Any = None
    timings: dict = field(default_factory=dict)
    requests_ok: int = 0
    requests_total: int = 0


Observer = Callable[[str, dict], None]


def _noop(event: str, data: dict) -> None:
    pass


@dataclass
class Prepared:
    """Everything decided before launching: scenario, variant, evidence folder, plan, launch spec."""

    scenario: Scenario
    variant: Variant
    evidence: ev.EvidenceDir
    plan: dict
    spec: Any
    adapter: Any
    python: str
    on_testbed: bool
    arm_file: Path
    temp_dirs: list = field(default_factory=list)


def prepare(opts: RunOptions, *, label_default: Optional[str] = None) -> Prepared:
    """Validate inputs, create the evidence folder and compile the plan. Launches nothing.

    Raises:
        RunError: bad scenario/variant/override or interpreter (message names the fix).
    """
    from repro import testbed
    from repro.interpreter import InterpreterError, choose_python
    from repro.scenario import ScenarioError
    from repro.targets.base import LaunchSpec
    from repro.targets.sglang import SGLangAdapter

    try:
        scenario = load_scenario(opts.scenario_path)
        variant = scenario.variant(opts.variant)
    except ScenarioError as e:
        raise RunError(str(e)) from None
    if opts.tp is not None and opts.tp < 1:
        raise RunError(f"--tp must be ≥ 1 (got {opts.tp})")
    if opts.requests is not None and opts.requests < 1:
        raise RunError(f"--requests must be ≥ 1 (got {opts.requests})")
    try:
        python = choose_python(opts.python)
    except InterpreterError as e:
        raise RunError(str(e)) from None
    tb_python = testbed.testbed_python()
    on_testbed = tb_python is not None and Path(python).resolve() == Path(tb_python).resolve()
    model = opts.model or scenario.server.model or (str(testbed.tiny_model_dir()) if on_testbed else "")
    if not model:
        raise RunError(f"{opts.scenario_path}: server.model is empty and the interpreter is not the CPU testbed's; pass --model PATH")
    tp = opts.tp or scenario.server.tp_size

    ev_root = Path(opts.evidence_root)
    try:
        evd = ev.EvidenceDir(ev_root, scenario.name, opts.label or label_default or variant.name)
    except ev.EvidenceError as e:
        raise RunError(str(e)) from None
    arm_file = evd.path / ARM_FILE_NAME
    adapter = SGLangAdapter()
    plan = compile_plan(scenario, variant, evd.injector_dir, arm_file, tick_function=getattr(adapter, "tick_function", ""))
    evd.write_json("plan.json", plan)
    shutil.copyfile(opts.scenario_path, evd.file("scenario.toml"))

    args = list(scenario.server.args)
    env = dict(scenario.server.env)
    prepend = [str(INJECTORS_DIR), *opts.pythonpath_prepend]
    temp_dirs: list = []
    env.update(opts.extra_env)
    env[PLAN_ENV] = str(evd.file("plan.json").resolve())
    spec = LaunchSpec(python=python, model=model, tp_size=tp, port=0, nccl_port=0, args=args, env=env, pythonpath_prepend=prepend)
    if on_testbed:
        extra_args, extra_env, tb_prepend = adapter.testbed_profile(spec, args)
        spec = dataclasses.replace(
            spec, args=[*args, *extra_args], env={**env, **extra_env}, pythonpath_prepend=[*prepend, *tb_prepend]
        )
    return Prepared(scenario, variant, evd, plan, spec, adapter, python, on_testbed, arm_file, temp_dirs)


def write_arm_file(arm_file: Path, injection_ids: Sequence[str]) -> None:
    """Arm (ids non-empty) or disarm (empty) a running server's injector: one injection id per line, atomically."""
    ev.write_text_atomic(Path(arm_file), "".join(f"{i}\n" for i in injection_ids))


def _cpu_times(pids: dict[int, int]) -> dict[int, float]:
    out = {}
    for rank, pid in pids.items():
        try:
            t = psutil.Process(pid).cpu_times()
            out[rank] = t.user + t.system
        except psutil.Error:
            pass
    return out


def _versions(evd: ev.EvidenceDir, python: str) -> dict:
    from repro import injection_records

    info: dict[str, Any] = {
        "harness_python": sys.version.split()[0],
        "platform": platform.platform(),
        "target_python": python,
    }
    try:
        rep = injection_records.read_injector_dir(evd.injector_dir)
        for m in rep.markers:
            for key in ("python", "torch", "sglang"):
                val = getattr(m, key, None)
                if val and key not in info:
                    info[key] = val
    except Exception:
        pass
    py_spy = shutil.which("py-spy")
    info["py_spy"] = py_spy
    return info


def _injection_checks(evd: ev.EvidenceDir, variant: Variant, rank_pids: dict[int, int]) -> tuple[list[int], list[int], list[InjectionCheck], Any]:
    """Read the injector records: ranks loaded, ranks armed, per-injection counts by rank."""
    from repro import injection_records

    rep = injection_records.read_injector_dir(evd.injector_dir)
    ranks = sorted(rank_pids)
    loaded = rep.ranks_loaded(ranks)
    armed = rep.ranks_armed(ranks)
    checks = []
    for inj in variant.injections:
        c = rep.counts_by_rank(inj.id)
        site = rep.resolved_site(inj.id) or inj.site[0]
        checks.append(InjectionCheck(inj.id, site, c["entered"], c["matched"], c["fired"]))
    return loaded, armed, checks, rep


def run_prepared(p: Prepared, opts: RunOptions, observe: Observer = _noop) -> RunResult:
    """Launch, arm, drive, detect, capture, judge, write evidence, tear down. Never leaves the server running.

    Raises:
        KeyboardInterrupt: re-raised after teardown and after the evidence folder was marked ``interrupted``.
    """
    from repro.analysis import analyze
    from repro.capture import capture_ranks, frames_unchanged
    from repro.launcher import LaunchError, start_server

    evd, scenario, variant = p.evidence, p.scenario, p.variant
    burst = scenario.burst
    n_requests = opts.requests or burst.requests
    t0 = time.time()
    timings: dict[str, float] = {}
    evd.write_text("command.txt", (opts.command_line or "repro run " + str(opts.scenario_path)) + "\n")
    server = None
    driver: Optional[BurstDriver] = None
    verdict: Optional[Verdict] = None
    deciding: Any = None
    last_analysis: Any = None
    captures_taken = 0
    stall_history: list[dict] = []
    rank_pids: dict[int, int] = {}
    interrupted = False
    try:
        observe("launch", {"evidence": str(evd.path)})
        try:
            server = start_server(p.adapter, p.spec, evd.file("server.log"))
        except LaunchError as e:
            verdict = Verdict(INCONCLUSIVE, f"server failed to start: {e}")
            raise _Done()
        _save_procs(evd, server)
        observe("wait_healthy", {"url": server.url, "pid": server.pid})
        try:
            server.wait_healthy(scenario.server.startup_timeout_s)
        except LaunchError as e:
            verdict = Verdict(INCONCLUSIVE, f"server failed to start: {e}")
            raise _Done()
        timings["healthy_s"] = time.time() - t0
        rank_pids = server.rank_pids()
        _save_procs(evd, server)
        ranks = sorted(rank_pids)
        expected = list(range(p.spec.tp_size))
        if ranks != expected:
            verdict = Verdict(INCONCLUSIVE, f"expected scheduler ranks {expected}, found {ranks} among the server's processes")
            raise _Done()
        ids = [i.id for i in variant.injections]
        write_arm_file(p.arm_file, ids)
        observe("armed", {"injections": ids, "ranks": rank_pids})
        prompts = make_prompts(n_requests, burst.input_len, burst.seed)
        driver = BurstDriver(
            p.adapter, server.url, prompts, burst.max_new_tokens, burst.concurrency, evd.file("requests.jsonl"), burst.request_timeout_s
        )
        t_burst = time.time()
        driver.start()
        last_capture_t = 0.0
        while True:
            time.sleep(POLL_S)
            now = time.time()
            st = driver.state()
            observe("burst", {"state": st})
            if st.finished:
                break
            if not server.is_running():
                verdict = Verdict(INCONCLUSIVE, f"server died during the burst; log tail:\n{server.log_tail(20)}")
                break
            if now - t_burst > scenario.budget_s:
                why = stall_history[-1]["reason"] if stall_history else "requests still outstanding"
                verdict = Verdict(INCONCLUSIVE, f"budget of {scenario.budget_s:.0f} s ended without a verdict: {why}")
                break
            stalled = st.stalled_for(now)
            if stalled < scenario.stall_s or now - last_capture_t < scenario.stall_s:
                continue
            captures_taken += 1
            tag = f"-{captures_taken}"
            observe("capture", {"n": captures_taken, "stalled_s": stalled})
            cpu0, c0t = _cpu_times(rank_pids), time.time()
            first = capture_ranks(rank_pids, evd.stacks_dir, tag=tag, native=opts.native, injector_dir=evd.injector_dir,
                                  fallback_signal=p.plan["faulthandler_signal"])
            time.sleep(CONFIRM_GAP_S)
            second = capture_ranks(rank_pids, evd.stacks_dir, tag=tag + "b", native=opts.native, injector_dir=evd.injector_dir,
                                   fallback_signal=p.plan["faulthandler_signal"])
            cpu1, c1t = _cpu_times(rank_pids), time.time()
            cpu_pct = {k: 100.0 * (cpu1[k] - cpu0[k]) / max(1e-3, c1t - c0t) for k in cpu0 if k in cpu1}
            a1, a2 = analyze(first), analyze(second)
            last_analysis = a2
            unchanged = frames_unchanged(first, second)
            j: StallJudgement = judge_stall(a1, a2, unchanged, cpu_pct, expected)
            last_capture_t = time.time()
            stall_history.append(
                {"capture": captures_taken, "tag": tag, "stalled_s": round(stalled, 2), "deadlocked": j.deadlocked,
                 "reason": j.reason, "cpu_percent": {str(k): round(v, 1) for k, v in cpu_pct.items()}, "time": last_capture_t}
            )
            evd.write_json("stalls.json", stall_history)
            observe("judged", {"judgement": j, "analysis": a2})
            if j.deadlocked:
                deciding = a2
                timings["last_progress_to_verdict_s"] = time.time() - (st.last_progress_t or t_burst)
                verdict = Verdict(DEADLOCKED, j.reason)
                break
        timings["burst_s"] = time.time() - t_burst
        if verdict is None:
            time.sleep(0.5)  # let the injectors' counters reach disk (they flush every ~0.2 s)
            loaded, armed, checks, _ = _injection_checks(evd, variant, rank_pids)
            verdict = judge_completion(driver.state().requests, expected, loaded, armed, checks)
        else:
            _, _, checks, _ = _injection_checks(evd, variant, rank_pids)
            if verdict.verdict == INCONCLUSIVE and not any(sum(c.entered.values()) for c in checks) and checks:
                verdict = Verdict(verdict.verdict, verdict.reason + f"; note: site {checks[0].site} was never entered")
    except _Done:
        pass
    except KeyboardInterrupt:
        interrupted = True
        verdict = Verdict(INCONCLUSIVE, "interrupted by the user (Ctrl-C/SIGTERM) before a verdict; evidence is partial")
    finally:
        t_end = time.time()
        timings["to_verdict_s"] = t_end - t0
        try:
            if verdict is None:
                verdict = Verdict(INCONCLUSIVE, "internal error before a verdict (see errors in the console)")
            _finish_evidence(p, opts, verdict, deciding or last_analysis, driver, rank_pids, timings, interrupted)
        finally:
            if driver is not None:
                driver.abandon()
            if server is not None:
                observe("teardown", {})
                left = server.stop()
                evd.write_json("teardown.json", {"left_running": [getattr(x, "pid", x) for x in left], "time": time.time()})
            if driver is not None:
                driver.close(wait_s=2.0)
            for d in p.temp_dirs:
                shutil.rmtree(d, ignore_errors=True)
            timings["total_s"] = time.time() - t0
            evd.set_status("interrupted" if interrupted else "complete", timings=timings)
    if interrupted:
        raise KeyboardInterrupt
    st = driver.state() if driver else None
    return RunResult(
        verdict, exit_code_for(verdict.verdict, opts.expect), evd.path, opts.expect, deciding or last_analysis, timings,
        st.ok if st else 0, st.total if st else 0,
    )


class _Done(Exception):
    """Internal: leave the pipeline early with the verdict already set."""


def _save_procs(evd: ev.EvidenceDir, server: Any) -> None:
    from repro.procs import save_procs

    try:
        save_procs(evd.file("processes.json"), server.procs())
    except Exception:
        pass


def _finish_evidence(p: Prepared, opts: RunOptions, verdict: Verdict, analysis: Any, driver: Optional[BurstDriver],
                     rank_pids: dict[int, int], timings: dict, interrupted: bool) -> None:
    from repro.report import write_report

    evd = p.evidence
    if analysis is not None:
        evd.write_json("analysis.json", analysis.to_json())
    evd.write_json("env.json", _versions(evd, p.python))
    try:
        _, _, checks, rep = _injection_checks(evd, p.variant, rank_pids) if rank_pids else ([], [], [], None)
    except Exception:
        checks, rep = [], None
    write_report(p, opts, verdict, analysis, driver.state() if driver else None, rank_pids, checks, timings)
    expected_word = opts.expect
    evd.write_json(
        "verdict.json",
        {
            **verdict.to_json(),
            "scenario": p.scenario.name,
            "variant": p.variant.name,
            "variant_expects": p.variant.expect,
            "expect": expected_word,
            "exit_code": exit_code_for(verdict.verdict, expected_word),
            "partial": interrupted,
            "timings": {k: round(v, 3) for k, v in timings.items()},
            "rank_pids": {str(k): v for k, v in rank_pids.items()},
            "evidence": str(evd.path),
        },
    )


def run(opts: RunOptions, observe: Observer = _noop) -> RunResult:
    """Prepare and run a scenario variant; see ``run_prepared``.

    Raises:
        RunError: bad input, before anything was launched.
    """
    return run_prepared(prepare(opts), opts, observe)
