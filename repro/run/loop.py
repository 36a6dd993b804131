"""The one run loop: the session of a topology (:func:`make_session`), one variant (:func:`run_one`,
:func:`run_prepared`, :func:`run`) and several variants on one server (:func:`run_variants`, :func:`run_many`)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from repro import evidence as ev
from repro.run.finish import Outcome, RunEvidence, finish_evidence, outcome_exit_code, snapshot_session
from repro.run.options import Observer, Prepared, RunOptions, RunResult, UnresolvedSitesError, _noop
from repro.run.prepare import prepare
from repro.run.session import Session
from repro.scenario import Variant
from repro.verdict import EXIT_INTERNAL, EXIT_USAGE, INCONCLUSIVE, Verdict, interrupt_exit_code


def make_session(p: Prepared, observe: Observer = _noop, detectors: Optional[Sequence[Any]] = None,
                 hosts: Sequence[Any] = ()) -> "Session":
    """The session for ``p`` — THE place a topology is chosen: a :class:`Session` (one server here), for a
    multi-server topology (``server.topology`` other than ``single``, e.g. PD disaggregation) ``repro.pd``'s
    session over the whole stack, and with ``hosts`` (``repro.hosts.HostSpec``, one per node) the session of a
    server spanning those hosts (``repro.multihost.MultiHostSession``). Every one is driven by
    :meth:`Session.drive` and :func:`run_variants`, and writes its folder as a :class:`RunEvidence`."""
    from repro import pd

    if hosts:
        from repro.multihost import MultiHostSession

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
        except KeyboardInterrupt as e:  # the signal came while the evidence was written (later ones are ignored)
            interrupted = True
            outcome.exit_code = interrupt_exit_code(e)
            _verdict_after_cut_finish(p, opts, p.variant, evd, outcome, session.rank_pids)
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


def _verdict_after_cut_finish(p: Prepared, opts: RunOptions, variant: Variant, evd: ev.EvidenceDir, outcome: Outcome,
                              rank_pids: dict[int, int]) -> None:
    """A Ctrl-C / SIGTERM cut :func:`finish_evidence` short. verdict.json (which it writes last) still says what the
    run reached — the verdict stands: the drive ended before the signal, its proof and stacks are on disk — marked
    ``partial``, with the interrupt's exit code (130/143, what the process exits with) and a note naming the
    members the cut left unwritten; a verdict.json already written only gets that exit code and note."""
    missing = [m.name for m in (ev.Layout.ANALYSIS, ev.Layout.LEDGER, ev.Layout.ENV, ev.Layout.REPORT, ev.Layout.VERDICT)
               if not (evd.path / m.name).exists()]
    note = ("interrupted (Ctrl-C/SIGTERM) while the evidence was written: the verdict was reached before it"
            + (f"; not written: {', '.join(missing)} (`repro analyze {evd.path}` reads what is there)" if missing else ""))
    rec = ev.read_json(evd.verdict.path) if evd.verdict.path.exists() else None
    if isinstance(rec, dict):
        rec.update(exit_code=outcome.exit_code, partial=True, notes=[*(rec.get("notes") or []), note])
        evd.verdict.write(rec)
        return
    v = outcome.verdict
    evd.verdict.write(ev.verdict_record(
        dataclasses.replace(v, notes=(*v.notes, note)), exit_code=outcome_exit_code(outcome, opts.expect),
        evidence=evd.path, scenario=p.scenario.name, variant=variant.name, variant_expects=variant.expect,
        expect=opts.expect, partial=True, timings=outcome.timings, rank_pids=rank_pids, **outcome.verdict_fields))


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
        restart_after: the item leaves lasting effects in the server's processes even when it ends clean (a
            thread killed by a fault, a shifted clock, leaked slots): restart before the next item.
    """

    variant: str
    label: Optional[str] = None
    command: str = ""
    seed: Optional[int] = None
    session_info: dict = field(default_factory=dict)
    restart_after: bool = False


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
        try:
            snapshot(p, run_dir)
            finish(p, opts, variant, run_dir, outcome, session.rank_pids, False)
        except KeyboardInterrupt as e:  # the signal came while this variant's evidence was written
            outcome.exit_code = interrupt_exit_code(e)
            _verdict_after_cut_finish(p, opts, variant, run_dir, outcome, session.rank_pids)
            run_dir.set_status("interrupted", timings=outcome.timings)
            if on_interrupt is not None:
                on_interrupt(item, run_dir)
            raise
        run_dir.set_status("complete", timings=outcome.timings)
        res = _result(outcome, variant.expect if opts.expect is None else opts.expect, run_dir.path)
        d = VariantDone(i, item, variant, outcome, run_dir, res, log_off, time.time())
        done.append(d)
        on_result(d)
        if failed is None and (not outcome.clean or item.restart_after):
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


def run(opts: RunOptions, observe: Observer = _noop) -> RunResult:
    """Prepare and run a scenario variant; see ``run_prepared``.

    Raises:
        RunError: bad input, before anything was launched.
    """
    return run_prepared(prepare(opts), opts, observe)
