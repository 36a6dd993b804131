"""One run, end to end (docs/pipeline.md): scenario → plan → server → arm → burst → stall? → capture ×2 → verdict → evidence.

The runner wires the roles together and owns the life-cycle: the server tree is torn down on every outcome,
on Ctrl-C and on SIGTERM (the CLI turns SIGTERM into ``KeyboardInterrupt``), and the evidence folder is kept and
marked ``interrupted`` when the run does not finish. It renders nothing: progress goes to an optional observer.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from repro import evidence as ev
from repro import resources
from repro.detect import DetectContext, default_detectors
from repro import nemeses
from repro.driver import TOKEN_ID_RANGE, AbortPlan, BurstDriver, DriverState, make_prompts
from repro.scenario import Scenario, Variant, compile_plan, load_scenario, PLAN_ENV
from repro.verdict import (DEADLOCKED, EXIT_INTERNAL, EXIT_USAGE, INCONCLUSIVE, InjectionCheck, Verdict, exit_code_for,
                           interrupt_exit_code, judge_completion)

ARM_FILE_NAME = ev.Layout.ARM.name
POLL_S = 0.2
ARM_ACK_TIMEOUT_S = 10.0  # seconds to wait for every rank's injector to acknowledge a new arm file
ARM_ACK_POLL_S = 0.02


class RunError(Exception):
    """A run could not be prepared (bad input); the message names the fix. Nothing was launched."""


class UnresolvedSitesError(RunError):
    """A site of the plan resolves in no alternative in the server's sglang (found once it was healthy, before any
    burst; the server is torn down). The message names each site with the nearest names (``repro sites``)."""


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
    injector: Any = None  # the run's InjectorReport (repro.injection_records), read once; None when never read


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


def prepare(opts: RunOptions, *, label_default: Optional[str] = None, variants: Optional[Sequence[str]] = None) -> Prepared:
    """Validate inputs, check every site (:func:`repro.sites.check_before_launch`), create the evidence folder and
    compile the plan. Launches nothing. Every verb that launches a server passes here (run, serve, demo, compare,
    hunt, reproduce, PD stacks, ``--hosts``), so a site that cannot exist is refused before any folder or server.

    Args:
        variants: load the injections of all these variants into one plan (a session that drives them in turn);
            default: only ``opts.variant``. Injection ids must be unique across them.
    Raises:
        UnresolvedSitesError: an injection none of whose sites exists in the server's interpreter (a RunError).
        RunError: bad scenario/variant/override or interpreter (message names the fix).
    """
    d = _decide(opts, variants)
    scenario, variant, loaded, adapter, python, on_testbed, spec = d
    ev_root = Path(opts.evidence_root)
    try:
        evd = ev.EvidenceDir(ev_root, scenario.name, opts.label or label_default or variant.name)
    except ev.EvidenceError as e:
        _remove_owned(adapter, spec)
        raise RunError(str(e)) from None
    arm_file = evd.path / ARM_FILE_NAME
    plan = session_plan(adapter, scenario, loaded, evd.injector_dir, arm_file)
    evd.plan.write(plan)
    shutil.copyfile(opts.scenario_path, evd.scenario.path)
    spec = dataclasses.replace(spec, env={**spec.env, PLAN_ENV: str(evd.plan.path.resolve())})
    return Prepared(scenario, variant, evd, plan, spec, adapter, python, on_testbed, arm_file)


def check_launch(opts: RunOptions, variants: Optional[Sequence[str]] = None) -> None:
    """What :func:`prepare` checks (inputs, interpreter, every site), without writing anything: for a verb that
    runs several launches in turn (``compare``'s two sides, ``demo``'s two variants) to refuse before the first.

    Raises:
        UnresolvedSitesError, RunError: as :func:`prepare`.
    """
    d = _decide(opts, variants)
    _remove_owned(d[3], d[6])


def _decide(opts: RunOptions, variants: Optional[Sequence[str]]) -> tuple:
    """prepare's checks and the launch spec (without the plan's path): (scenario, variant, loaded variants, adapter,
    python, on_testbed, spec). Writes no evidence; the testbed profile may make a storage folder (``_remove_owned``)."""
    from repro.interpreter import InterpreterError, choose_python
    from repro.scenario import ScenarioError
    from repro.targets.base import LaunchSpec
    from repro.targets.registry import UnknownAdapterError, get_adapter

    try:
        scenario = load_scenario(opts.scenario_path)
        variant = scenario.variant(opts.variant if not variants else variants[0])
        # each variant once (a variant may be asked for several times: repeats on one server)
        loaded = [scenario.variant(v) for v in dict.fromkeys(variants)] if variants else [variant]
    except ScenarioError as e:
        raise RunError(str(e)) from None
    all_ids = [i.id for v in loaded for i in v.injections]
    dup = sorted({i for i in all_ids if all_ids.count(i) > 1})
    if dup:
        raise RunError(f"{opts.scenario_path}: injection id(s) {', '.join(dup)} appear in several of the variants "
                       f"{', '.join(v.name for v in loaded)}; give each injection its own id to run them on one server")
    if opts.tp is not None and opts.tp < 1:
        raise RunError(f"--tp must be ≥ 1 (got {opts.tp})")
    if opts.requests is not None and opts.requests < 1:
        raise RunError(f"--requests must be ≥ 1 (got {opts.requests})")
    tp = opts.tp or scenario.server.tp_size
    for v in loaded:
        if tp < 2 and v.expect == "deadlock":
            raise RunError(f"variant {v.name!r} expects a deadlock, but a collective desync needs at least 2 ranks "
                           f"(TP size {tp}); use --tp 2 or more")
        for inj in v.injections:
            bad = [k for k in inj.gate.ranks if inj.gate.rank_group is None and not 0 <= k < tp]
            if bad:
                raise RunError(f"{opts.scenario_path}: variants.{v.name}.injections.{inj.id}.gate.ranks lists rank(s) "
                               f"{bad}, outside the TP group of size {tp} (expected 0..{tp - 1})")
    try:
        adapter = get_adapter(scenario.server.adapter)
    except UnknownAdapterError as e:
        raise RunError(f"{opts.scenario_path}: server.adapter: {e}") from None
    try:
        python = choose_python(opts.python, adapter)
    except InterpreterError as e:
        raise RunError(str(e)) from None
    tb_python = adapter.testbed_python()
    on_testbed = tb_python is not None and Path(python).resolve() == Path(tb_python).resolve()
    tb_model = adapter.testbed_model() if on_testbed else None
    model = opts.model or scenario.server.model or (str(tb_model) if tb_model else "")
    if not model:
        raise RunError(f"{opts.scenario_path}: server.model is empty and the interpreter is not the CPU testbed's; pass --model PATH")
    if _looks_like_path(model) and not Path(model).expanduser().exists():
        src = "--model" if opts.model else f"{opts.scenario_path}: server.model"
        raise RunError(f"{src} {model}: no such folder; pass the path of a model folder (or a hub id like org/name)")

    args = list(scenario.server.args)
    env = dict(scenario.server.env)
    prepend = [str(resources.injectors_dir()), *opts.pythonpath_prepend]  # a clone's injectors/ or the wheel's copy
    env.update(opts.extra_env)
    spec = LaunchSpec(python=python, model=model, tp_size=tp, port=0, nccl_port=0, args=args, env=env, pythonpath_prepend=prepend)
    if on_testbed:
        extra_args, extra_env, tb_prepend = adapter.testbed_profile(spec, args)
        spec = dataclasses.replace(
            spec, args=[*args, *extra_args], env={**env, **extra_env}, pythonpath_prepend=[*prepend, *tb_prepend]
        )
    from repro.launcher import LaunchError, check_fork_ranks

    try:  # the fork-ranks opt-in off a CPU device: bad input, before any server exists (the launcher checks again)
        check_fork_ranks({**os.environ, **spec.env}, spec.args)
    except LaunchError as e:
        _remove_owned(adapter, spec)
        raise RunError(str(e)) from None
    # every injection must have a site that can exist in the server's interpreter, on the server's PYTHONPATH,
    # before any folder or server exists (issue 29 item 3): the resolver `repro sites` runs, reading sources only;
    # what it cannot decide, Session.start's check decides once the server's injector has patched it
    from repro.sites import SitesUnresolved, check_before_launch

    try:
        check_before_launch(scenario, opts.scenario_path, [v.name for v in loaded], python,
                            env=adapter.launch_env(spec, dict(os.environ)), adapter=adapter)
    except SitesUnresolved as e:
        _remove_owned(adapter, spec)
        raise UnresolvedSitesError(str(e)) from None
    return scenario, variant, loaded, adapter, python, on_testbed, spec


def _remove_owned(adapter: Any, spec: Any) -> None:
    """Remove the folders a launch spec made for its server (the testbed's HiCache storage) when it never launches."""
    try:
        for d in adapter.owned_dirs(spec.env):
            shutil.rmtree(d, ignore_errors=True)
    except Exception:
        pass


def engine_plan(adapter: Any) -> dict[str, str]:
    """The plan's ``engine``: the adapter's name, its importable package and the distribution whose version the
    injector records (``ref_location.version_key``, else the package)."""
    lc = adapter.ref_location
    return {"name": adapter.name, "package": lc.package, "distribution": lc.version_key or lc.package}


def session_plan(adapter: Any, scenario: Scenario, variants: Sequence[Variant], injector_dir: Path, arm_file: Path) -> dict:
    """The plan of a session that loads ``variants``' injections (all of them; armed one variant at a time).

    The engine's part comes from the adapter: the ledger's tick function is ``adapter.tick_function_for`` the
    server's args (a ``--disaggregation-mode prefill`` server counts ticks with its own loop's function) and
    ``adapter.injector_profile`` (coordinator classes, alias and communication-module prefixes) goes into the
    plan's ``ledger`` for the injector (which never imports the harness), its fork-ranks caller into ``fork_ranks``.
    """
    plan = compile_plan(scenario, variants[0], injector_dir, arm_file,
                        tick_function=adapter.tick_function_for(scenario.server.args),
                        injector_profile=adapter.injector_profile.to_plan(),
                        state_probes=adapter.state_probe_plan(),
                        fork_ranks=adapter.injector_profile.fork_plan(),
                        engine=engine_plan(adapter))
    for extra in variants[1:]:
        plan["injections"] += compile_plan(scenario, extra, injector_dir, arm_file)["injections"]
    plan["variant"] = ",".join(v.name for v in variants)
    return plan


def _looks_like_path(model: str) -> bool:
    """A model given as a filesystem path (absolute, ./, ../, ~), as opposed to a hub id like ``org/name``."""
    return model.startswith(("/", "./", "../", "~")) or model in (".", "..")


def write_arm_file(arm_file: Path, injection_ids: Sequence[str]) -> None:
    """Arm (ids non-empty) or disarm (empty) a running server's injector: one injection id per line, atomically.

    Every write replaces the file (new inode), so writing the same ids again re-arms: occurrence counters restart.
    """
    head = f"# written by repro at {time.time():.3f}\n"
    ev.write_text_atomic(Path(arm_file), head + "".join(f"{i}\n" for i in injection_ids))


def fire_log_offsets(injector_dir: Path, pids: Sequence[int]) -> dict[int, int]:
    """Current size in bytes of each pid's ``fires-<pid>.jsonl`` (0 when absent): where :func:`wait_armed` starts."""
    out: dict[int, int] = {}
    for pid in pids:
        try:
            out[int(pid)] = (Path(injector_dir) / ev.Layout.fire_log(pid)).stat().st_size
        except OSError:
            out[int(pid)] = 0
    return out


def wait_armed(injector_dir: Path, offsets: dict[int, int], arm_file: Path, timeout_s: float = ARM_ACK_TIMEOUT_S) -> list[int]:
    """Block until every pid in ``offsets`` logged an ``armed`` event for the arm file as it is now.

    The injector of each rank polls the arm file on its own (every ``arm_poll_s``, 0.1 s by default), so right
    after :func:`write_arm_file` the ranks are armed at different moments; a burst sent at once can reach one rank's
    gated call site before that rank is armed and the next one after, on a later scheduler tick, with other state
    (measured in a hunt: rank 1 armed 85 ms after the burst started and fired two ticks late). Each rank's
    ``armed`` event names the arm file's mtime it read (``arm_file_mtime``), matched here to the file's current
    st_mtime_ns.

    Args:
        injector_dir: the evidence's injector folder (``fires-<pid>.jsonl``).
        offsets: pid -> byte offset to read from (from :func:`fire_log_offsets`, taken before writing the arm file).
        arm_file: the arm file just written.
        timeout_s: seconds to wait at most.
    Returns:
        The pids that did not acknowledge within ``timeout_s`` (empty when all did), sorted.
    """
    from repro.injection_records import read_fire_log

    try:
        want = Path(arm_file).stat().st_mtime_ns / 1e9
    except OSError:
        return sorted(offsets)
    pending = dict(offsets)
    deadline = time.monotonic() + timeout_s
    while True:
        for pid in list(pending):
            # complete lines only: an incomplete last line waits for the rest
            events, pending[pid] = read_fire_log(Path(injector_dir) / ev.Layout.fire_log(pid), pending[pid])
            if any(e.get("event") == "armed" and abs(float(e.get("arm_file_mtime") or 0) - want) < 1e-6 for e in events):
                del pending[pid]
        if not pending or time.monotonic() >= deadline:
            return sorted(pending)
        time.sleep(ARM_ACK_POLL_S)


def arm_and_wait(arm_file: Path, ids: Sequence[str], injector_dir: Optional[Path], rank_pids: dict[int, int],
                 timeout_s: float = ARM_ACK_TIMEOUT_S) -> list[int]:
    """Write the arm file (:func:`write_arm_file`) and, when arming, wait for every rank's acknowledgement
    (:func:`wait_armed`).

    Args:
        ids: injection ids (empty: disarm, nothing to wait for).
        injector_dir: the injector folder holding ``fires-<pid>.jsonl`` (None: do not wait).
        rank_pids: rank -> pid of the ranks to wait for (empty: do not wait).
    Returns:
        The ranks that did not acknowledge within ``timeout_s`` seconds, sorted (empty when all did or no wait).
    """
    offsets = fire_log_offsets(injector_dir, list(rank_pids.values())) if injector_dir and rank_pids else {}
    write_arm_file(arm_file, ids)
    late = wait_armed(injector_dir, offsets, arm_file, timeout_s) if ids and offsets else []
    by_pid = {v: k for k, v in rank_pids.items()}
    return sorted(by_pid.get(x, x) for x in late)


def collect_versions(injector_dir: Any, python: str, adapter: Any) -> dict:
    """Versions for env.json: harness Python, platform, target interpreter, the run's engine (``engine``: the adapter's
    name) and the python/torch/engine versions the injector's loaded markers recorded inside the server (the harness
    never imports the engine), plus py-spy's path. The engine's version is ``engine_version`` and, for readers of
    older folders, also under the adapter's ``ref_location.version_key`` (SGLang: ``sglang``).

    Args:
        injector_dir: the injector folder, or the ``InjectorReport`` already read from it (not read again).
        python: the server's interpreter.
        adapter: the run's adapter.
    """
    from repro import injection_records

    info: dict[str, Any] = {
        "harness_python": sys.version.split()[0],
        "platform": platform.platform(),
        "target_python": python,
        "engine": adapter.name,
    }
    key = adapter.ref_location.version_key or adapter.ref_location.package
    try:
        rep = injector_dir if isinstance(injector_dir, injection_records.InjectorReport) else \
            injection_records.read_injector_dir(injector_dir)
        for m in rep.markers:
            for k, val in (("python", m.python), ("torch", m.torch), ("engine_version", m.version_of(key))):
                if val and k not in info:
                    info[k] = val
    except Exception:
        pass
    if info.get("engine_version") and key:
        info[key] = info["engine_version"]
    py_spy = shutil.which("py-spy")
    info["py_spy"] = py_spy
    from repro.releases import describe_python

    how = describe_python(python) if python else None
    if how:  # a recipe-made release testbed: which release, and whether its own venv or an overlay ran
        info["testbed"] = how
    return info


def injection_checks(injector_dir: Any, variant: Variant, rank_pids: dict[int, int]) -> tuple[list[int], list[int], list[InjectionCheck], Any]:
    """Read the injector records: ranks loaded, ranks armed, per-injection counts by rank (after the last arming).

    ``injector_dir``: the injector folder, or the ``InjectorReport`` already read from it (not read again).
    Returns ``(loaded, armed, checks, report)``."""
    from repro import injection_records

    rep = injector_dir if isinstance(injector_dir, injection_records.InjectorReport) else \
        injection_records.read_injector_dir(injector_dir)
    ranks = sorted(rank_pids)
    loaded = rep.ranks_loaded(ranks)
    armed = rep.ranks_armed(ranks)
    checks = []
    for inj in variant.injections:
        c = rep.counts_by_rank(inj.id)
        site = rep.resolved_site(inj.id) or inj.site[0]
        checks.append(InjectionCheck(inj.id, site, c["entered"], c["matched"], c["fired"], rep.absent_detail(inj.id),
                                     getattr(inj, "required", True)))
    return loaded, armed, checks, rep


@dataclass
class Outcome:
    """What driving one variant on a live server produced (before evidence is written)."""

    verdict: Verdict
    analysis: Any = None
    state: Optional[DriverState] = None
    timings: dict = field(default_factory=dict)
    clean: bool = True  # the server is still usable for another variant (no hang, no crash, nothing outstanding)
    injector: Any = None  # the InjectorReport read when judging (repro.injection_records), passed on, not re-read
    ledger: Any = None  # the LedgerDiagnosis finish_evidence aligned (repro.ledger), for callers after it
    exit_code: Optional[int] = None  # the process's exit code when it is not the verdict's (a refusal: 2, an
    # interrupt: 130/143, an internal error: 1); read through outcome_exit_code, by verdict.json and the RunResult
    topology: Any = None  # the session that drove it (a RunEvidence): it writes the run folder; None: a single server's
    report_sections: tuple = ()  # markdown lines REPORT.md ends with (repro.pd: its "Servers" section)
    verdict_fields: dict = field(default_factory=dict)  # more fields of verdict.json (repro.pd: servers, diverged_server)



def outcome_exit_code(outcome: "Outcome", expect: Optional[str]) -> int:
    """THE exit code of a run: ``outcome.exit_code`` when the run did not end in a verdict of its own (refused,
    interrupted, internal error), else the verdict's (:func:`repro.verdict.exit_code_for`, honouring ``expect``).
    verdict.json's ``exit_code`` and the RunResult's (what the CLI exits with) are both this value."""
    return outcome.exit_code if outcome.exit_code is not None else exit_code_for(outcome.verdict.verdict, expect)


class RunEvidence:
    """How a topology writes one run folder (:func:`finish_evidence`): a single server's, by default.

    A topology whose ranks or records live elsewhere overrides the parts that differ — where the ledgers are
    aligned from, which injector records the checks and versions read, what verdict.json gains, the command line
    the report shows (``repro.remote_run.MultiHostSession``) — or the whole folder (``repro.pd``: one folder per
    server plus the run's). Every session is one (:class:`Session`); :data:`SINGLE_SERVER` is the default.
    """

    def write_evidence(self, p: "Prepared", opts: RunOptions, variant: Variant, evd: ev.EvidenceDir, outcome: "Outcome",
                       rank_pids: dict[int, int], interrupted: bool) -> None:
        """Write analysis.json, ledger.json + timeline.svg, env.json, REPORT.md and, last and atomically,
        verdict.json into ``evd`` (see :func:`finish_evidence`)."""
        import shlex

        from repro.report import ReportInput, write_report

        verdict, analysis = outcome.verdict, outcome.analysis
        if analysis is not None:
            evd.analysis.write(analysis.to_dict())
        ledger_diag = outcome.ledger = self.ledger_evidence(evd, rank_pids)
        checks = self.evidence_checks(p, variant, outcome, rank_pids)
        versions = self.evidence_versions(p, outcome)
        evd.env.write(versions)
        write_report(evd, ReportInput(
            scenario=p.scenario.name, mirrors=p.scenario.mirrors or "", description=p.scenario.description or "",
            variant=variant.name, variant_expects=variant.expect, variant_description=variant.description or "",
            has_injections=bool(variant.injections), verdict=verdict, analysis=analysis, requests=outcome.state,
            ranks=sorted(rank_pids) or list(range(p.spec.tp_size)), checks=checks, timings=dict(outcome.timings),
            versions=versions, ledger=ledger_diag, timeline=ev.Layout.TIMELINE.name if evd.timeline.exists() else None,
            stacks_dir=evd.stacks_dir, sections=tuple(outcome.report_sections),
            command=opts.command_line or f"{self.command_prefix()} {shlex.quote(str(opts.scenario_path))} --variant {variant.name}"))
        evd.verdict.write(ev.verdict_record(
            verdict, exit_code=outcome_exit_code(outcome, opts.expect),
            evidence=evd.path, scenario=p.scenario.name,
            variant=variant.name, variant_expects=variant.expect, expect=opts.expect, partial=interrupted,
            timings=outcome.timings, rank_pids=rank_pids,
            state_divergence=ledger_diag.state.to_dict() if ledger_diag is not None and ledger_diag.state is not None else None,
            **self.verdict_fields(), **outcome.verdict_fields))

    # ---- the parts a topology may override ---------------------------------------------------------------------
    def ledger_evidence(self, evd: ev.EvidenceDir, rank_pids: dict[int, int]) -> Any:
        """The LedgerDiagnosis of the run (``ledger.json`` + ``timeline.svg`` written), or None."""
        return _ledger_evidence(evd, rank_pids)

    def evidence_checks(self, p: "Prepared", variant: Variant, outcome: "Outcome", rank_pids: dict[int, int]) -> list:
        """The per-injection checks the report shows; sets ``outcome.injector`` when it reads the records."""
        from repro import injection_records

        if outcome.injector is None and rank_pids:
            try:
                outcome.injector = injection_records.read_injector_dir(p.evidence.injector_dir)
            except Exception:
                outcome.injector = None
        if rank_pids and outcome.injector is not None:
            try:
                return injection_checks(outcome.injector, variant, rank_pids)[2]
            except Exception:
                return []
        return []

    def evidence_versions(self, p: "Prepared", outcome: "Outcome") -> dict:
        """env.json (:func:`collect_versions`)."""
        return collect_versions(outcome.injector or p.evidence.injector_dir, p.python, p.adapter)

    def verdict_fields(self) -> dict:
        """Extra fields of verdict.json (``repro.evidence.verdict_record`` keywords)."""
        return {}

    def command_prefix(self) -> str:
        """The command the report names when the run was not started from a command line."""
        return "repro run"


SINGLE_SERVER = RunEvidence()


# Seconds stop() waits after SIGTERM before SIGKILL once a burst left the tree wedged (Session.wedged): a rank blocked
# in a gloo/NCCL collective never returns to the interpreter to run its handler, so waiting longer only delays the
# next run (docs: benchmarks/RESULTS.md, "Teardown of a wedged tree").
WEDGED_STOP_GRACE_S = 0.5

class Session(RunEvidence):
    """One launched server with the injector loaded for a plan (one or more variants' injections), unarmed.

    ``start`` launches and waits for health; ``drive`` arms one variant's injections, sends the burst, detects and
    judges, then disarms; ``stop`` ends the whole tree. A session can drive several variants in turn (tests that do
    not hang a server, ``hunt``); after a hang or a crash it must be restarted (``restart``).

    Args:
        p: the prepared run (its evidence folder holds the server log, process list and injector records).
        observe: progress callback ``(event, data)``.
        detectors: the detect stage (``repro.detect``); default :func:`repro.detect.default_detectors` per drive.
    """

    def __init__(self, p: Prepared, observe: Observer = _noop, detectors: Optional[Sequence[Any]] = None) -> None:
        self.p = p
        self.observe = observe
        self.detectors = list(detectors) if detectors is not None else None  # None: repro.detect.default_detectors
        self.server: Any = None
        self.rank_pids: dict[int, int] = {}
        self.healthy_s: Optional[float] = None
        self.interrupted_in_teardown = False
        self._launched_t: Optional[float] = None  # launch() started the server; start() waits for it
        # seconds stop() lets the tree exit after SIGTERM before SIGKILL (repro hunt: 1 s — sglang's parent sleeps 5 s
        # after a child died before it exits, and a hunt's servers have nothing to drain)
        self.stop_grace_s = 10.0
        # set by drive() when a burst ended with the tree wedged (a deadlock, a desync, a dead rank): stop() then
        # SIGKILLs after WEDGED_STOP_GRACE_S — a rank blocked in a collective never runs its SIGTERM handler, and the
        # evidence is already written (issue 36: the tree is gone within 2 s of verdict.json)
        self.wedged = False

    def start(self) -> Optional[Verdict]:
        """Launch and wait healthy (a port taken during start-up is retried on new ports), record the tree, map the
        ranks, check every site resolved. Used by run, demo, serve, compare, hunt and the tests.

        Events: ``launch``, ``wait_healthy`` (url, pid, log, timeout_s), ``still_starting`` (waited_s, last_line,
        every ~15 s), ``relaunch``, ``healthy`` (waited_s).

        Returns:
            None when healthy, else the INCONCLUSIVE verdict saying why (the server may still run: call ``stop``).
        Raises:
            UnresolvedSitesError: an injection's site does not resolve in the server's engine.
        """
        from repro.launcher import LaunchError, start_server

        p, t0 = self.p, time.time()
        launched_t, self._launched_t = self._launched_t, None  # set by launch(): the server is already starting
        if launched_t is None or self.server is None:
            write_arm_file(p.arm_file, [])
            self.observe("launch", {"evidence": str(p.evidence.path)})
        else:
            t0 = launched_t
        for attempt in range(1, PORT_RACE_ATTEMPTS + 1):
            if attempt > 1 or launched_t is None or self.server is None:
                try:
                    self.server = start_server(p.adapter, p.spec, p.evidence.server_log.path)
                except LaunchError as e:
                    return Verdict(INCONCLUSIVE, f"server failed to start: {e}")
                save_server_procs(p.evidence, self.server)
            self.observe("wait_healthy", {"url": self.server.url, "pid": self.server.pid,
                                          "log": str(p.evidence.server_log.path),
                                          "timeout_s": p.scenario.server.startup_timeout_s})
            try:
                waited = self.server.wait_healthy(
                    p.scenario.server.startup_timeout_s,
                    progress=lambda w, line: self.observe("still_starting", {"waited_s": w, "last_line": line}))
                self.observe("healthy", {"waited_s": waited})
                break
            except LaunchError as e:
                raced = _lost_port_race(e, self.server) and p.spec.port == 0 and p.spec.nccl_port == 0
                self.server.stop()
                self.server = None
                if not raced or attempt == PORT_RACE_ATTEMPTS:
                    return Verdict(INCONCLUSIVE, f"server failed to start: {e}")
                # A free port picked at launch was taken before the server bound it (gloo's ephemeral ports, another
                # server starting): start again on new ports; the log keeps both attempts.
                self.observe("relaunch", {"attempt": attempt + 1, "why": "port taken during start-up (EADDRINUSE)"})
        self.healthy_s = time.time() - t0
        self.rank_pids = self.server.rank_pids()
        save_server_procs(p.evidence, self.server)
        expected = list(range(p.spec.tp_size))
        if sorted(self.rank_pids) != expected:
            return Verdict(INCONCLUSIVE, f"expected scheduler ranks {expected}, found {sorted(self.rank_pids)} among the server's processes")
        self._check_sites()
        return None

    def _check_sites(self) -> None:
        """Before any burst: every injection of the plan must resolve in the server's sglang (the injector's own
        records; the resolver only when one is not patched yet). Raises UnresolvedSitesError naming the nearest names."""
        from repro.sites import SitesUnresolved, check_launched_sites

        p = self.p
        if getattr(self, "_sites_ok", False):
            return  # checked once for this plan (a restart after a hang loads the same sites)
        try:
            check_launched_sites(p.scenario, str(p.plan.get("variant") or p.variant.name).split(","),
                                 p.evidence.injector_dir, p.python, env=getattr(self.server, "env", None),
                                 adapter=p.adapter)
        except SitesUnresolved as e:
            raise UnresolvedSitesError(str(e)) from None
        self._sites_ok = True

    def launch(self) -> Optional[Verdict]:
        """Start the server's processes and return at once, without waiting for health (``repro hunt``'s spare
        server, started while another server serves trials); the next :meth:`start` waits for this one instead of
        launching again (``healthy_s`` then counts from this launch). Event: ``launch``.

        Returns:
            None when the processes started, else the INCONCLUSIVE verdict saying why (nothing left running).
        """
        from repro.launcher import LaunchError, start_server

        p = self.p
        write_arm_file(p.arm_file, [])
        self.observe("launch", {"evidence": str(p.evidence.path), "spare": True})
        try:
            self.server = start_server(p.adapter, p.spec, p.evidence.server_log.path)
        except LaunchError as e:
            return Verdict(INCONCLUSIVE, f"server failed to start: {e}")
        self._launched_t = time.time()
        save_server_procs(p.evidence, self.server)
        return None

    def stop(self) -> list:
        """End the whole server tree (idempotent); records what was left in ``teardown.json``."""
        self._launched_t = None
        if self.server is None:
            return []
        grace = min(self.stop_grace_s, WEDGED_STOP_GRACE_S) if self.wedged else self.stop_grace_s
        self.observe("teardown", {"grace_s": grace})
        t0 = time.time()
        try:
            left = self.server.stop(grace_s=grace)
        except KeyboardInterrupt as e:
            # Ctrl-C/SIGTERM arrived during the teardown itself: finish it (the CLI ignores further signals now),
            # then let the caller report the interruption.
            left = self.server.stop(grace_s=grace)
            self.interrupted_in_teardown = True
            self.teardown_exit_code = interrupt_exit_code(e)
        self.p.evidence.teardown.write({"left_running": [getattr(x, "pid", x) for x in left], "time": time.time(),
                                        "grace_s": grace, "wedged": self.wedged, "stop_s": round(time.time() - t0, 3)})
        self.server = None
        self.wedged = False
        return left

    def restart(self) -> Optional[Verdict]:
        """Stop and start again (after a hang or a crash)."""
        self.stop()
        return self.start()

    # ---- what drive() does per server (repro.pd.PDSession overrides these for a stack of several servers) ------
    def arm(self, ids: Sequence[str]) -> list:
        """Write the arm file with ``ids`` and wait for every rank's acknowledgement; returns the ranks that did not
        acknowledge within ``ARM_ACK_TIMEOUT_S``."""
        return arm_and_wait(self.p.arm_file, ids, self.p.evidence.injector_dir, self.rank_pids)

    def disarm(self) -> None:
        """Empty the arm file (every injection off)."""
        write_arm_file(self.p.arm_file, [])

    def armed_ranks(self) -> Any:
        """What the ``armed`` event names as the ranks (rank → pid)."""
        return self.rank_pids

    def make_detectors(self) -> list:
        """The detect stage of one drive (``repro.detect``): the session's, else :func:`repro.detect.default_detectors`."""
        return list(self.detectors) if self.detectors is not None else default_detectors(self.p.plan)

    def detect_context(self, run_dir: ev.EvidenceDir, native: bool) -> DetectContext:
        """The detectors' view of this server for one drive."""
        p = self.p
        return DetectContext(self.rank_pids, list(range(p.spec.tp_size)), run_dir, p.evidence.injector_dir, p.plan,
                             p.scenario.stall_s, native=native, observe=self.observe,
                             server_log=getattr(self.server, "log_path", None))

    def down_detectors(self, detectors: Sequence[Any]) -> list:
        """The detectors polled once more when the server is found not running during the burst, before
        :meth:`died_reason` is the verdict (a single server: none; its rank death still names a dead rank after
        the burst, ``final_verdict``)."""
        return []

    def snapshot(self, p: Prepared, run_dir: ev.EvidenceDir) -> None:
        """Copy what the session holds of a driven variant into its run folder (:func:`snapshot_session`)."""
        snapshot_session(p, run_dir)

    def died_reason(self) -> str:
        """The INCONCLUSIVE reason when the server is not running during the burst."""
        return f"server died during the burst; log tail:\n{self.server.log_tail(20)}"

    def judge_burst(self, variant: Variant, verdict: Optional[Verdict], state: DriverState, ctx: DetectContext,
                    detectors: Sequence[Any]) -> tuple[Verdict, Any]:
        """The verdict after the burst loop: ``verdict`` when a detector decided (or the server died / the budget
        ended), else the completion rule on the injector's records. Returns (verdict, the InjectorReport read or None)."""
        if verdict is not None:
            return verdict, None
        time.sleep(0.5)  # let the injectors' counters reach disk (they flush every ~0.2 s)
        loaded, armed, checks, injector = injection_checks(self.p.evidence.injector_dir, variant, self.rank_pids)
        return judge_completion(state.requests, ctx.expected_ranks, loaded, armed, checks), injector

    def finish_outcome(self, out: Outcome, detectors: Sequence[Any]) -> Outcome:
        """The drive's Outcome, as callers get it (PD: with each server's verdict attached)."""
        return out

    def drive(self, variant: Variant, run_dir: ev.EvidenceDir, n_requests: Optional[int] = None, native: bool = False) -> Outcome:
        """Arm ``variant``'s injections, send the burst, watch for a stall, capture and judge, disarm.

        THE burst/detect loop of a session, single server or a stack of several (:mod:`repro.pd` overrides the
        per-server steps above: arming, detectors, judging, disarming).

        Args:
            variant: one of the variants whose injections are in this session's plan.
            run_dir: where this variant's requests.jsonl, stacks/ and stalls.json go.
            n_requests: override of the burst's request count.
            native: py-spy ``--native``.
        Returns:
            The Outcome; ``clean`` is False after a deadlock, a crash, or requests left outstanding.
        Raises:
            KeyboardInterrupt: passed through (the caller tears down); the driver is abandoned first.
        """
        p, server = self.p, self.server
        scenario, burst = p.scenario, p.scenario.burst
        timings: dict[str, float] = {}
        ids = [i.id for i in variant.injections]
        t_arm = time.time()
        # every rank armed before the first request: otherwise a rank that polls late meets its call site a tick late
        late = self.arm(ids)
        timings["arm_ack_s"] = time.time() - t_arm
        if late:
            self.observe("arm_not_acknowledged", {"ranks": late, "timeout_s": ARM_ACK_TIMEOUT_S})
        self.observe("armed", {"injections": ids, "ranks": self.armed_ranks()})
        workload = getattr(variant, "workload", None) or getattr(burst, "workload", None)  # repro.nemeses
        n_req, concurrency, input_len, max_new = nemeses.effective_sizes(burst, workload)
        prompts = (make_prompts(n_requests or n_req, input_len, burst.seed) if workload is None else
                   nemeses.make_prompts_for(nemeses.request_plans(n_requests or n_req, input_len, max_new, workload),
                                            burst.seed, TOKEN_ID_RANGE))
        driver = BurstDriver(p.adapter, server.url, prompts, max_new, concurrency,
                             run_dir.requests.path, burst.request_timeout_s,
                             abort=AbortPlan.from_spec(getattr(variant, "abort", None) or getattr(burst, "abort", None)),  # the mass-abort action
                             workload=workload)
        verdict: Optional[Verdict] = None
        deciding = last_analysis = None
        last_reason = ""
        stall_history: list[dict] = []
        detectors = self.make_detectors()
        ctx = self.detect_context(run_dir, native)

        def take(det: Any, st: DriverState) -> bool:
            """Keep a detector's word (records and evidence written); True when it decided the verdict."""
            nonlocal verdict, deciding, last_analysis, last_reason
            if det is None:
                return False
            if det.analysis is not None:
                last_analysis = det.analysis
            if det.reason:
                last_reason = det.reason
            if det.record is not None:
                stall_history.append({**det.record, "detector": det.detector} if det.detector != "stall" else det.record)
                run_dir.stalls.write(stall_history)
            for member, obj in det.evidence.items():
                run_dir.member(member).write(obj)
            if det.decided and det.verdict is not None:
                deciding = det.analysis
                timings["last_progress_to_verdict_s"] = time.time() - (st.last_progress_t or t_burst)
                verdict = det.verdict
                return True
            return False

        t_burst = time.time()
        ctx.t_burst = t_burst
        for d in detectors:
            d.start(ctx)
        driver.start()
        self.observe("burst_started", {"url": server.url, "requests": len(prompts)})
        try:
            while True:
                time.sleep(POLL_S)
                now = time.time()
                st = driver.state()
                self.observe("burst", {"state": st})
                if st.finished:
                    break
                ctx.state, ctx.now = st, now
                if not server.is_running():
                    # the topology's last look first (a server spanning hosts: the rank that died is the cause)
                    for d in self.down_detectors(detectors):
                        if take(d.poll(ctx), st):
                            break
                    if verdict is None:
                        verdict = Verdict(INCONCLUSIVE, self.died_reason())
                    break
                if now - t_burst > scenario.budget_s:
                    why = last_reason or st.waiting_for()
                    verdict = Verdict(INCONCLUSIVE, f"budget of {scenario.budget_s:.0f} s ended without a verdict: {why}")
                    break
                for d in detectors:
                    if take(d.poll(ctx), st):
                        break
                if verdict is not None:
                    break
        except BaseException:
            driver.abandon()
            self.interrupted_state = driver.state()  # what was sent so far: the report of an interrupted run says it
            self._open_drivers = getattr(self, "_open_drivers", []) + [driver]
            raise
        finally:
            for d in detectors:
                try:
                    d.stop(ctx)
                except Exception:
                    pass
        captures = sum(getattr(d, "captures", 0) for d in detectors)
        timings["burst_s"] = time.time() - t_burst
        timings["captures"] = float(captures)
        verdict, injector = self.judge_burst(variant, verdict, driver.state(), ctx, detectors)
        for d in detectors:  # the ledgers' word after the burst (repro.proof: DESYNCED, stated fallbacks) + timings
            if callable(getattr(d, "final_verdict", None)):
                verdict = d.final_verdict(verdict, ctx)
            timings.update(getattr(d, "timings", None) or {})
        self.disarm()
        final = driver.state()
        clean = (final.finished and verdict.verdict != DEADLOCKED and server.is_running()
                 and not any(getattr(d, "deaths", None) for d in detectors))  # a dead rank: restart first
        self.wedged = not clean
        driver.abandon()
        if clean:
            driver.close(wait_s=0.5)
        else:
            self._open_drivers = getattr(self, "_open_drivers", []) + [driver]
        return self.finish_outcome(Outcome(verdict, deciding or last_analysis, final, timings, clean, injector,
                                           topology=self), detectors)

    def close_drivers(self) -> None:
        """Close the history files of drivers whose requests were still outstanding (after the server stopped)."""
        for d in getattr(self, "_open_drivers", []):
            d.close(wait_s=2.0)
        self._open_drivers = []


def make_session(p: Prepared, observe: Observer = _noop, detectors: Optional[Sequence[Any]] = None,
                 hosts: Sequence[Any] = ()) -> "Session":
    """The session for ``p`` — THE place a topology is chosen: a :class:`Session` (one server here), for a
    multi-server topology (``server.topology`` other than ``single``, e.g. PD disaggregation) ``repro.pd``'s
    session over the whole stack, and with ``hosts`` (``repro.hosts.HostSpec``, one per node) the session of a
    server spanning those hosts (``repro.remote_run.MultiHostSession``). Every one is driven by
    :meth:`Session.drive` and :func:`run_variants`, and writes its folder as a :class:`RunEvidence`."""
    from repro import pd

    if hosts:
        from repro.remote_run import MultiHostSession

        return MultiHostSession(p, hosts, observe)
    if pd.is_multi(p):
        return pd.make_session_class()(p, observe, detectors)
    return Session(p, observe, detectors)


def run_prepared(p: Prepared, opts: RunOptions, observe: Observer = _noop, session: Any = None) -> RunResult:
    """Launch, arm, drive, detect, capture, judge, write evidence, tear down. Never leaves the server running.

    Args:
        session: the session to drive (:func:`make_session`'s for ``p`` when None).
    Raises:
        KeyboardInterrupt: re-raised after teardown and after the evidence folder was marked ``interrupted``.
    """
    return _result(run_one(p, opts, observe, session), opts.expect, p.evidence.path)


def run_one(p: Prepared, opts: RunOptions, observe: Observer = _noop, session: Any = None, *,
            finish: Optional[Callable[..., None]] = None, on_healthy: Optional[Callable[[], None]] = None) -> Outcome:
    """THE one-variant loop (``repro run``, ``--hosts`` runs, the hunt's quiet baseline): start ``session``, drive
    ``p.variant`` into ``p.evidence`` itself, write its evidence (``finish``, default :func:`finish_evidence`:
    verdict.json, REPORT.md, ...), stop the session, mark the folder ``complete`` (or ``interrupted``).

    Args:
        session: the session to drive (:func:`make_session`'s for ``p`` when None).
        finish: writes the evidence, with :func:`finish_evidence`'s arguments (a stand-in runner's in tests).
        on_healthy: called once the server is healthy, just before the variant is driven (never when the start
            failed): the hunt's baseline takes the time its burst began from it.
    Returns:
        The Outcome (its ``timings`` gain ``healthy_s``, ``to_verdict_s`` and ``total_s``, seconds).
    Raises:
        UnresolvedSitesError: after its verdict (exit code 2) was written and the session stopped.
        KeyboardInterrupt: re-raised after teardown and after the evidence folder was marked ``interrupted``.
    """
    finish = finish or finish_evidence
    evd = p.evidence
    t0 = time.time()
    evd.command.write((opts.command_line or "repro run " + str(opts.scenario_path)) + "\n")
    session = session if session is not None else make_session(p, observe)
    outcome: Optional[Outcome] = None
    interrupted = False
    unresolved: Optional[UnresolvedSitesError] = None
    try:
        failed = session.start()
        if failed is not None:
            outcome = Outcome(failed, clean=False)
        else:
            if on_healthy is not None:
                on_healthy()
            outcome = session.drive(p.variant, evd, opts.requests, opts.native)
            outcome.timings["healthy_s"] = session.healthy_s or 0.0
    except UnresolvedSitesError as e:
        unresolved = e
        # the CLI exits 2 (bad input) for it: verdict.json says the same exit code (issue 29 item 3)
        outcome = Outcome(Verdict(INCONCLUSIVE, f"not run: {e}"), clean=False, exit_code=EXIT_USAGE)
    except KeyboardInterrupt as e:
        interrupted = True
        # the CLI exits 130 (Ctrl-C) or 143 (SIGTERM): verdict.json says the same
        outcome = Outcome(Verdict(INCONCLUSIVE, "interrupted by the user (Ctrl-C/SIGTERM) before a verdict; evidence is partial"),
                          state=getattr(session, "interrupted_state", None), clean=False, exit_code=interrupt_exit_code(e))
    finally:
        if outcome is None:  # an exception on its way out: the process ends with a traceback, exit 1
            outcome = Outcome(Verdict(INCONCLUSIVE, "internal error before a verdict (see the console)"), clean=False,
                              exit_code=EXIT_INTERNAL)
        if outcome.topology is None:  # the session writes its folder, also when it never drove
            outcome.topology = session
        outcome.timings["to_verdict_s"] = time.time() - t0
        try:
            finish(p, opts, p.variant, evd, outcome, session.rank_pids, interrupted)
        finally:
            session.stop()
            session.close_drivers()
            outcome.timings["total_s"] = time.time() - t0
            if session.interrupted_in_teardown and not interrupted:
                # the verdict was written before the signal came; the process now exits 130/143: say so there too
                outcome.exit_code = getattr(session, "teardown_exit_code", None) or interrupt_exit_code(KeyboardInterrupt())
                _rewrite_exit_code(evd, outcome.exit_code)
            interrupted = interrupted or session.interrupted_in_teardown
            evd.set_status("interrupted" if interrupted else "complete", timings=outcome.timings)
    if unresolved is not None:
        raise unresolved
    if interrupted:
        raise KeyboardInterrupt
    return outcome


def _rewrite_exit_code(evd: ev.EvidenceDir, code: int) -> None:
    """Set verdict.json's ``exit_code`` to ``code`` (atomically; nothing else changes); no-op when it is absent."""
    rec = ev.read_json(evd.verdict.path)
    if isinstance(rec, dict) and rec.get("exit_code") != code:
        rec["exit_code"] = code
        evd.verdict.write(rec)


def _result(outcome: Outcome, expect: Optional[str], path: Path) -> RunResult:
    st = outcome.state
    return RunResult(outcome.verdict, outcome_exit_code(outcome, expect), path, expect, outcome.analysis,
                     outcome.timings, st.ok if st else 0, st.total if st else 0, outcome.injector)


@dataclass(frozen=True)
class VariantItem:
    """One variant to drive in :func:`run_variants`.

    Attributes:
        variant: the variant's name (its injections must be in the session's plan).
        label: the run folder's label (default: the variant's name).
        command: the line written to the run folder's ``command.txt``.
        seed: burst seed for this variant only (None: the scenario's); fresh prompts avoid warm prefix caches.
        session_info: extra keys for the run folder's ``session.json`` (after ``session``, before ``rank_pids``).
    """

    variant: str
    label: Optional[str] = None
    command: str = ""
    seed: Optional[int] = None
    session_info: dict = field(default_factory=dict)


@dataclass
class VariantDone:
    """What :func:`run_variants` hands its per-result callback for one driven variant.

    Attributes:
        index: position in the items; item / variant: what was driven; outcome: the session's Outcome (after the
        settle check); run_dir: its evidence folder (complete); result: the RunResult (exit code with the
        variant's own expectation unless ``--expect`` was given); log_offset: size in bytes of the session's
        ``server.log`` before the burst (:func:`log_since` reads what this variant's server wrote);
        ended_t: ``time.time()`` when its evidence was complete.
    """

    index: int
    item: VariantItem
    variant: Variant
    outcome: Outcome
    run_dir: ev.EvidenceDir
    result: RunResult
    log_offset: int
    ended_t: float


def log_since(path: Path, offset: int, max_bytes: int = 4_000_000) -> str:
    """The server log written since ``offset`` (bytes), at most the last ``max_bytes``; "" when unreadable."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            end = fh.tell()
            fh.seek(max(offset, end - max_bytes))
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def run_variants(
    session: Any,
    opts: RunOptions,
    items: Sequence[VariantItem],
    on_result: Callable[[VariantDone], None],
    *,
    before: Optional[Callable[[int, VariantItem], Optional[str]]] = None,
    on_start: Optional[Callable[[int, VariantItem], None]] = None,
    on_not_run: Optional[Callable[[Sequence[VariantItem], str], None]] = None,
    on_died_between: Optional[Callable[[VariantDone, float, str], None]] = None,
    on_interrupt: Optional[Callable[[VariantItem, ev.EvidenceDir], None]] = None,
    settle_s: Optional[float] = None,
    max_restart_failures: Optional[int] = None,
    finish: Optional[Callable[..., None]] = None,
    snapshot: Optional[Callable[[Any, ev.EvidenceDir], None]] = None,
) -> list[VariantDone]:
    """THE multi-variant loop: start ``session``, drive every item on it in turn, one evidence folder each.

    Used by :func:`run_many` (tests, several variants of one scenario) and ``repro hunt`` (trials). The caller owns
    the session's stop (``finally: session.stop()``). Per item: ``before`` may end the loop (its reason goes to
    ``on_not_run`` with the items not run); a server that died after the previous item ended clean is reported to
    ``on_died_between(previous, seconds since, log since)`` and restarted; after an unclean outcome (hang, crash,
    requests outstanding) the server is restarted before the next item (never after the last); ``on_start`` is
    called; the run folder gets ``session.json`` and ``command.txt``; the session drives the variant; with
    ``settle_s`` (seconds; None: no check) a clean outcome whose server is dead ``settle_s`` later becomes INCONCLUSIVE (a divergence that
    outlived the burst); the session's injector records and log are copied in (``snapshot``), the evidence is
    written (``finish``, default :func:`finish_evidence`) and ``on_result`` gets a :class:`VariantDone`.

    Start failures: with ``max_restart_failures`` None, every item after a failed (re)start gets that failure as its
    INCONCLUSIVE outcome (its evidence says why); with a number, the start is retried up to that many more times,
    then the remaining items go to ``on_not_run``.

    Returns:
        The VariantDone of every driven item, in order.
    Raises:
        KeyboardInterrupt: passed through after the interrupted item's folder was marked ``interrupted`` and
            ``on_interrupt`` was called (the caller tears down).
    """
    p = session.p
    finish = finish or finish_evidence
    snapshot = snapshot or getattr(session, "snapshot", snapshot_session)
    log_path = p.evidence.server_log.path
    done: list[VariantDone] = []
    failures = 0
    need_restart = False  # lazily, before the next item: no restart after the last one
    last_clean: Optional[VariantDone] = None  # the previous item, when it ended clean on a live server

    def not_run(rest: Sequence[VariantItem], why: str) -> None:
        if on_not_run is not None:
            on_not_run(rest, why)

    failed = session.start()
    for i, item in enumerate(items):
        if before is not None:
            why = before(i, item)
            if why:
                not_run(items[i:], why)
                break
        server = getattr(session, "server", None)
        if last_clean is not None and server is not None and not server.is_running():
            # the server outlived the settle check after the previous clean burst but died before this item: that
            # item is the only thing that ran since; this one starts on a fresh server
            if on_died_between is not None:
                on_died_between(last_clean, time.time() - last_clean.ended_t, log_since(log_path, last_clean.log_offset))
            need_restart = True
        last_clean = None
        if need_restart:
            failed = session.restart()
            need_restart = False
        if max_restart_failures is not None:
            while failed is not None:
                failures += 1
                if failures > max_restart_failures:
                    not_run(items[i:], f"server could not be (re)started: {failed.reason}")
                    return done
                failed = session.restart()
            failures = 0
        if session.p is not p:  # a session that swapped to its spare server (repro hunt) drives on that one's plan
            p, log_path = session.p, session.p.evidence.server_log.path
        if on_start is not None:
            on_start(i, item)
        if item.seed is not None:
            p.scenario = p.scenario.model_copy(update={"burst": p.scenario.burst.model_copy(update={"seed": item.seed})})
        variant = p.scenario.variant(item.variant)
        run_dir = ev.EvidenceDir(p.evidence.root, p.scenario.name, item.label or item.variant)
        run_dir.session.write({"session": str(p.evidence.path), **item.session_info,
                               "rank_pids": {str(k): v for k, v in session.rank_pids.items()}})
        run_dir.command.write((item.command or f"repro run {opts.scenario_path} --variant {item.variant}") + "\n")
        log_off = log_path.stat().st_size if log_path.exists() else 0
        t0 = time.time()
        if failed is not None:
            outcome = Outcome(failed, clean=False, topology=session if isinstance(session, RunEvidence) else None)
        else:
            try:
                outcome = session.drive(variant, run_dir, opts.requests, opts.native)
            except KeyboardInterrupt:
                run_dir.set_status("interrupted")
                if on_interrupt is not None:
                    on_interrupt(item, run_dir)
                raise
        outcome.timings["to_verdict_s"] = time.time() - t0
        if outcome.clean and settle_s is not None:
            # a divergence can outlive the burst (ranks a tick apart): the next collective, even the idle request
            # broadcast, then crashes or hangs. Give it settle_s to show before calling the variant clean.
            time.sleep(settle_s)
            server = getattr(session, "server", None)
            if server is not None and not server.is_running():
                outcome.clean = False
                outcome.verdict = Verdict(INCONCLUSIVE, f"server died within {settle_s:g} s after the burst ended "
                                                        f"(a divergence that outlived the burst); verdict before: "
                                                        f"{outcome.verdict.verdict}")
        snapshot(p, run_dir)
        finish(p, opts, variant, run_dir, outcome, session.rank_pids, False)
        run_dir.set_status("complete", timings=outcome.timings)
        res = _result(outcome, variant.expect if opts.expect is None else opts.expect, run_dir.path)
        d = VariantDone(i, item, variant, outcome, run_dir, res, log_off, time.time())
        done.append(d)
        on_result(d)
        if failed is None and not outcome.clean:
            need_restart = True
        elif outcome.clean:
            last_clean = d
    return done


def run_many(opts: RunOptions, variants: Sequence[str], observe: Observer = _noop,
             on_result: Optional[Callable[[VariantDone], None]] = None) -> list[RunResult]:
    """Drive several variants of one scenario on ONE server, each with its own evidence folder (:func:`run_variants`).

    The plan holds every listed variant's injections (ids must be unique across them); each variant is armed in
    turn, so counts restart per variant. After a variant leaves the server unusable (deadlock, crash, requests
    outstanding) the server is restarted before the next one. Each run folder gets a copy of the injector
    records and the server log taken when its variant ended, and ``session.json`` naming the session folder.

    Args:
        on_result: called with each variant's :class:`VariantDone` as soon as its evidence is complete.
    Raises:
        RunError: bad input, before anything was launched.
        KeyboardInterrupt: after teardown.
    """
    p = prepare(opts, label_default="session", variants=variants)
    session = make_session(p, observe)
    results: list[RunResult] = []
    interrupted = False

    def collect(d: VariantDone) -> None:
        results.append(d.result)
        if on_result is not None:
            on_result(d)

    items = [VariantItem(name, command=opts.command_line or f"repro run {opts.scenario_path} --variant {name}")
             for name in variants]
    try:
        run_variants(session, opts, items, collect)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        session.stop()
        session.close_drivers()
        p.evidence.set_status("interrupted" if interrupted else "complete")
    if interrupted:
        raise KeyboardInterrupt
    return results


def snapshot_session(p: Prepared, run_dir: ev.EvidenceDir) -> None:
    """Copy the session's injector records and server log into a run folder (self-contained evidence)."""
    shutil.copytree(p.evidence.injector_dir, run_dir.injector_dir, dirs_exist_ok=True)
    for member in (ev.Layout.SERVER_LOG, ev.Layout.PLAN, ev.Layout.SCENARIO, ev.Layout.PROCESSES):
        src = p.evidence.member(member).path
        if src.exists():
            shutil.copyfile(src, run_dir.member(member).path)


PORT_RACE_ATTEMPTS = 3


def _lost_port_race(err: Exception, server: Any) -> bool:
    """True when start-up failed because a port picked as free was taken meanwhile (EADDRINUSE in the log)."""
    text = f"{err} {getattr(err, 'log_tail', '')} {server.log_tail(40) if server is not None else ''}"
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def save_server_procs(evd: ev.EvidenceDir, server: Any) -> None:
    """Record the server tree (pid + start ticks per process) in ``processes.json`` for ``repro cleanup``, with the
    launcher's mark that the harness started it (cleanup ends only marked trees)."""
    from repro.procs import save_procs

    try:
        mark = server.launch_mark() if hasattr(server, "launch_mark") else None
        save_procs(evd.processes.path, server.procs(), launch=mark)
        owned = [str(d) for d in getattr(server, "owned_dirs", [])]
        if owned:  # `repro cleanup` removes them after a SIGKILLed harness (the launcher would have at stop)
            evd.owned_dirs.write(owned)
    except Exception:
        pass


def _ledger_evidence(evd: ev.EvidenceDir, rank_pids: dict[int, int], *, ledger_dir: Optional[Path] = None,
                     keys: Optional[Sequence[int]] = None, extra: Optional[dict] = None) -> Any:
    """Align the rank processes' collective ledgers (``repro.ledger``); write ``ledger.json`` and ``timeline.svg``.
    The ranks ``rank_deaths.json`` names (``repro.checker.RankDeathDetector``) are marked dead: never "waits".

    Args:
        ledger_dir: where the ledgers are (default: ``evd``'s injector folder; a ``--hosts`` run: its mirror).
        keys: the ledger files' keys to read (default: the rank pids; a ``--hosts`` mirror: the ranks).
        extra: more keys for ``ledger.json``.
    Returns the ``LedgerDiagnosis`` or None when no ledger was recorded (or it could not be read: the error goes
    into ``ledger.json``, the report falls back to the stack analysis).
    """
    from repro.ledger import diagnose
    from repro.timeline import render_timeline

    keys = list(rank_pids.values()) if keys is None else list(keys)
    try:
        diag = diagnose(evd.injector_dir if ledger_dir is None else ledger_dir, keys or None)
    except Exception as e:  # a broken ledger must not cost the verdict
        evd.ledger.write({"error": f"{type(e).__name__}: {e}"})
        return None
    if diag is None:
        return None
    deaths = ev.read_json(evd.rank_deaths.path) if evd.rank_deaths.exists() else None
    if isinstance(deaths, list) and deaths:  # repro.checker.RankDeathDetector: never say a dead rank "waits"
        diag.mark_dead({int(d["rank"]): f"pid {d['pid']}: {d['reason']}" for d in deaths if isinstance(d, dict)})
    evd.ledger.write({**diag.to_dict(), **(extra or {})})
    proof = evd.proof.read(missing_ok=True)  # repro.proof.LedgerProofDetector's, when it proved the deadlock
    evd.timeline.write(render_timeline(diag.ledgers, diag.divergence, proof=proof if isinstance(proof, dict) else None))
    return diag


def finish_evidence(p: Prepared, opts: RunOptions, variant: Variant, evd: ev.EvidenceDir, outcome: Outcome,
                     rank_pids: dict[int, int], interrupted: bool) -> None:
    """Write analysis.json, ledger.json + timeline.svg, env.json, REPORT.md and, last and atomically, verdict.json
    into ``evd``, as the topology that drove the run writes them (``outcome.topology``, a :class:`RunEvidence`:
    every session is one; a single server's by default). The injector records are read at most once per run
    (``outcome.injector`` when the judge already read them; it is set here otherwise, for the callers that need
    them after)."""
    topology = outcome.topology if isinstance(outcome.topology, RunEvidence) else SINGLE_SERVER
    topology.write_evidence(p, opts, variant, evd, outcome, rank_pids, interrupted)


def run(opts: RunOptions, observe: Observer = _noop) -> RunResult:
    """Prepare and run a scenario variant; see ``run_prepared``.

    Raises:
        RunError: bad input, before anything was launched.
    """
    return run_prepared(prepare(opts), opts, observe)
