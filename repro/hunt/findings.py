"""What a hunt writes for what it found: each deadlocked or desynced trial's ready-to-run regression scenario
(:func:`finding_scenario`), FINDING-<workload>.md for a workload that hung with no perturbation, and FINDING.md for a
confirmed new deadlock or desync, written so a maintainer can file it upstream.

FINDING.md is written by ``repro hunt --confirm`` for every trial whose scenario file, re-run on a fresh server, ended the same way
(``TrialResult.confirmed``) in a scheduling/cache collective, not a known issue and not by construction. One file
per finding, ``findings/<trial>/FINDING.md`` in the hunt folder: the hazard in one paragraph, why the value can
differ across ranks in production (the rank-local state that feeds it: from the catalogue point's ``what`` and,
for a discovered point, the guard the scan found), the minimal scenario, the evidence, the divergent collective, a
fix direction, and beside it an honest "tried and tolerated" list (every other trial of the same point that every
rank survived). Nothing is written when there is no finding; HUNT.md then says what was searched.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional, Sequence

from repro import evidence as ev
from repro.catalogue import Catalogue, short_frame
from repro.hunt.classify import Diagnosis, diagnose, hazard_statement
from repro.hunt.options import HuntOptions
from repro.hunt.plan import Trial, trial_seed
from repro.hunt.report import rel_path, report_of
from repro.hunt.workloads import workload_extra
from repro.scenario_toml import scenario_toml
from repro.verdict import DEADLOCKED, DESYNCED, SUCCEEDED

_FIX = {
    "break": "take the decision once per tick from a value every rank agrees on (all_reduce MIN of the rank-local "
             "value before the loop), or run the collective-reaching work for the whole queue in a pre-pass before any "
             "rank-local `break` (the shape of the known fix of this family: a bulk pre-pass such as "
             "`bulk_check_prefetch_progress`)",
    "return": "agree on the early-return condition across the TP group first (one all_reduce of the condition), or "
              "move the collective before the rank-local check",
    "continue": "make the skip decision from an agreed value, or issue the collective for every element before "
                "skipping",
    "branch": "reduce the condition across the TP group (all_reduce MIN/MAX) before branching around the collective",
}


def finding_markdown(r: Any, cat: Any, base_path: Path, tolerated: Sequence[Any], candidates: Sequence[Any],
                     folder: Path) -> str:
    """The FINDING.md text of one confirmed trial ``r`` (a ``repro.hunt.TrialResult``)."""
    t = r.trial
    point = cat.point(t.row.point)
    d = r.diagnosis
    guard = candidates[0].guard if candidates else ""
    coll = d.collective if d else "?"
    others = ", ".join(str(k) for k in sorted(set(range(max([*d.in_ranks, t.rank]) + 1)) - set(d.in_ranks))) if d else "?"
    nature = t.perturbation.nature
    trigger = (f"**Trigger: natural** — an environment nemesis (`{t.perturbation.action.get('kind')}`: "
               f"{t.perturbation.says}) on rank {t.rank}; the engine's own bookkeeping was not forced."
               if nature == "natural" else
               f"**Trigger: forced** — `{point.name}` {t.perturbation.says} on rank {t.rank} (`"
               f"{t.perturbation.action.get('kind')}` changes the engine's own bookkeeping). Precondition not shown: "
               "no natural trigger (clock, storage, completion event, OS scheduling, exception) was found to make "
               "this value differ on one rank.")
    lines = [f"# Finding: {point.name} {t.perturbation.says} on rank {t.rank} deadlocks the TP group", "",
             trigger, "",
             "## Hazard", "",
             (f"In `{short_frame(t.row.caller)}` ({t.row.where}), the rank-local value of `{short_frame(point.sites[0])}` steers "
              f"control flow around a collective. When it {t.perturbation.says} on rank {t.rank} only, that rank "
              f"takes another path than its peers in the same scheduler tick: rank(s) "
              f"{', '.join(map(str, d.in_ranks)) if d else '?'} wait in {coll} and rank(s) {others} never issue it, "
              f"so the TP group hangs (no timeout below gloo's 120 min default)."), "",
             "## Why the value can differ across ranks in production", "",
             f"- {point.what or 'a value each rank computes on its own'}."]
    for c in candidates[:3]:
        lines.append(f"- {c.why}.")
    lines += ["- Nothing reduces it across the TP group before the decision: each rank reads its own pool/clock/queue, "
              "whose state depends on that rank's own timing (frees, transfers, polls).", "",
              "## Minimal scenario", "",
              f"`{rel_path(r.scenario_file, folder)}` (written by the hunt from `{base_path}`): `repro run` it; it expects "
              "DEADLOCKED, and a fix turns it into ALL REQUESTS SUCCEEDED. The perturbation fires once, on one rank, "
              "gated on the call stack (never on timing).", "",
              "## Evidence", "",
              f"- trial `{t.name}`: {r.verdict} in {r.to_verdict_s:.1f} s, fired {dict(r.fired)}: "
              f"[{rel_path(r.evidence, folder)}]({report_of(r.evidence, folder)})",
              "- reproduced from its scenario file on a fresh server (`--confirm`)."]
    if r.ledger:
        lines.append(f"- collective ledger: {r.ledger}")
    lines += ["", "## Divergent collective", "", f"{coll}" + (f" — chain: {' ← '.join(d.chain[:6])}" if d and d.chain else ""),
              "", "## Fix direction", "", _FIX.get(guard, _FIX["branch"]) + ".", "",
              "## Tried and tolerated", ""]
    if not tolerated:
        lines.append("Nothing else was tried on this point.")
    for x in tolerated:
        lines.append(f"- `{x.trial.name}` ({x.trial.row.where}): {x.verdict}; fired {dict(x.fired)}")
    return "\n".join(lines) + "\n"


def write_findings(log: Any, cat: Any, base: Any, base_path: Path, disc: Optional[Any] = None) -> list[Path]:
    """One FINDING.md per confirmed finding of the hunt ``log`` (``repro.hunt.HuntLog``); returns their paths."""
    out = []
    cands_by_point = {}
    if disc is not None:
        for p in disc.added:
            cands_by_point[p.name] = list(p.candidates)
    for r in log.results:
        if not r.confirmed or r.scenario_file is None or r.trial.perturbation.by_construction:
            continue
        d = r.diagnosis
        if d is None or d.known:
            continue
        tolerated = [x for x in log.results if x.trial.row.point == r.trial.row.point and x.verdict == SUCCEEDED
                     and sum((x.fired or {}).values()) > 0]
        cands = [c for c in cands_by_point.get(r.trial.row.point, []) if (c.loop_var or None) == (r.trial.row.loop_var or None)] \
            or cands_by_point.get(r.trial.row.point, [])
        folder = ev.EvidenceDir.open(log.folder).finding_dir(r.trial.name)
        f = folder.finding.write(finding_markdown(r, cat, base_path, tolerated, cands, folder.path))
        log.event("finding", trial=r.trial.name, file=str(f))
        out.append(f)
    return out


def finding_scenario(base: Any, base_path: Path, catalogue: Catalogue, trial: Trial, diag: Optional[Diagnosis],
                     verdict: str = DEADLOCKED, extra: Optional[dict] = None) -> str:
    """The ready-to-run regression scenario of one DEADLOCKED (or DESYNCED) trial (variant ``finding``, expect
    deadlock / desync); ``extra``: the trial's workload (``abort`` / ``workload`` tables), so it runs under the same load."""
    point = catalogue.point(trial.row.point)
    inj = trial.injection(point.sites)
    inj["id"] = f"{trial.row.point}-{trial.perturbation.name}"
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"hunt_{trial.row.point}_{trial.perturbation.name}_r{trial.rank}")
    hazard = hazard_statement(trial, verdict, diag, 1, 1, base.server.tp_size)
    comment = (f"Written by `repro hunt` from {base_path} (trial {trial.name}).\n{hazard}\n"
               f"Run: repro run <this file>   (expects {verdict}; a fix makes it ALL REQUESTS SUCCEEDED)")
    base = base.model_copy(update={"burst": base.burst.model_copy(update={"seed": trial_seed(base, trial)})})
    return scenario_toml(base, name, f"repro hunt finding: {hazard}",
                         [("finding", "desync" if verdict == DESYNCED else "deadlock", f"rank {trial.rank}: {point.name} {trial.perturbation.says} at {trial.row.where}"
                           + (f" under workload {trial.workload}" if trial.workload else ""), [inj], extra or {})],
                         mirrors=(diag.known if diag and diag.known else ""), comment=comment)


def write_workload_finding(base: Any, opts: HuntOptions, cat: Catalogue, w: str, spec: Any, d: Any, hf: Path) -> Path:
    """A clean workload that deadlocked or desynced: its scenario file (no injection) and FINDING-<workload>.md."""
    v = d.outcome.verdict
    diag = None
    if v.verdict == DEADLOCKED and d.outcome.analysis is not None:
        a = d.outcome.analysis
        diag = diagnose(a.to_dict() if hasattr(a, "to_dict") else a, cat)
    store = ev.EvidenceDir.open(hf)
    sc = store.hunt_scenario(ev.Layout.workload_scenario(w))
    expect = "desync" if v.verdict == DESYNCED else "deadlock"
    ev.write_text_atomic(sc, scenario_toml(base, re.sub(r"[^A-Za-z0-9_.-]+", "_", f"hunt_workload_{w}"),
                                f"repro hunt: the engine {v.verdict} under workload {w} with no perturbation",
                                [("finding", expect, spec.says, [], workload_extra(spec))],
                                comment=f"Written by `repro hunt` from {opts.scenario_path}: workload {w}, no injection.\n"
                                        f"Run: repro run <this file>   (expects {v.verdict})"))
    finding = store.workload_finding(w)
    lines = [f"# {v.verdict} under workload `{w}`, with no perturbation", "",
             "**Trigger: natural** — the workload alone (client-side load and admin calls), no injected perturbation.", "",
             f"**The load:** {spec.says}. Engine flags: `{' '.join(base.server.args)}`.", "",
             f"**What happened:** {v.reason}", ""]
    if diag is not None:
        lines += [f"**Divergent collective:** {diag.collective} (family: {diag.family}; ranks in it: "
                  f"{', '.join(map(str, diag.in_ranks)) or '?'})", ""]
        lines += [f"- rank {k}: {where}" for k, where in sorted(diag.where.items())] + [""]
    lines += [f"**Minimal scenario:** [`{rel_path(sc, hf)}`]({rel_path(sc, hf)}) (`repro run {sc}`).",
              f"**Evidence:** [{rel_path(d.run_dir.path, hf)}]({report_of(d.run_dir.path, hf)}).", "",
              "**Not yet confirmed** from the scenario file on a fresh server; re-run it before filing upstream."]
    return finding.write("\n".join(lines) + "\n")
