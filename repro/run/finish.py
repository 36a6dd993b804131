"""Writing a run's folder (:func:`finish_evidence`): analysis, ledger alignment, env.json, REPORT.md and, last,
verdict.json, as the topology that drove the run writes them (:class:`RunEvidence`)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from repro import evidence as ev
from repro.driver import DriverState
from repro.run.options import Prepared, RunOptions
from repro.run.records import collect_versions, injection_checks
from repro.scenario import Variant
from repro.verdict import Verdict, exit_code_for


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
    the report shows (``repro.multihost.MultiHostSession``) — or the whole folder (``repro.pd``: one folder per
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


def snapshot_session(p: Prepared, run_dir: ev.EvidenceDir) -> None:
    """Copy the session's injector records and server log into a run folder (self-contained evidence)."""
    shutil.copytree(p.evidence.injector_dir, run_dir.injector_dir, dirs_exist_ok=True)
    for member in (ev.Layout.SERVER_LOG, ev.Layout.PLAN, ev.Layout.SCENARIO, ev.Layout.PROCESSES):
        src = p.evidence.member(member).path
        if src.exists():
            shutil.copyfile(src, run_dir.member(member).path)


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
