"""The hunt's loop: the baseline burst, then every trial armed in turn on a shared server, restarts after a hang or a
crash, the budget, ``--confirm`` and the workloads of one server group (``repro hunt``; the package docstring).

Runs go through a :class:`repro.hunt.runs.Runs` (the real runner by default; tests pass a stand-in) and the one
multi-variant loop of :mod:`repro.runner`."""

from __future__ import annotations

import json
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Sequence

from repro import evidence as ev
from repro.catalogue import (Catalogue, DecisionPoint, HuntError, catalogue_for, check_natural, check_storage_points,
                             hunt_catalogue, load_catalogue, short_frame)
from repro.hunt.classify import FAMILY_SCHED, crash_diagnosis, desync_diagnosis, diagnose, hazard_statement
from repro.hunt.findings import finding_scenario, write_findings, write_workload_finding
from repro.hunt.options import Clock, HuntOptions, HuntResult, Observer, noop
from repro.hunt.plan import Row, Trial, plan_trials, read_seen, rows_from_seen, server_injector_dirs, site_rows, trial_seed
from repro.hunt.report import HuntLog, version_header
from repro.hunt.results import NOT_RUN, TrialResult
from repro.hunt.runs import Runs, default_runs
from repro.hunt.spare import SparedSession
from repro.hunt.workloads import admin_summary, nemeses_for, trial_extra, workload_extra
from repro.option_checks import positive_number_problem
from repro.runner import RunError, RunOptions, VariantItem, log_since, run_one, run_variants
from repro.scenario_toml import scenario_toml
from repro.verdict import DEADLOCKED, DESYNCED, INCONCLUSIVE, SUCCEEDED, Verdict


MAX_RESTART_FAILURES = 2  # consecutive failed (re)starts before the hunt gives up
SETTLE_S = 2.0  # seconds after a clean burst before the server is checked for a delayed crash
# Seconds a hunt's server tree gets after SIGTERM before SIGKILL (runner.Session.stop_grace_s; the launcher's
# default is 10). Once a scheduler died of the SIGTERM, sglang 0.5.23's parent logs "Sleeping 5 seconds before crash
# diagnostics" (managers/tokenizer_manager.py, its SIGQUIT handler) and only then exits: 6 s of every teardown
# (measured) — after each hang, and for the baseline and the last trial server — that a hunt's server, hung or
# done, has no use for.
STOP_GRACE_S = 1.0


def _check_sites_option(sites: bool, cat: Catalogue, base: Any) -> None:
    if not sites:
        return
    try:
        import repro.ledger  # noqa: F401
    except ImportError:
        raise HuntError(f"--sites needs the collective ledger (repro/ledger/, per-rank {ev.Layout.ledger_file('<pid>')}), which this "
                        "checkout does not have; run without --sites (decision points only)") from None
    if not cat.site_apis:
        raise HuntError(f"--sites: {cat.path} has no [sites.apis] table saying where the ledger's collective APIs live")
    if not base.ledger:
        raise HuntError("--sites: the base scenario sets ledger = false; the ledger must record the baseline burst")


def _check_point_servers(points: Sequence[DecisionPoint], adapter: Any, base: Any, scenario_path: Any, cat_path: Any) -> None:
    """Refuse, before any launch, a chosen decision point whose ``servers`` names no engine server of the base
    scenario's multi-server topology (e.g. ``encoder`` or ``router`` on a PD stack): its rows would all be dropped
    after the baseline and the point reported "not reached". A single server's rows have no server and are kept
    whatever ``servers`` says (catalogue.DecisionPoint), so a single-server base is not checked.

    Raises:
        HuntError: the point, the names and the stack's engine servers.
    """
    roles = adapter.topology(base.server).roles
    if len(roles) < 2:
        return
    engines = [r.name for r in roles if r.kind == "engine"]
    for pt in points:
        unknown = [s for s in pt.servers if s not in engines]
        if unknown:
            raise HuntError(f"{cat_path}: decision point {pt.name}: servers = {json.dumps(unknown)} names no engine server of "
                            f"{scenario_path} (its engine servers: {', '.join(engines)}); fix the catalogue's "
                            f"servers field (or leave it out: every server)")


def hunt_group(opts: HuntOptions, observe: Observer = noop, *, runs: Optional[Runs] = None) -> HuntResult:
    """Run the hunt of one server group: baseline burst → rows → one trial per row × perturbation × rank on a shared
    server (with ``opts.group_workloads``: each workload's clean run first, then the trials under each).

    Args:
        opts: see :class:`HuntOptions`.
        observe: progress callback ``(event, data)``: ``hunt_folder``, ``baseline``, ``rows``, ``trial_start``,
            ``trial``, ``progress`` (``done``, ``total``, ``remaining_s``), plus the runner's own events.
        runs: how servers are prepared, run and recorded (default :func:`repro.hunt.runs.default_runs`, the real
            runner; tests pass a stand-in).
    Returns:
        The :class:`HuntResult`; results also stream to ``HUNT.md`` / ``hunt.jsonl`` in ``result.folder``.
    Raises:
        HuntError: bad scenario/catalogue/option, or the baseline burst failed (message says why and where).
        KeyboardInterrupt: after the server tree was torn down, the overlay removed and HUNT.md marked interrupted.
    """
    from repro.scenario import ScenarioError, load_scenario

    runs = runs or default_runs()
    bad_budget = positive_number_problem("--budget-min", opts.budget_min, "minutes")  # nan/inf too
    if bad_budget:
        raise HuntError(bad_budget)
    try:
        base = load_scenario(opts.scenario_path)
    except ScenarioError as e:
        raise HuntError(str(e)) from None
    from repro.targets.registry import get_adapter

    adapter = get_adapter(base.server.adapter)  # the run's engine (the scenario validated the name), passed down
    if opts.natural and opts.sites:  # its skip / extra collective rows are forced: check_natural never sees them
        raise HuntError("--natural --sites: --sites adds a skipped and an extra collective at every call site, both "
                        "forced (the engine's own collectives); a natural hunt takes none: drop --sites, or run "
                        "--sites without --natural")
    cat = load_catalogue(opts.catalogue_path or hunt_catalogue(adapter, opts.natural))
    if opts.natural:
        check_natural(cat)
    check_storage_points(cat, adapter.storage_sites, adapter.name)
    disc = None  # discovery's state (repro/discover/hunting.py) when --discover
    if opts.discover:
        from repro.discover import hunting

        if opts.natural:
            hunting.check_natural_rules(cat, opts.discover_rules, adapter)
        cat, disc = hunting.prepare(cat, _discovery_python(opts, adapter), rules_path=opts.discover_rules,
                                    keep_hand_points=opts.hand_points, adapter=adapter)
    elif not opts.hand_points:
        raise HuntError("--no-hand-catalogue needs --discover (without either, there is nothing to hunt)")
    _check_sites_option(opts.sites, cat, base)
    ncat = nemeses_for(opts, cat) if opts.group_workloads else None
    if ncat is not None and opts.sites:
        raise HuntError("--sites with --workload/--config is not supported (the call sites are read from one quiet "
                        "baseline); run --sites without workloads")
    points = [cat.point(n) for n in opts.only] if opts.only else list(cat.points)
    if not opts.sites and ncat is None and not any(pt.perturbations for pt in points):  # a baseline, then nothing
        raise HuntError(f"{cat.path}: decision point(s) {', '.join(pt.name for pt in points)} offer no perturbation "
                        "(perturbations = []): the hunt would run its baseline and try nothing; list perturbations "
                        "in the catalogue's [[points]] entry, or choose other points with --only")
    engines = [(r.name, r.tp_size or base.server.tp_size) for r in adapter.topology(base.server).engines()]
    tp = max([base.server.tp_size, *(t for _, t in engines)])  # a stack: its widest server (rows keep their own ranks)
    ranks = list(opts.ranks) if opts.ranks else list(range(tp))
    bad = [r for r in ranks if not 0 <= r < tp]
    if bad:
        what = (f"the stack's engine servers have TP {', '.join(f'{n} {t}' for n, t in engines)}" if len(engines) > 1
                else f"the base scenario's TP size is {tp}")
        raise HuntError(f"--rank {bad}: {what}; ranks are 0..{tp - 1}")
    _check_point_servers(points, adapter, base, opts.scenario_path, cat.path)
    if opts.sites_matching and not opts.sites:
        raise HuntError(f"--sites-matching {' '.join(opts.sites_matching)} needs --sites (it narrows the collective "
                        "call sites --sites adds); add --sites or drop --sites-matching")
    if opts.requests is not None and opts.requests < 1:
        raise HuntError(f"--requests must be ≥ 1 (got {opts.requests})")
    if opts.perturbations and not opts.sites:
        plan_trials(cat, [], ranks, opts.perturbations)  # validates the names (--sites adds its own after the baseline)
        offered = {n for pt in points for n in pt.perturbations}
        missing = [x for x in opts.perturbations if x not in offered]
        if missing:
            raise HuntError(f"--perturbation {', '.join(missing)}: no chosen decision point offers it; "
                            + "; ".join(f"{pt.name}: {', '.join(pt.perturbations)}" for pt in points))
    shard_keys = _shard_keys(opts, points, ranks)  # the split, before any folder, baseline or server
    clock = Clock(opts.budget_min * 60.0)
    mat = _materialize(opts.ref, opts.python, adapter)
    if mat is None and opts.python:  # an explicit --python is checked before any folder exists
        from repro.interpreter import InterpreterError, choose_python

        try:
            choose_python(opts.python, adapter)
        except InterpreterError as e:
            raise HuntError(str(e)) from None
    try:
        folder = ev.EvidenceDir(opts.evidence_root, base.name, "hunt")
    except ev.EvidenceError as e:
        if mat is not None:
            mat.close()
        raise HuntError(str(e)) from None
    hf = folder.path
    folder.hunt_scenarios_dir.mkdir(exist_ok=True)
    header = {"scenario": str(opts.scenario_path), "catalogue": str(cat.path), "ref": f"{opts.ref} ({mat.description})" if mat else opts.ref,
              "ranks": ", ".join(map(str, ranks)), "budget_min": opts.budget_min, "command": opts.command_line}
    if disc is not None:
        hunting.write_inputs(disc, hf)
        header["discovery"] = (f"{len(disc.discovery.candidates)} candidates, {len(disc.added)} points added "
                               f"({'with' if opts.hand_points else 'without'} the hand points): "
                               f"{ev.Layout.DISCOVERY.name}/{ev.Layout.DISCOVERY_MD.name}")
    if opts.shard:
        header["shard"] = (f"{opts.shard[0]}/{opts.shard[1]}: {len(shard_keys)} (point, perturbation, rank) key(s) of this "
                           "shard, split before the baseline; `repro hunt-merge` joins the shard folders")
    log = HuntLog(hf, header)
    observe("hunt_folder", {"folder": str(hf)})
    result = HuntResult(hf, [], log.results)
    if opts.shard:
        log.event("shard", k=opts.shard[0], n=opts.shard[1], keys=[list(k) for k in shard_keys],
                  header={k: header[k] for k in ("scenario", "catalogue", "ref", "ranks") if k in header})
    python = mat.python if mat else opts.python
    prepend = tuple(mat.pythonpath_prepend) if mat else ()
    interrupted = False
    try:
        if ncat is not None:  # one clean run per workload on one server, then the trials under each
            result.rows = _hunt_workloads(runs, base, adapter, cat, ncat, points, ranks, hf, log, result, clock, observe, opts,
                                          python, prepend)
            raise _Done()
        if opts.shard and not shard_keys and not opts.sites:  # nothing of the plan is this shard's: no server at all
            log.header["trials_total"] = 0
            log.finish("complete", wall_s=clock.elapsed, note=f"shard {opts.shard[0]}/{opts.shard[1]} holds no trial")
            result.empty_shard = f"{opts.shard[0]}/{opts.shard[1]}"
            return result
        # ---- 1. baseline: observe-only probes record every call place of every decision point (every point, also
        # in a shard: the trial numbers, and so the burst seeds, are the unsharded plan's)
        probes = {f"probe-{p.name}": p.name for p in points}
        probe_file = folder.hunt_baseline.write(scenario_toml(
            base, base.name, "repro hunt baseline: observe-only probes on every decision point",
            [("baseline", "success", "record callers of every decision point",
              [{"id": pid, "site": list(cat.point(pn).sites), "action": {"kind": "none", "record_callers": True},
                "gate": {"occurrence": {"mode": "every"}}} for pid, pn in probes.items()])]))
        ro = RunOptions(scenario_path=probe_file, variant="baseline", python=python, evidence_root=opts.evidence_root,
                               label="hunt-baseline", requests=opts.requests, pythonpath_prepend=prepend,
                               command_line=opts.command_line)
        try:
            p0 = runs.prepare(ro)
        except RunError as e:
            raise HuntError(str(e)) from None
        result.baseline = p0.evidence.path
        observe("baseline", {"evidence": str(p0.evidence.path)})
        s0 = _session(runs, p0, observe)
        armed: list[float] = []  # when the server was healthy and the burst began (run_one's on_healthy)
        # the one-variant loop every run uses: verdict.json, REPORT.md, ... in the baseline's folder; the server is
        # stopped after the burst, the folder marked complete (interrupted: marked so, KeyboardInterrupt re-raised)
        oc = run_one(p0, ro, observe, s0, finish=runs.finish_evidence, on_healthy=lambda: armed.append(time.time()))
        if not armed:
            raise HuntError(f"baseline server: {oc.verdict.reason} (evidence: {p0.evidence.path})")
        t_arm = armed[0]
        st = oc.state
        versions = runs.collect_versions(p0.evidence.injector_dir, p0.python, adapter)
        log.header.update(version_header(versions, adapter))
        if oc.verdict.verdict == DEADLOCKED or st is None or st.ok != st.total:
            raise HuntError(f"the clean baseline burst did not succeed ({oc.verdict.verdict}: {oc.verdict.reason}); "
                            f"a hunt needs a healthy base scenario. Evidence: {p0.evidence.path}")
        seen = read_seen(p0.evidence.injector_dir, server_injector_dirs(p0.evidence.path))
        rows = rows_from_seen(cat, seen, probes)
        if opts.sites:
            from repro.ledger import load_ledgers

            leds = load_ledgers(p0.evidence.injector_dir, list(s0.rank_pids.values()) or None)
            records = [r for led in leds.values() for r in led.records]
            cat, srows = site_rows(cat, records, t_arm, opts.sites_matching)
            if not srows:
                seen_sites = sorted({" ← ".join(short_frame(f) for f in r.site[:4]) for r in records
                                     if not r.inj and r.t_enter >= t_arm and r.site})
                what = (f"no collective call site of the baseline burst matched --sites-matching "
                        f"{' '.join(opts.sites_matching)}" if opts.sites_matching
                        else "the ledger saw no collective call site during the baseline burst")
                log.event("sites", note=what, seen=seen_sites)
                if opts.sites_matching:
                    shown = "; ".join(seen_sites[:8]) or "none"
                    count = f"first 8 of {len(seen_sites)}" if len(seen_sites) > 8 else str(len(seen_sites))
                    raise HuntError(f"{what}. Call sites seen ({count}; all in {ev.Layout.HUNT_JSONL.name}): {shown}. Globs match any of a "
                                    f"site's frames (Class.method, or module:Class.method with a ':'). Baseline "
                                    f"evidence: {p0.evidence.path}")
            rows = rows + srows
        result.rows = rows
        seen_points = {r.point for r in rows}
        log.header["points_not_seen"] = [p.name for p in points if p.name not in seen_points]
        if disc is not None:
            log.event("discovery_not_reached", points=hunting.after_baseline(disc, rows))
        log.set_rows(rows)
        log.event("baseline", evidence=str(p0.evidence.path), seen=len(seen), rows=len(rows), healthy_s=s0.healthy_s,
                  burst_s=oc.timings.get("burst_s"))
        observe("rows", {"rows": rows, "not_seen": log.header["points_not_seen"]})
        trials = plan_trials(cat, rows, ranks, opts.perturbations)
        if opts.shard:
            from repro import shard as shard_mod

            log.event("plan", trials=[[t.n, t.name] for t in trials])  # the unsharded plan: hunt-merge checks it
            log.header["plan_total"] = len(trials)
            mine, named = set(shard_keys), {p.name for p in points}

            def in_shard(t: Trial) -> bool:  # a decision point's trial: its key was split before the baseline;
                key = shard_mod.trial_key(t)  # a --sites point exists only after it: the same hash splits it
                return key in mine if t.row.point in named else shard_mod.shard_of(key, opts.shard[1]) == opts.shard[0]

            trials = [t for t in trials if in_shard(t)]
        log.header["trials_total"] = len(trials)
        if not trials:
            log.finish("complete", wall_s=clock.elapsed)
            return result
        # ---- 2. trials: one plan with every trial's injection, armed one at a time
        _trial_phase(runs, base, cat, trials, hf, log, clock, observe, opts, python, prepend)
        result.budget_exhausted = any(r.verdict == NOT_RUN for r in log.results)
        if opts.confirm:
            _confirm(runs, log, python, prepend, opts, clock, observe)
            write_findings(log, cat, base, opts.scenario_path, disc)
    except _Done:
        result.budget_exhausted = any(r.verdict == NOT_RUN for r in log.results)
    except KeyboardInterrupt:
        interrupted = True
    except HuntError as e:
        log.finish("failed", error=str(e), wall_s=clock.elapsed)
        raise
    finally:
        if mat is not None:
            mat.close()
        result.wall_s = clock.elapsed
        result.interrupted = interrupted
        if disc is not None:
            result.discovery = hunting.finish(disc, hf, result.rows, log.results)
            log.event("discovery", **result.discovery)
            log.header["discovery"] = hunting.header_line(disc, result.discovery)
        status = "interrupted" if interrupted else "complete"
        if log.status == "running":
            log.finish(status, wall_s=result.wall_s)
        folder.set_status(status, wall_s=result.wall_s)
    if interrupted:
        raise KeyboardInterrupt
    return result


def _shard_keys(opts: HuntOptions, points: Sequence[DecisionPoint], ranks: Sequence[int]) -> list:
    """This shard's (point, perturbation, rank, workload) keys (``repro.shard``); [] without ``--shard``.

    Raises:
        HuntError: a K/N that is not 1 <= K <= N (the CLI parses ``--shard`` first: ``repro.shard.parse_shard``).
    """
    if not opts.shard:
        return []
    from repro import shard as shard_mod

    k, n = opts.shard
    if not (n >= 1 and 1 <= k <= n):
        raise HuntError(f"--shard {k}/{n}: expected K/N with integers 1 <= K <= N, e.g. --shard 1/4")
    return shard_mod.shard_plan_keys(points, ranks, opts.perturbations, k, n)


def _trial_phase(runs: Runs, base: Any, cat: Catalogue, trials: Sequence[Trial], hf: Path, log: HuntLog, clock: Clock,
                 observe: Observer, opts: HuntOptions, python: Optional[str], prepend: tuple) -> None:
    """Write one plan with every trial's injection (and workload), start its server, arm each trial in turn."""
    trial_file = ev.EvidenceDir.open(hf).hunt_trials.write(scenario_toml(
        base, base.name, "repro hunt trials (generated)",
        [(t.name, "success", t.perturbation.says, [t.injection(cat.point(t.row.point).sites)], trial_extra(opts, cat, t))
         for t in trials]))
    ro = RunOptions(scenario_path=trial_file, python=python, evidence_root=opts.evidence_root, label="hunt-session",
                           requests=opts.requests, pythonpath_prepend=prepend, command_line=opts.command_line)
    try:
        p = runs.prepare(ro, label_default="hunt-session", variants=[t.name for t in trials])
    except RunError as e:
        raise HuntError(str(e)) from None
    log.event("session", evidence=str(p.evidence.path))  # the trial server's run folder (`repro cleanup` finds it)
    spare_p = None
    if opts.spare and len(trials) > 1:  # one trial never needs a second server
        ro_spare = replace(ro, label="hunt-spare")
        try:
            spare_p = runs.prepare(ro_spare, label_default="hunt-spare", variants=[t.name for t in trials])
        except RunError as e:
            raise HuntError(str(e)) from None
        log.event("spare_session", evidence=str(spare_p.evidence.path))
    _run_trials(runs, p, ro, base, cat, trials, log, clock, observe, opts, spare_p)


def _discovery_python(opts: HuntOptions, adapter: Any) -> str:
    """The interpreter whose engine source discovery scans: ``--ref python:PATH``'s, else as the server's."""
    from repro.interpreter import InterpreterError, choose_python

    explicit = opts.ref[len("python:"):] if opts.ref.startswith("python:") else opts.python
    try:
        return choose_python(explicit, adapter)
    except InterpreterError as e:
        raise HuntError(str(e)) from None


def _materialize(ref: str, python: Optional[str], adapter: Any) -> Any:
    """``installed`` → None (the interpreter as given); other REFs → a ``repro.refs.Materialized`` (close it),
    made where the run's adapter (the base scenario's) keeps its package."""
    if not ref or ref == "installed":
        return None
    from repro.refs import RefError, materialize, parse_ref

    try:
        return materialize(parse_ref(ref), python, adapter)
    except RefError as e:
        raise HuntError(f"--ref {ref}: {e}") from None


def _counts(check: Any) -> tuple[dict, dict, dict]:
    if check is None:
        return {}, {}, {}
    return dict(check.entered), dict(check.matched), dict(check.fired)


def _run_trials(runs: Runs, p: Any, ro: Any, base: Any, cat: Catalogue, trials: Sequence[Trial], log: HuntLog,
                clock: Clock, observe: Observer, opts: HuntOptions, spare_p: Any = None) -> None:
    """Drive every trial on one session; after a hang/crash swap to the spare server (``spare_p``'s, when given)
    or restart; mark the rest NOT RUN when the budget ends."""
    if clock.remaining <= 0:  # the baseline used up the budget: do not start a trial server for nothing
        _not_run(log, trials, f"budget of {opts.budget_min:g} min ended before this trial")
        return
    started = [0]  # trials started so far (a spare is worth launching while one more is left after the next)
    session: Any = _session(runs, p, observe)
    if spare_p is not None:
        session = SparedSession(session, _session(runs, spare_p, observe),
                                want_spare=lambda: clock.remaining > 0 and started[0] + 1 < len(trials), log=log)
    by_name = {t.name: t for t in trials}
    items = [VariantItem(t.name, command=(opts.command_line or f"repro hunt {opts.scenario_path}") + f"  # trial {t.name}",
                         seed=trial_seed(base, t), session_info={"hunt": str(log.folder)},
                         restart_after=t.perturbation.lasting) for t in trials]

    def before(i: int, item: Any) -> Optional[str]:
        return f"budget of {opts.budget_min:g} min ended before this trial" if clock.remaining <= 0 else None

    def on_start(i: int, item: Any) -> None:
        started[0] = i + 1
        observe("trial_start", {"trial": by_name[item.variant], "n": i + 1, "total": len(trials), "remaining_s": clock.remaining})

    def on_result(d: Any) -> None:
        t = by_name[d.item.variant]
        sp = session.p  # the server this trial ran on (the spare after a swap)
        tr = _trial_result(runs, sp, base, cat, t, d.variant, d.outcome, d.run_dir.path, session.rank_pids, log.folder,
                           opts, log_since(sp.evidence.server_log.path, d.log_offset) if not d.outcome.clean else "")
        results[d.item.variant] = tr
        log.add(tr)
        observe("trial", {"result": tr, "n": d.index + 1, "total": len(trials), "remaining_s": clock.remaining})

    def on_died_between(prev: Any, since_s: float, log_text: str) -> None:
        _amend_died_after(log, results[prev.item.variant], since_s, log_text, cat)

    def on_interrupt(item: Any, run_dir: Any) -> None:
        log.event("interrupted_during", trial=item.variant, evidence=str(run_dir.path))
        log.header["interrupted_during"] = f"{item.variant} (partial evidence: {run_dir.path})"

    results: dict[str, TrialResult] = {}
    try:
        run_variants(session, ro, items, on_result, before=before, on_start=on_start,
                     on_not_run=lambda rest, why: _not_run(log, [by_name[x.variant] for x in rest], why),
                     on_died_between=on_died_between, on_interrupt=on_interrupt, settle_s=SETTLE_S,
                     max_restart_failures=MAX_RESTART_FAILURES, finish=runs.finish_evidence,
                     snapshot=runs.snapshot_session)
    finally:
        session.stop()
        session.close_drivers()
        p.evidence.set_status("complete")
        if spare_p is not None:
            spare_p.evidence.set_status("complete")
            log.header["restarts"] = session.summary()
            log.event("restarts", swaps=session.swaps, plain_restarts=session.restarts)


def _session(runs: Runs, p: Any, observe: Observer) -> Any:
    """The session of ``p`` as every verb builds it (``runs.make_session``: one server, or the whole stack of a
    multi-server base scenario), its teardown SIGKILLing what is left after :data:`STOP_GRACE_S` seconds. Used
    for the baseline, the trials and the spare alike."""
    s = runs.make_session(p, observe)
    s.stop_grace_s = STOP_GRACE_S
    return s


def _not_run(log: HuntLog, trials: Sequence[Trial], why: str) -> None:
    """Record each of ``trials`` as NOT RUN, saying why."""
    for t in trials:
        log.add(TrialResult(t, NOT_RUN, why))


def _amend_died_after(log: HuntLog, r: TrialResult, after_s: float, log_text: str, cat: Catalogue) -> None:
    """The server died after trial ``r`` ended clean (later than SETTLE_S): make ``r`` INCONCLUSIVE, say why.

    The trial's line in hunt.jsonl stays as written; an ``amended`` line follows it and HUNT.md is rewritten.
    """
    diag = crash_diagnosis(log_text, cat) if log_text else None
    tail = [ln for ln in log_text.splitlines() if ln.strip()][-1:] if log_text else []
    r.verdict = INCONCLUSIVE
    r.reason = (f"the server died {after_s:.0f} s after this trial's clean burst, before the next trial (nothing else "
                f"ran in between); verdict before: ALL REQUESTS SUCCEEDED" + (f"; last log line: {tail[0][:200]}" if tail else ""))
    r.diagnosis = diag or r.diagnosis
    t = r.trial
    r.hazard = (hazard_statement(t, INCONCLUSIVE, diag, sum(r.matched.values()), sum(r.fired.values()), 0)
                if diag and diag.crash is not None else
                f"rank-local `{t.row.point}` {t.perturbation.says} on rank {t.rank} ({t.row.where}): the server died "
                f"{after_s:.0f} s after the burst (a delayed crash: see the server log)")
    log.event("amended", trial=t.name, verdict=r.verdict, reason=r.reason)
    log._write_md()


def _trial_result(runs: Runs, p: Any, base: Any, cat: Catalogue, t: Trial, variant: Any, outcome: Any, run_dir: Path,
                  rank_pids: dict, hunt_folder: Path, opts: HuntOptions, log_text: str = "") -> TrialResult:
    v: Verdict = outcome.verdict
    check = None
    records, injector_dir = getattr(outcome, "injector", None), p.evidence.injector_dir
    role = (getattr(outcome, "pd", None) or {}).get("roles", {}).get(t.row.server) if t.row.server else None
    if role is not None:  # a stack's row: its server's records, variant (its injections) and ranks
        records, variant, rank_pids = role.get("injector"), role.get("variant") or variant, role.get("pids") or {}
        injector_dir = p.evidence.server(t.row.server).injector_dir
    if rank_pids:
        try:
            # the records finish_evidence already read (Outcome.injector), else the folder
            _, _, checks, _ = runs.injection_checks(records or injector_dir, variant, rank_pids)
            check = checks[0] if checks else None
        except Exception:
            check = None
    entered, matched, fired = _counts(check)
    diag = None
    if v.verdict == DEADLOCKED:
        a = outcome.analysis
        diag = diagnose(a.to_dict() if hasattr(a, "to_dict") else a, cat)
    elif log_text:
        diag = crash_diagnosis(log_text, cat)
    if v.verdict == DESYNCED and getattr(v, "desync", None):  # the ledgers named where the ranks' collectives differ
        diag = diag or desync_diagnosis(v.desync, cat)
    world = base.server.tp_size
    verdict = v.verdict
    hazard = hazard_statement(t, verdict, diag, sum(matched.values()), sum(fired.values()), world)
    if verdict == INCONCLUSIVE and not (diag and diag.crash is not None):
        hazard = f"rank-local `{t.row.point}` {t.perturbation.says} on rank {t.rank} ({t.row.where}): inconclusive ({v.reason[:200]})"
    tr = TrialResult(t, verdict, v.reason, float(outcome.timings.get("burst_s", outcome.timings.get("to_verdict_s", 0.0))),
                     diag, hazard, run_dir, None, entered, matched, fired, tuple(v.notes))
    if verdict == DEADLOCKED or tr.desync_crash:
        held = getattr(outcome, "ledger", None)  # the diagnosis finish_evidence aligned, else its ledger.json
        if held is not None:
            tr.ledger = str(held.divergence.summary or "")
        else:
            led = ev.EvidenceDir.open(run_dir).ledger.read(missing_ok=True) or {}
            tr.ledger = str(((led.get("divergence") or {}) if isinstance(led, dict) else {}).get("summary") or "")
    if verdict == DESYNCED:
        tr.ledger = str((getattr(v, "desync", None) or {}).get("summary") or v.reason)
    tr.effect_status, tr.effect = _effect(injector_dir, rank_pids, t)
    if verdict in (DEADLOCKED, DESYNCED):
        f = ev.EvidenceDir.open(hunt_folder).hunt_scenario(ev.Layout.trial_scenario(t.name))
        f.write_text(finding_scenario(base, opts.scenario_path, cat, t, diag, verdict, trial_extra(opts, cat, t)), encoding="utf-8")
        tr.scenario_file = f
    return tr


def _effect(folder: Any, rank_pids: dict, t: Trial) -> tuple[str, str]:
    """(status, sentence) of :func:`repro.natural_effect.natural_effect` over this trial's ledgers (``folder``: the
    trial server's injector folder; a stack's row: its server's, ``servers/<role>/injector``), from the tick of
    the trial's first fire on its rank (the server's ledgers hold every earlier trial too); ("", "") when the run
    has no ledgers to read (a stand-in runner, ledger off) or the perturbation never fired."""
    try:
        from repro.injection_records import read_injector_dir
        from repro.ledger import load_ledgers
        from repro.natural_effect import natural_effect

        if folder is None or not Path(folder).is_dir():
            return "", ""
        mine = [f for log in read_injector_dir(folder).logs for f in log.fires
                if f.injection_id == t.name and f.rank == t.rank]
        if not mine:
            return "", ""
        first = min(mine, key=lambda f: f.time)
        eff = natural_effect(load_ledgers(folder, list(rank_pids.values()) or None), t.rank, since_time=first.time,
                             thread=first.thread)
        return eff.status, eff.summary + fault_fates(mine)
    except Exception as e:  # the effect column never fails a trial
        return "", f"effect not read: {type(e).__name__}: {e}"


def fault_fates(fires: Any) -> str:
    """``"; fault on thread T: <outcome>"`` for each ``fault_outcome`` event of ``fires`` (``FireEvent``s of one
    trial, ``repro/injection_records.py``; the injector writes it ``observe_s`` after a ``fault`` nemesis raised,
    injectors/repro_injector/_natural.py), so a hunt row says whether the faulted thread died; "" when none."""
    from repro.injection_records import fault_outcomes

    return "".join(f"; {o}" for o in fault_outcomes(fires))


def _confirm(runs: Runs, log: HuntLog, python: Optional[str], prepend: tuple, opts: HuntOptions, clock: Clock,
             observe: Observer) -> None:
    """Re-run each new scheduling/cache finding from its scenario file on a fresh server (a finding must reproduce)."""
    for r in list(log.results):
        d = r.diagnosis
        if (r.verdict not in (DEADLOCKED, DESYNCED) or r.scenario_file is None or not d or d.family != FAMILY_SCHED or d.known
                or r.trial.perturbation.by_construction):
            continue
        if clock.remaining <= 0:
            break
        observe("confirm", {"trial": r.trial, "scenario": str(r.scenario_file)})
        ro = RunOptions(scenario_path=r.scenario_file, python=python, evidence_root=opts.evidence_root,
                               label=f"confirm-{r.trial.name}", pythonpath_prepend=prepend)
        res = runs.run(ro, observe)
        r.confirmed = res.verdict.verdict == r.verdict
        log.event("confirm", trial=r.trial.name, verdict=res.verdict.verdict, evidence=str(res.evidence))
        log._write_md()


class _Done(Exception):
    """The workload path of :func:`hunt` finished its baselines and trials (control flow only)."""


def _hunt_workloads(runs: Runs, base: Any, adapter: Any, cat: Catalogue, ncat: Any, points: Sequence[DecisionPoint], ranks: Sequence[int],
                    hf: Path, log: HuntLog, result: HuntResult, clock: Clock, observe: Observer, opts: HuntOptions,
                    python: Optional[str], prepend: tuple) -> list[Row]:
    """One server group of a hunt under workloads: each workload's clean run (observe-only probes, its own verdict in
    HUNT.md; a deadlock/desync there is a finding: FINDING-<workload>.md) on ONE server, then every row it reached ×
    perturbation × rank under that workload on the trial server.

    Returns:
        The rows of every workload (union; a row reached by two workloads is tried under each).
    Raises:
        HuntError: the quiet workload (the base scenario's own burst) did not succeed clean.
    """
    from repro.nemeses import QUIET

    names = list(opts.group_workloads)
    vname = {w: "baseline" if w == QUIET else f"baseline-{w}" for w in names}
    probes_by = {w: {f"probe-{p.name}" + ("" if w == QUIET else f".{w}"): p.name for p in points} for w in names}
    specs = {w: ncat.workload(w) for w in names}
    probe_file = ev.EvidenceDir.open(hf).hunt_baseline.write(scenario_toml(
        base, base.name, "repro hunt baseline: each workload clean, observe-only probes on every decision point",
        [(vname[w], "success", f"clean run under workload {w}: {specs[w].says}",
          [{"id": pid, "site": list(cat.point(pn).sites), "action": {"kind": "none", "record_callers": True},
            "gate": {"occurrence": {"mode": "every"}}, "required": False}  # a point a workload never reaches
           for pid, pn in probes_by[w].items()], workload_extra(specs[w]))  # is a row less, not a failed clean run
         for w in names]))
    ro = RunOptions(scenario_path=probe_file, python=python, evidence_root=opts.evidence_root, label="hunt-baseline",
                           requests=opts.requests, pythonpath_prepend=prepend, command_line=opts.command_line)
    try:
        p0 = runs.prepare(ro, label_default="hunt-baseline", variants=[vname[w] for w in names])
    except RunError as e:
        raise HuntError(str(e)) from None
    result.baseline = p0.evidence.path
    observe("baseline", {"evidence": str(p0.evidence.path)})
    session = _session(runs, p0, observe)
    done: dict[str, Any] = {}
    items = [VariantItem(vname[w], command=(opts.command_line or f"repro hunt {opts.scenario_path}") + f"  # clean run, workload {w}",
                         session_info={"hunt": str(hf), "workload": w}) for w in names]
    log_path = p0.evidence.server_log.path
    t0 = time.time()
    try:
        run_variants(session, ro, items, lambda d: done.__setitem__(d.item.variant, d), settle_s=SETTLE_S,
                     before=lambda i, item: (f"budget of {opts.budget_min:.1f} min ended before this clean run"
                                             if clock.remaining <= 0 else None),
                     max_restart_failures=MAX_RESTART_FAILURES, finish=runs.finish_evidence, snapshot=runs.snapshot_session,
                     on_not_run=lambda rest, why: log.event("baseline_not_run", variants=[x.variant for x in rest], why=why))
    finally:
        session.stop()
        session.close_drivers()
        p0.evidence.set_status("complete")
    log.header["baseline_s"] = round(time.time() - t0, 1)
    versions = runs.collect_versions(p0.evidence.injector_dir, p0.python, adapter)
    log.header.update(version_header(versions, adapter))
    seen = read_seen(p0.evidence.injector_dir, server_injector_dirs(p0.evidence.path))
    baselines: list[dict] = []
    rows_by: dict[str, list[Row]] = {}
    for w in names:
        d = done.get(vname[w])
        spec = specs[w]
        entry: dict = {"workload": w, "says": spec.says, "verdict": NOT_RUN, "reason": "the budget ended before this clean run"}
        if d is not None:
            st, v = d.outcome.state, d.outcome.verdict
            entry.update(verdict=v.verdict, reason=v.reason, evidence=str(d.run_dir.path),
                         ok=st.ok if st else 0, aborted=st.aborted if st else 0, failed=st.failed if st else 0,
                         admin=admin_summary(st.admin if st else ()), burst_s=round(d.outcome.timings.get("burst_s", 0.0), 1))
            if spec.expect_log:
                text = log_since(log_path, d.log_offset)
                hits = {pat: len(re.findall(pat, text)) for pat in spec.expect_log}
                entry["log"] = "; ".join(f"'{k}' ×{n}" if n else f"no '{k}' (the nemesis did not take effect)" for k, n in hits.items())
            if v.verdict in (DEADLOCKED, DESYNCED):
                entry["finding"] = str(write_workload_finding(base, opts, cat, w, spec, d, hf))
                result.findings.append(entry["finding"])
        baselines.append(entry)
        result.workload_baselines.append(log.event("workload_baseline", **entry))
        ids = probes_by[w]
        rows_by[w] = rows_from_seen(cat, [e for e in seen if e.get("id") in ids], ids)
    log.header["workload_baselines"] = baselines
    quiet = next((b for b in baselines if b["workload"] == QUIET), None)
    if quiet is not None and quiet["verdict"] not in (SUCCEEDED, NOT_RUN):
        raise HuntError(f"the clean baseline burst did not succeed ({quiet['verdict']}: {quiet.get('reason', '')}); a hunt "
                        f"needs a healthy base scenario. Evidence: {quiet.get('evidence') or p0.evidence.path}")
    all_probes = {k: v for w in names for k, v in probes_by[w].items()}
    rows = rows_from_seen(cat, seen, all_probes)
    seen_points = {r.point for r in rows}
    log.header["points_not_seen"] = [p.name for p in points if p.name not in seen_points]
    log.set_rows(rows)
    log.event("baseline", evidence=str(p0.evidence.path), seen=len(seen), rows=len(rows), healthy_s=session.healthy_s,
              rows_by_workload={w: len(r) for w, r in rows_by.items()})
    observe("rows", {"rows": rows, "not_seen": log.header["points_not_seen"]})
    trials: list[Trial] = []
    for w in names:
        trials += plan_trials(cat, rows_by[w], ranks, opts.perturbations, workload="" if w == QUIET else w,
                              first_n=len(trials) + 1)
    if opts.clean_only:
        log.event("clean_only", trials_planned=len(trials))
        trials = []
    log.header["trials_total"] = len(trials)
    if trials:
        _trial_phase(runs, base, cat, trials, hf, log, clock, observe, opts, python, prepend)
    log.finish("complete", wall_s=clock.elapsed)
    return rows
