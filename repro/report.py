"""REPORT.md: the PR-ready page of an evidence folder (GitHub-flavoured markdown).

First line: the verdict. Then the reason/diagnosis, what was injected and where it was entered/matched/fired per
rank, the per-rank table, the request summary, versions, the exact command to reproduce, raw stacks collapsed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from repro.diagnosis import md_cell
from repro.verdict import EXPECT_WORDS

MAX_STACK_CHARS = 60_000  # per rank file embedded in the report; the full file stays in stacks/
_md_escape = md_cell  # the one markdown escape (repro.diagnosis); old name kept for callers


def rank_table(analysis: Any) -> list[str]:
    """Markdown rows: rank → state → blocked in (op via wrapper) → caller chain."""
    lines = ["| rank | state | blocked in | via | caller chain (innermost first) |", "|---|---|---|---|---|"]
    for r in getattr(analysis, "ranks", []) or []:
        chain = " ← ".join(getattr(r, "caller_chain", []) or [])
        lines.append(
            f"| TP{r.rank} | {r.state} | {_md_escape(getattr(r, 'op', '') or getattr(r, 'blocked_frame', '') or '-')} | "
            f"{_md_escape(getattr(r, 'via', '') or '-')} | {_md_escape(chain or '-')} |"
        )
    return lines


def injection_table(checks: Sequence[Any], ranks: Sequence[int]) -> list[str]:
    """Markdown rows: injection → nature (natural / forced / observe) → site → per rank entered/matched/fired (after
    the last arming); then one bullet per rank where a natural action's fire had an outcome (``InjectionCheck.outcomes``:
    a fault's thread died, or caught it)."""
    if not checks:
        return ["(no injections in this variant)"]
    head = "| injection | nature | site | " + " | ".join(f"TP{k} entered/matched/fired" for k in ranks) + " |"
    lines = [head, "|---|---|---|" + "---|" * len(ranks)]
    for c in checks:
        cells = " | ".join(f"{c.entered.get(k, 0)} / {c.matched.get(k, 0)} / {c.fired.get(k, 0)}" for k in ranks)
        lines.append(f"| `{c.injection_id}` | {getattr(c, 'nature', '') or '?'} | `{c.site}` | {cells} |")
    after = [f"- `{c.injection_id}` on TP{k}: {_md_escape(o)}"
             for c in checks for k, outs in sorted((getattr(c, "outcomes", None) or {}).items()) for o in outs]
    return lines + ([""] + after if after else [])


def requests_summary(state: Any) -> list[str]:
    if state is None:
        return ["(no requests were sent)"]
    out = [f"{state.total} requests: {state.ok} succeeded, {state.failed} failed, {state.outstanding} outstanding, {state.pending} never sent."]
    bad = [r for r in state.requests if not r.succeeded][:10]
    if bad:
        out += ["", "| request | status | output ids | finish | error |", "|---|---|---|---|---|"]
        for r in bad:
            out.append(f"| {r.index} | {r.status} | {r.output_len}/{r.max_new_tokens} | {r.finish_reason or '-'} | {_md_escape(r.error or '-')[:200]} |")
    return out


def stacks_details(stacks_dir: Path) -> list[str]:
    out: list[str] = []
    for f in sorted(Path(stacks_dir).glob("*.txt")):
        text = f.read_text(encoding="utf-8", errors="replace")
        if len(text) > MAX_STACK_CHARS:
            text = text[:MAX_STACK_CHARS] + f"\n… (truncated; full dump in stacks/{f.name})"
        out += [f"<details><summary><code>stacks/{f.name}</code></summary>", "", "```", text.rstrip(), "```", "", "</details>", ""]
    return out or ["(no stacks were captured: no stall was detected)"]


def diagnosis_lines(analysis: Any, ledger_diag: Any = None, timeline: Optional[str] = None) -> list[str]:
    """The "Diagnosis" section: the ledger's first divergence (sentence, aligned table, timeline) when a ledger
    was recorded, then the stack analysis' summary and per-rank table (the fallback without a ledger)."""
    out: list[str] = []
    if ledger_diag is not None:
        out += ledger_diag.markdown_lines(timeline)
    if getattr(analysis, "summary", None):
        out += [("**Stacks:** " if ledger_diag is not None else "") + str(analysis.summary), ""]
        out += rank_table(analysis) + [""]
    if not out:
        return []
    return ["## Diagnosis", ""] + out


@dataclass(frozen=True)
class ReportInput:
    """Everything REPORT.md says, as the stages already hold it (nothing is re-read from the folder).

    Attributes:
        scenario: scenario name; mirrors / description: what it mirrors (may be empty).
        variant / variant_expects / variant_description: the variant this run drove and its expected verdict word.
        has_injections: the variant has injections (an empty ``checks`` then means "records not read").
        verdict: ``repro.verdict.Verdict`` (verdict, reason, notes).
        analysis: ``repro.analysis.Analysis`` of the deciding (or last) capture, or None when none was taken.
        requests: the driver's final ``DriverState`` (None when no burst was sent).
        ranks: the ranks of the server (rank pids' keys, else ``range(tp_size)``).
        checks: ``repro.verdict.InjectionCheck`` per injection (counts after the last arming).
        timings: seconds by phase; versions: what ``env.json`` holds (``repro.evidence.EnvRecord`` fields).
        command: the exact command to reproduce; ledger: ``repro.ledger.LedgerDiagnosis`` (None: no ledger).
        timeline: file name of the timeline picture in the folder when one was written, else None.
        stacks_dir: the folder's ``stacks/`` (raw dumps embedded collapsed).
        sections: markdown lines the report ends with (a multi-server run's "Servers" section, ``repro.pd``).
    """

    scenario: str
    variant: str
    variant_expects: str
    verdict: Any
    stacks_dir: Path
    command: str
    mirrors: str = ""
    description: str = ""
    variant_description: str = ""
    has_injections: bool = False
    analysis: Any = None
    requests: Any = None
    ranks: Sequence[int] = ()
    checks: Sequence[Any] = ()
    timings: Mapping[str, float] = field(default_factory=dict)
    versions: Mapping[str, Any] = field(default_factory=dict)
    ledger: Any = None
    timeline: Optional[str] = None
    sections: Sequence[str] = ()


def render_report(r: ReportInput) -> str:
    """REPORT.md's text (GitHub-flavoured markdown): verdict line, diagnosis, reason, injections, requests,
    timings, versions, the command to reproduce, raw stacks."""
    verdict = r.verdict
    state = getattr(r.ledger, "state", None)
    diverged = " (the ranks' lockstep state diverged)" if getattr(state, "diverged", False) else ""
    lines = [f"# {verdict.verdict} — {r.scenario} / {r.variant}{diverged}", ""]
    lines += diagnosis_lines(r.analysis, r.ledger, r.timeline)
    lines += [f"**Reason:** {verdict.reason}", ""]
    if r.mirrors or r.description:
        lines += [f"Scenario mirrors {r.mirrors or '-'}: {r.description.strip()}", ""]
    met = ""
    if r.variant_expects in EXPECT_WORDS:  # say whether the run gave what its variant is there to show
        met = (" — this run gave it, as the variant is written to" if EXPECT_WORDS[r.variant_expects] == verdict.verdict
               else f" — this run gave {verdict.verdict} instead")
    lines += [f"Variant `{r.variant}` expects **{r.variant_expects}**{met}. {r.variant_description.strip()}", ""]
    notes = list(getattr(verdict, "notes", ()) or ())
    lines += [f"- {n}" for n in notes] + ([""] if notes else [])
    inj = (injection_table(r.checks, list(r.ranks)) if r.checks or not r.has_injections else
           ["(injector records not read: no rank process was running — the server never became healthy)"])
    lines += ["## Injections (counted after the last arming)", ""] + inj + [""]
    lines += ["## Requests", ""] + requests_summary(r.requests) + [""]
    lines += ["## Timings (seconds)", "", timings_line(r.timings), ""]
    lines += ["## Versions", ""] + [f"- {k}: `{v}`" for k, v in r.versions.items()] + [""]
    lines += ["## Reproduce", "", "```", r.command, "```", ""]
    lines += ["## Raw stacks", ""] + stacks_details(r.stacks_dir)
    if r.sections:  # after the raw stacks, as one paragraph apart
        while lines and lines[-1] == "":
            lines.pop()
        lines += list(r.sections)
    return "\n".join(lines) + "\n"


def timings_line(timings: Mapping[str, float]) -> str:
    """The report's timings: seconds to one decimal, then ``captures`` (a count of stack captures, stall rule and
    ledger proof together; ``repro.run.session``) as a whole number said to be a count; ``-`` when none."""
    secs = ", ".join(f"{k} {v:.1f}" for k, v in timings.items() if k != "captures")
    if "captures" not in timings:
        return secs or "-"
    count = f"stack captures taken: {int(timings['captures'])}"
    return f"{secs}; {count}" if secs else count


def write_report(evd: Any, report: ReportInput) -> Path:
    """Write ``REPORT.md`` (:func:`render_report`) into ``evd`` (a ``repro.evidence.EvidenceDir``); returns its path."""
    return evd.report.write(render_report(report))
