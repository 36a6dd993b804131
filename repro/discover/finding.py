"""FINDING.md: a confirmed new deadlock or desync, written so a maintainer can file it upstream.

Written by ``repro hunt --confirm`` for every trial whose scenario file, re-run on a fresh server, ended the same way
(``TrialResult.confirmed``) in a scheduling/cache collective, not a known issue and not by construction. One file
per finding, ``findings/<trial>/FINDING.md`` in the hunt folder: the hazard in one paragraph, why the value can
differ across ranks in production (the rank-local state that feeds it: from the catalogue point's ``what`` and,
for a discovered point, the guard the scan found), the minimal scenario, the evidence, the divergent collective, a
fix direction, and beside it an honest "tried and tolerated" list (every other trial of the same point that every
rank survived). Nothing is written when there is no finding; HUNT.md then says what was searched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

_FIX = {
    "break": "take the decision once per tick from a value every rank agrees on (all_reduce MIN of the rank-local "
             "value before the loop), or run the collective-reaching work for the whole queue in a pre-pass before any "
             "rank-local `break` (the shape of the sglang#30760 fix: `bulk_check_prefetch_progress`)",
    "return": "agree on the early-return condition across the TP group first (one all_reduce of the condition), or "
              "move the collective before the rank-local check",
    "continue": "make the skip decision from an agreed value, or issue the collective for every element before "
                "skipping",
    "branch": "reduce the condition across the TP group (all_reduce MIN/MAX) before branching around the collective",
}


def _short(q: str) -> str:
    return q.split(":", 1)[-1]


def _rel(p: Any, base: Path) -> str:
    import os

    try:
        return os.path.relpath(Path(p).resolve(), base.resolve())
    except (TypeError, ValueError):
        return str(p)


def finding_markdown(r: Any, cat: Any, base_path: Path, tolerated: Sequence[Any], candidates: Sequence[Any],
                     folder: Path) -> str:
    """The FINDING.md text of one confirmed trial ``r`` (a ``repro.hunt.TrialResult``)."""
    t = r.trial
    point = cat.point(t.row.point)
    d = r.diagnosis
    guard = candidates[0].guard if candidates else ""
    coll = d.collective if d else "?"
    others = ", ".join(str(k) for k in sorted(set(range(max([*d.in_ranks, t.rank]) + 1)) - set(d.in_ranks))) if d else "?"
    lines = [f"# Finding: {point.name} {t.perturbation.says} on rank {t.rank} deadlocks the TP group", "",
             "## Hazard", "",
             (f"In `{_short(t.row.caller)}` ({t.row.where}), the rank-local value of `{_short(point.sites[0])}` steers "
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
              f"`{_rel(r.scenario_file, folder)}` (written by the hunt from `{base_path}`): `repro run` it; it expects "
              "DEADLOCKED, and a fix turns it into ALL REQUESTS SUCCEEDED. The perturbation fires once, on one rank, "
              "gated on the call stack (never on timing).", "",
              "## Evidence", "",
              f"- trial `{t.name}`: {r.verdict} in {r.to_verdict_s:.1f} s, fired {dict(r.fired)}: "
              f"[{_rel(r.evidence, folder)}]({_rel(r.evidence, folder)}/REPORT.md)",
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
    from repro.verdict import SUCCEEDED

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
        folder = log.folder / "findings" / r.trial.name
        folder.mkdir(parents=True, exist_ok=True)
        f = folder / "FINDING.md"
        f.write_text(finding_markdown(r, cat, base_path, tolerated, cands, folder), encoding="utf-8")
        log.event("finding", trial=r.trial.name, file=str(f))
        out.append(f)
    return out
