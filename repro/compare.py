"""``repro compare``: the same scenario, variant, burst and seed against two versions of the engine (docs/adapters.md: REF locations).

A *REF* names the code a side runs (``installed``, ``patch:FILE``, ``git:PATH@REV``, ``python:PATH``,
``release:V``, ``release:V+patch:FILE``): :mod:`repro.refs` parses and materialises them.

Every REF is checked and materialised before any server starts (a patch that does not apply, a missing rev, an
unknown kind → :class:`CompareError`, one line naming the fix). Materialised folders are removed on every outcome,
including Ctrl-C/SIGTERM (the CLI turns SIGTERM into KeyboardInterrupt). Both sides then run one after the other
with ``repro.runner`` (each its own evidence folder) and ``COMPARISON.md`` in a compare folder links both.

This module never imports sglang and names no engine: where the engine's package lives (its name, the folder of a
source checkout that holds it) is the adapter's ``ref_location`` (``repro.targets.base.RefLocation``; SGLang:
``sglang/``, ``python/`` in a checkout), and the installed package is located by running the target interpreter.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from repro import evidence as ev
from repro.diagnosis import md_cell, where_of
from repro.verdict import EXIT_MISMATCH, EXPECT_WORDS
from repro.refs import (  # noqa: F401  REF handling lives in repro.refs; these names stay importable from here
    REF_KINDS, OVERLAY_PREFIX, WORKTREE_PREFIX, LOCATE_TIMEOUT_S, GIT_TIMEOUT_S, OWNER_FILE, Materialized, Ref,
    RefError, check_patch_applies, make_overlay, make_worktree, materialize, package_location, parse_ref, patch_files, patch_strip, remove_worktree, resolve_git_rev, sweep_stale)


DEFAULT_EXPECT_BEFORE = "deadlock"
DEFAULT_EXPECT_AFTER = "success"
SIDES = ("before", "after")

CompareError = RefError
"""Bad input for ``repro compare`` found before any server started (one line naming the fix): a bad REF
(``repro.refs.RefError``, the same class) or a bad option."""


# ------------------------------------------------------------------------------------------------- comparing
@dataclass
class CompareOptions:
    """What ``repro compare`` was asked. ``expect_*`` are words of ``repro.verdict.EXPECT_WORDS``."""

    scenario_path: Path
    before: str
    after: str
    variant: Optional[str] = None
    python: Optional[str] = None
    model: Optional[str] = None
    tp: Optional[int] = None
    label: Optional[str] = None
    evidence_root: Path = ev.DEFAULT_EVIDENCE_DIR
    requests: Optional[int] = None
    expect_before: str = DEFAULT_EXPECT_BEFORE
    expect_after: str = DEFAULT_EXPECT_AFTER
    native: bool = False
    only: Optional[str] = None  # "before" / "after": run one side (the per-side reproduce command)
    tmp_parent: Optional[Path] = None


@dataclass(frozen=True)
class RankFacts:
    """One rank on one side: counts per injection id (entered, matched, fired) and where it was blocked."""

    rank: int
    counts: dict
    where: str = ""
    state: str = ""
    caller_chain: tuple[str, ...] = ()


@dataclass(frozen=True)
class SideResult:
    """One side of a comparison.

    Attributes:
        side: ``before`` / ``after``; ref / description: what code ran; expect: the expected word.
        verdict, reason, notes: from the run; exit_code: the run's verdict code (0/3/4);
        matched: the verdict is the expected one; evidence: the run's folder;
        to_verdict_s / healthy_s / last_progress_to_verdict_s / total_s: seconds (None if not reached);
        requests_ok / requests_total: the burst; ranks: per-rank facts; command: reproduces this side alone.
    """

    side: str
    ref: str
    description: str
    expect: str
    verdict: str
    reason: str
    notes: tuple[str, ...]
    matched: bool
    evidence: Path
    timings: dict
    requests_ok: int
    requests_total: int
    ranks: tuple[RankFacts, ...]
    injections: tuple[tuple[str, str], ...]  # (id, site)
    versions: dict
    command: str
    fires: tuple[tuple[Optional[int], str, str, Optional[bool]], ...] = ()  # (rank, injection id, caller, completed)
    ledger: dict = field(default_factory=dict)  # rank -> ledger_summary() of that rank (empty: no ledger)
    state: Optional[dict] = None  # verdict.json's state_divergence (repro.state_digest); None: not recorded


@dataclass(frozen=True)
class CompareResult:
    """Both sides, the compare folder (COMPARISON.md, compare.json), the exit code and the wall time in seconds."""

    sides: tuple[SideResult, ...]
    folder: Path
    exit_code: int
    wall_s: float


Observer = Callable[[str, dict], None]


def _noop(event: str, data: dict) -> None:
    pass


def side_command(opts: CompareOptions, side: str) -> str:
    """The command line that reproduces one side alone (``repro compare … --only SIDE``)."""
    argv = ["repro", "compare", str(opts.scenario_path)]
    if opts.variant:
        argv += ["--variant", opts.variant]
    argv += ["--before", opts.before, "--after", opts.after]
    if opts.python:
        argv += ["--python", opts.python]
    if opts.model:
        argv += ["--model", opts.model]
    if opts.tp:
        argv += ["--tp", str(opts.tp)]
    if opts.requests:
        argv += ["--requests", str(opts.requests)]
    if opts.expect_before != DEFAULT_EXPECT_BEFORE:
        argv += ["--expect-before", opts.expect_before]
    if opts.expect_after != DEFAULT_EXPECT_AFTER:
        argv += ["--expect-after", opts.expect_after]
    argv += ["--only", side]
    return shlex.join(argv)


def compare_command(opts: CompareOptions) -> str:
    """The command line that reproduces the whole comparison."""
    return side_command(opts, "before").rsplit(" --only", 1)[0]


def _validate(opts: CompareOptions) -> tuple[Any, Any]:
    from repro.scenario import ScenarioError, load_scenario

    for word, name in ((opts.expect_before, "--expect-before"), (opts.expect_after, "--expect-after")):
        if word not in EXPECT_WORDS:
            raise CompareError(f"{name} must be deadlock, success or inconclusive, or desync (got {word!r})")
    if opts.only is not None and opts.only not in SIDES:
        raise CompareError(f"--only must be before or after (got {opts.only!r})")
    try:
        scen = load_scenario(opts.scenario_path)
        var = scen.variant(opts.variant)
    except ScenarioError as e:
        raise CompareError(str(e)) from None
    return scen, var


def _adapter_of(scen: Any) -> Any:
    from repro.targets.registry import UnknownAdapterError, get_adapter

    try:
        return get_adapter(scen.server.adapter)
    except UnknownAdapterError as e:
        raise CompareError(f"server.adapter: {e}") from None


def default_run_side(run_opts: Any, observe: Observer) -> Any:
    """Run one side with the real runner (``repro.runner.run``); tests may pass another callable."""
    from repro.runner import run

    return run(run_opts, observe)


def default_check_side(run_opts: Any) -> None:
    """Check one side as its run will (``repro.runner.check_launch``: inputs, interpreter, every site on that side's
    PYTHONPATH) without launching; raises ``repro.runner.RunError``."""
    from repro.runner import check_launch

    check_launch(run_opts)


def run_compare(opts: CompareOptions, observe: Observer = _noop, run_side: Callable[[Any, Observer], Any] = default_run_side,
                check_side: Optional[Callable[[Any], None]] = None) -> CompareResult:
    """Check both REFs, run before then after, write COMPARISON.md; remove every overlay/worktree on every outcome.

    Args:
        opts: the comparison.
        observe: progress callback ``(event, data)``: ``side`` (``{"side", "ref", "description"}``) and the
            runner's own events.
        run_side: runs one ``repro.runner.RunOptions`` and returns a ``RunResult`` (default: the real runner).
        check_side: checks one side's ``RunOptions`` before either side runs (a site absent on the after side's
            code is refused before the before side's server starts); default :func:`default_check_side` with the
            real runner, nothing with a stand-in ``run_side``.
    Returns:
        A :class:`CompareResult`; ``exit_code`` 0 iff every side run matched its expectation, else 5.
    Raises:
        CompareError: bad input (scenario, variant, REF, patch, rev, interpreter, expect word), before any launch.
        repro.runner.RunError: a side could not be prepared (bad override), before its launch.
        KeyboardInterrupt: after the running side tore its server down and every materialised REF was removed.
    """
    from repro.runner import RunOptions

    t0 = time.time()
    scen, var = _validate(opts)
    adapter = _adapter_of(scen)
    refs = {"before": parse_ref(opts.before), "after": parse_ref(opts.after)}
    sweep_stale(opts.tmp_parent)
    wanted = [opts.only] if opts.only else list(SIDES)
    expects = {"before": opts.expect_before, "after": opts.expect_after}
    label = opts.label or var.name
    results: list[SideResult] = []
    with ExitStack() as stack:
        mats: dict[str, Materialized] = {}
        for side in wanted:  # every REF checked and materialised before the first server starts
            m = materialize(refs[side], opts.python, adapter, tmp_parent=opts.tmp_parent)
            stack.callback(m.close)
            mats[side] = m
        if check_side is None and run_side is default_run_side:
            check_side = default_check_side
        side_opts = {}
        for side in wanted:
            m = mats[side]
            cmd = side_command(opts, side)
            side_opts[side] = RunOptions(scenario_path=opts.scenario_path, variant=var.name, python=m.python,
                                         model=opts.model, tp=opts.tp, label=f"{label}-{side}",
                                         evidence_root=opts.evidence_root, requests=opts.requests,
                                         expect=expects[side], native=opts.native, command_line=cmd,
                                         pythonpath_prepend=tuple(m.pythonpath_prepend))
            if check_side is not None:  # every side's sites before the first server starts
                check_side(side_opts[side])
        for side in wanted:
            m = mats[side]
            observe("side", {"side": side, "ref": m.ref.text, "description": m.description})
            ro = side_opts[side]
            cmd = ro.command_line
            res = run_side(ro, observe)
            results.append(side_result(side, m, expects[side], res, var, cmd))
    wall = time.time() - t0
    exit_code = 0 if all(r.matched for r in results) else EXIT_MISMATCH
    folder = _compare_folder(opts.evidence_root, scen.name, label)
    result = CompareResult(tuple(results), folder, exit_code, wall)
    write_comparison(result, opts, scen.name, var.name, adapter, scen.server.args)
    return result


def _compare_folder(root: Path, scenario: str, label: str) -> Path:
    return ev.unique_folder(root, scenario, "compare", label)


def side_result(side: str, m: Materialized, expect: str, res: Any, variant: Any, command: str) -> SideResult:
    """Collect one side's facts from its RunResult and evidence folder (fire logs, analysis, env.json)."""
    from repro import injection_records

    evdir = Path(res.evidence)
    verdict = res.verdict.verdict
    ranks: dict[int, dict] = {}
    injections = tuple((i.id, i.site[0]) for i in variant.injections)
    fires: tuple = ()
    try:
        rep = getattr(res, "injector", None)  # the records the run already read (not re-read)
        if rep is None:
            rep = injection_records.read_injector_dir(ev.EvidenceDir.open(evdir).injector_dir)
        injections = tuple((i.id, rep.resolved_site(i.id) or i.site[0]) for i in variant.injections)
        fires = tuple((rep.rank_of(f.pid), f.injection_id, f.caller, f.completed) for f in rep.fires())
        for inj in variant.injections:
            c = rep.counts_by_rank(inj.id)
            for key in ("entered", "matched", "fired"):
                for rank, n in c[key].items():
                    ranks.setdefault(rank, {}).setdefault(inj.id, {"entered": 0, "matched": 0, "fired": 0})[key] = n
    except Exception:
        pass
    where: dict[int, tuple[str, str, tuple[str, ...]]] = {}
    analysis = getattr(res, "analysis", None)
    for r in getattr(analysis, "ranks", None) or []:
        chain = tuple(c for c in (getattr(r, "caller_chain", None) or []) if not c.startswith("[injected]"))
        where[r.rank] = (where_of(r, depth=6), getattr(r, "state", ""), chain)
        ranks.setdefault(r.rank, {})
    facts = tuple(RankFacts(k, ranks[k], *where.get(k, ("", "", ()))) for k in sorted(ranks))
    try:
        versions = ev.EvidenceDir.open(evdir).env.read(missing_ok=True)
        versions = versions.to_json() if versions is not None else {}
    except ev.EvidenceFileError:
        versions = {}
    ledger = ledger_summary(evdir)
    state = state_of(evdir)
    return SideResult(
        side=side, ref=m.ref.text, description=m.description, expect=expect, verdict=verdict, reason=res.verdict.reason,
        notes=tuple(res.verdict.notes), matched=EXPECT_WORDS[expect] == verdict, evidence=evdir,
        timings=dict(res.timings or {}), requests_ok=res.requests_ok, requests_total=res.requests_total, ranks=facts,
        injections=injections, versions=versions if isinstance(versions, dict) else {}, command=command, fires=fires,
        ledger=ledger, state=state,
    )


def state_of(evidence: Path) -> Optional[dict]:
    """A side's first divergent lockstep state: its ``verdict.json``'s ``state_divergence``
    (``repro.state_digest.StateDivergence.to_dict``), or None when the folder has no verdict or was written without
    a digest (no ledger, or before the state digest)."""
    try:
        v = ev.EvidenceDir.open(evidence).verdict.read(missing_ok=True)
    except ev.EvidenceFileError:
        return None
    st = getattr(v, "state_divergence", None) if v is not None else None
    return dict(st) if isinstance(st, dict) else None


def state_line(state: Optional[dict]) -> str:
    """One phrase for a side's lockstep state: ``first divergent state at scheduler tick N: …``, ``equal through
    tick N (k probes compared)``, or why nothing was compared. Old folders read as not recorded, never as equal."""
    if not state:
        return "no state digest recorded (no ledger, or evidence written before the state digest)"
    status = state.get("status")
    if status == "diverged":
        return "first divergent state " + str(state.get("summary") or f"at scheduler tick {state.get('tick')}")
    if status == "equal":
        ticks = state.get("compared_ticks") or [None, None]
        n = len(state.get("probes_compared") or [])
        return f"equal through tick {ticks[-1]} (ticks {ticks[0]}–{ticks[-1]}, {n} probes compared)"
    return "not compared: " + str(state.get("summary") or "no digest recorded")


def state_verdict_note(sides: Sequence["SideResult"]) -> Optional[str]:
    """A sentence when the sides' state and verdicts tell apart a fix of the cause from one of the symptom."""
    by = {s.side: s for s in sides}
    b, a = by.get("before"), by.get("after")
    if b is None or a is None:
        return None
    bd = (b.state or {}).get("status") == "diverged"
    ad = (a.state or {}).get("status") == "diverged"
    ok = a.verdict == EXPECT_WORDS["success"]
    if ad and ok:
        return ("after: every request succeeded while the ranks' lockstep state still diverged "
                f"(tick {(a.state or {}).get('tick')}): the fix removes the symptom, not the drift.")
    if bd and (a.state or {}).get("status") == "equal":
        return "after: the lockstep state stayed equal on every rank: the drift itself is gone."
    return None


LEDGER_SITE_FRAMES = 4  # caller frames shown per collective call site
LEDGER_TOP_SITES = 4


def ledger_summary(evidence: Path) -> dict:
    """Per rank, what the collective ledger recorded in one run (``{}`` when the run has no ledger).

    Returns:
        rank -> ``{"collectives": n, "ticks": ticks spanned, "per_tick_mean": x, "per_tick_max": m,
        "sites": [[group, call site, count], ...] (most frequent first), "dropped": n}``; ticks are scheduler
        ticks as the ledger numbered them (``repro.ledger.per_tick_counts``).
    """
    try:
        from collections import Counter

        from repro.ledger import load_ledgers, per_tick_counts

        verdict = ev.EvidenceDir.open(evidence).verdict.read(missing_ok=True)
        pids = (verdict.pids() if verdict is not None else None) or None
        ledgers = load_ledgers(evidence, pids)
        counts = per_tick_counts(ledgers)
    except Exception:
        return {}
    out: dict = {}
    for rank, led in sorted(ledgers.items()):
        ticks = [r.tick for r in led.records]
        span = (max(ticks) - min(ticks) + 1) if ticks else 0
        per = list(counts.get(rank, {}).values())
        sites = Counter((led.groups[r.group].short() if r.group in led.groups else r.group, r.call_site(LEDGER_SITE_FRAMES))
                        for r in led.records)
        out[rank] = {
            "collectives": len(led.records), "ticks": span,
            "per_tick_mean": round(len(led.records) / span, 2) if span else 0.0, "per_tick_max": max(per, default=0),
            "sites": [[g, s, n] for (g, s), n in sites.most_common(LEDGER_TOP_SITES)], "dropped": led.dropped,
        }
    return out


# ------------------------------------------------------------------------------------------------ COMPARISON.md
def _s(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.1f} s"


_md = md_cell  # the one markdown escape (repro.diagnosis)


def tick_injection(sides: Sequence[SideResult], tick_function: str) -> Optional[str]:
    """The id of an injection whose site is the adapter's per-tick function (its entered count = scheduler ticks)."""
    if not tick_function:
        return None
    for s in sides:
        for iid, site in s.injections:
            if site == tick_function:
                return iid
    return None


def comparison_markdown(result: CompareResult, opts: CompareOptions, scenario: str, variant: str, tick_function: str = "",
                        engine_key: Optional[str] = None) -> str:
    """The text of COMPARISON.md: summary, per-side table, per-rank facts, collective counts, versions, commands."""
    folder = result.folder
    sides = result.sides
    ok = result.exit_code == 0
    lines = [f"# {scenario} / {variant}: {'as expected' if ok else 'MISMATCH'}", ""]
    for s in sides:
        mark = "as expected" if s.matched else f"expected {EXPECT_WORDS[s.expect]}"
        lines.append(f"- **{s.side}** (`{s.ref}`): **{s.verdict}** ({mark}) — {_md(s.reason)}")
        lines.append(f"  - state: {_md(state_line(s.state))}")
    note = state_verdict_note(sides)
    if note:
        lines += ["", f"**{note}**"]
    lines += ["", f"Exit code {result.exit_code}; whole compare wall time {result.wall_s:.1f} s.", ""]
    lines += ["| | " + " | ".join(s.side for s in sides) + " |", "|---|" + "---|" * len(sides)]
    rows = [
        ("ref", lambda s: f"`{s.ref}`"),
        ("code", lambda s: _md(s.description)),
        ("engine", lambda s: _md(engine_line(s.versions, engine_key) or "unknown")),
        ("verdict", lambda s: s.verdict),
        ("first divergent state", lambda s: _md(state_line(s.state))),
        ("expected", lambda s: EXPECT_WORDS[s.expect]),
        ("time to verdict (from launch)", lambda s: _s(s.timings.get("to_verdict_s"))),
        ("healthy after", lambda s: _s(s.timings.get("healthy_s"))),
        ("last progress → verdict", lambda s: _s(s.timings.get("last_progress_to_verdict_s"))),
        ("requests ok / stalled", lambda s: f"{s.requests_ok} / {s.requests_total - s.requests_ok} of {s.requests_total}"),
        ("evidence", lambda s: f"[{s.evidence.name}]({os.path.relpath(ev.Layout.REPORT.at(s.evidence), folder)})"),
    ]
    for name, fn in rows:
        lines.append(f"| {name} | " + " | ".join(fn(s) for s in sides) + " |")
    for s in sides:
        if s.notes:
            lines += ["", f"Notes ({s.side}):", ""] + [f"- {_md(n)}" for n in s.notes]

    lines += ["", "## Per rank", ""]
    for s in sides:
        ids = [i for i, _ in s.injections]
        lines += [f"### {s.side} (`{s.ref}`)", ""]
        if s.injections:
            lines += ["Injections: " + ", ".join(f"`{i}` at `{site}`" for i, site in s.injections), ""]
        head = "| rank | " + " | ".join(f"`{i}` entered / matched / fired" for i in ids) + " | where it was (last capture) |"
        lines += [head, "|---|" + "---|" * (len(ids) + 1)]
        for r in s.ranks:
            cells = []
            for i in ids:
                c = r.counts.get(i, {})
                cells.append(f"{c.get('entered', 0)} / {c.get('matched', 0)} / {c.get('fired', 0)}")
            where = _md(f"{r.state}: {r.where}") if r.where else "(not captured: no stall)"
            lines.append(f"| TP{r.rank} | " + " | ".join(cells) + f" | {where} |")
        if not s.ranks:
            lines.append("| - | " + " | ".join("-" for _ in ids) + " | (no records) |")
        lines.append("")
        if s.fires:
            done = {True: "action completed", False: "action raised", None: "action never returned (blocked)"}
            lines += ["Fired (fire log): " + "; ".join(
                f"TP{rank if rank is not None else '?'} `{iid}` called from `{caller}` ({done[c]})" for rank, iid, caller, c in s.fires[:10])
                + (f"; … {len(s.fires) - 10} more" if len(s.fires) > 10 else ""), ""]

    lines += ["## Collectives per rank per scheduler tick", ""]
    if any(s.ledger for s in sides):
        lines += [
            "From the collective ledger (every collective each rank entered, with its scheduler tick; whole run "
            "including start-up). `per tick` = collectives / ticks spanned (mean) and the busiest tick (max).", "",
            "| side | rank | collectives | ticks | per tick mean / max | most frequent call sites (group: count) |",
            "|---|---|---|---|---|---|",
        ]
        for s in sides:
            if not s.ledger:
                lines.append(f"| {s.side} | - | (no ledger) | | | |")
            for rank, d in sorted(s.ledger.items()):
                sites = "; ".join(f"`{site}` ({g}: {n})" for g, site, n in d["sites"])
                drop = f" ({d['dropped']} oldest dropped)" if d.get("dropped") else ""
                lines.append(f"| {s.side} | TP{rank} | {d['collectives']}{drop} | {d['ticks']} | "
                             f"{d['per_tick_mean']} / {d['per_tick_max']} | {_md(sites)} |")
        lines.append("")
    tick_id = tick_injection(sides, tick_function)
    lines += [
        "Counted by the injector's fire logs: `entered` is the "
        "number of calls of each injected site on each rank after arming. "
        + (f"`{tick_id}` counts scheduler ticks (`{tick_function}` runs once per tick), so the other sites are also "
           "shown per tick." if tick_id else "No per-tick site was counted, so counts are per run."),
        "",
    ]
    lines += ["| side | rank | " + ("ticks | " if tick_id else "") + "site calls (entered" + (", per tick" if tick_id else "") + ") |",
              "|---|---|" + ("---|" if tick_id else "") + "---|"]
    for s in sides:
        for r in s.ranks:
            ticks = r.counts.get(tick_id, {}).get("entered", 0) if tick_id else 0
            parts = []
            for i, _site in s.injections:
                if i == tick_id:
                    continue
                n = r.counts.get(i, {}).get("entered", 0)
                parts.append(f"`{i}` {n}" + (f" ({n / ticks:.2f}/tick)" if tick_id and ticks else ""))
            lines.append(f"| {s.side} | TP{r.rank} | " + (f"{ticks} | " if tick_id else "") + (", ".join(parts) or "-") + " |")
    lines += ["", "## Versions", ""]
    for s in sides:
        v = s.versions
        keys = ("testbed", "torch", "python", "target_python", "platform")
        head = engine_line(v, engine_key)
        lines.append(f"- {s.side}: " + ", ".join([*([head] if head else []), *(f"{k} {v[k]}" for k in keys if v.get(k))])
                     + f"; code: {_md(s.description)}")
    lines += ["", "## Reproduce", "", "Both sides:", "", "```", compare_command(opts), "```", ""]
    for s in sides:
        lines += [f"{s.side.capitalize()} only:", "", "```", s.command, "```", ""]
    return "\n".join(lines)


def engine_line(versions: dict, engine_key: Optional[str] = None) -> str:
    """``sglang 0.5.23`` from an env.json's ``engine`` / ``engine_version``; an older env.json (without them) by the
    engine's version key (``engine_key``: the adapter's ``ref_location.version_key``); "" when neither says."""
    if versions.get("engine"):
        return f"{versions['engine']} {versions.get('engine_version') or 'version unknown'}"
    if engine_key and versions.get(engine_key):
        return f"{engine_key} {versions[engine_key]}"
    return ""


def _tick_function_of(result: CompareResult, adapter: Any, server_args: Sequence[str]) -> str:
    """The per-tick function the sides' injectors counted ticks with: a side's ``plan.json`` (``ledger.tick_function``:
    what the runner compiled from the adapter's ``tick_function_for`` the server's args); without one, the run's
    adapter says it."""
    for side in result.sides:
        try:
            plan = json.loads(ev.EvidenceDir.open(side.evidence).plan.path.read_text())
            tf = (plan.get("ledger") or {}).get("tick_function")
        except (OSError, ValueError, TypeError, AttributeError):
            tf = None
        if tf:
            return tf
    return adapter.tick_function_for(server_args)


def write_comparison(result: CompareResult, opts: CompareOptions, scenario: str, variant: str, adapter: Any,
                     server_args: Sequence[str] = ()) -> Path:
    """Write ``COMPARISON.md`` and ``compare.json`` into ``result.folder``; returns the markdown's path.

    Args:
        adapter: the run's adapter (its tick function, its version key for sides whose env.json names no engine).
        server_args: the scenario's server args (the tick function when no side's plan names one).
    """
    tick_function = _tick_function_of(result, adapter, server_args)
    lc = adapter.ref_location
    md = comparison_markdown(result, opts, scenario, variant, tick_function, lc.version_key or lc.package)
    folder = ev.EvidenceDir.open(result.folder)
    path = folder.comparison.write(md + "\n")
    folder.compare_json.write(compare_json(result))
    return path


def compare_json(result: CompareResult) -> dict:
    """The comparison as plain JSON (what ``--json`` prints and ``compare.json`` holds)."""
    return {
        "exit_code": result.exit_code,
        "wall_s": round(result.wall_s, 3),
        "folder": str(result.folder),
        "comparison": str(Path(result.folder) / ev.Layout.COMPARISON.name),
        "sides": [
            {
                "side": s.side, "ref": s.ref, "description": s.description, "expect": s.expect, "verdict": s.verdict,
                "reason": s.reason, "notes": list(s.notes), "matched": s.matched, "evidence": str(s.evidence),
                "timings": {k: round(v, 3) for k, v in s.timings.items() if isinstance(v, (int, float))},
                "requests_ok": s.requests_ok, "requests_total": s.requests_total,
                "ranks": [{"rank": r.rank, "counts": r.counts, "state": r.state, "where": r.where,
                           "caller_chain": list(r.caller_chain)} for r in s.ranks],
                "versions": s.versions, "command": s.command,
                "fires": [{"rank": f[0], "injection": f[1], "caller": f[2], "completed": f[3]} for f in s.fires],
                "ledger": {str(k): v for k, v in s.ledger.items()},
                "state_divergence": s.state,
            }
            for s in result.sides
        ],
    }


def dumps(result: CompareResult) -> str:
    """``compare_json`` as a JSON string."""
    return json.dumps(compare_json(result), indent=2)
