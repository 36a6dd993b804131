"""REPORT.md: the PR-ready page of an evidence folder (GitHub-flavoured markdown).

First line: the verdict. Then the reason/diagnosis, what was injected and where it was entered/matched/fired per
rank, the per-rank table, the request summary, versions, the exact command to reproduce, raw stacks collapsed.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Optional, Sequence

from repro.evidence import read_json

MAX_STACK_CHARS = 60_000  # per rank file embedded in the report; the full file stays in stacks/


def _md_escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


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
    """Markdown rows: injection → site → per rank entered/matched/fired (after the last arming)."""
    if not checks:
        return ["(no injections in this variant)"]
    head = "| injection | site | " + " | ".join(f"TP{k} entered/matched/fired" for k in ranks) + " |"
    lines = [head, "|---|---|" + "---|" * len(ranks)]
    for c in checks:
        cells = " | ".join(f"{c.entered.get(k, 0)} / {c.matched.get(k, 0)} / {c.fired.get(k, 0)}" for k in ranks)
        lines.append(f"| `{c.injection_id}` | `{c.site}` | {cells} |")
    return lines


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


def diagnosis_lines(analysis: Any, ledger_diag: Any = None, timeline: Optional[str] = "timeline.svg") -> list[str]:
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


def write_report(p: Any, opts: Any, variant: Any, evd: Any, verdict: Any, analysis: Any, state: Any, rank_pids: dict,
                 checks: Sequence[Any], timings: dict, ledger_diag: Any = None) -> Path:
    """Write ``REPORT.md`` into ``evd`` (the run's evidence folder) and return its path.

    Args:
        p: the ``repro.runner.Prepared`` run (scenario, spec); ``variant`` the variant this run drove.
        analysis: ``repro.analysis.Analysis`` of the deciding (or last) capture, or None when none was taken.
        state: the driver's final ``DriverState`` (None when no burst was sent).
        checks: ``repro.verdict.InjectionCheck`` per injection; ``timings`` seconds by phase.
        ledger_diag: ``repro.ledger.LedgerDiagnosis`` of the run (None: no ledger recorded); the Diagnosis
            section comes first after the verdict line and links ``timeline.svg`` when that file exists.
    """
    ranks = sorted(rank_pids) or list(range(p.spec.tp_size))
    env = read_json(evd.file("env.json")) or {}
    lines = [f"# {verdict.verdict} — {p.scenario.name} / {variant.name}", ""]
    timeline = "timeline.svg" if evd.file("timeline.svg").exists() else None
    lines += diagnosis_lines(analysis, ledger_diag, timeline)
    lines += [f"**Reason:** {verdict.reason}", ""]
    if p.scenario.mirrors or p.scenario.description:
        lines += [f"Scenario mirrors {p.scenario.mirrors or '-'}: {p.scenario.description.strip()}", ""]
    lines += [f"Variant `{variant.name}` expects **{variant.expect}**. {variant.description.strip()}", ""]
    for n in getattr(verdict, "notes", ()):
        lines.append(f"- {n}")
    if getattr(verdict, "notes", ()):
        lines.append("")
    lines += ["## Injections (counted after the last arming)", ""] + (injection_table(checks, ranks) if checks or not variant.injections else ["(injector records not read: no rank process was running — the server never became healthy)"]) + [""]
    lines += ["## Requests", ""] + requests_summary(state) + [""]
    lines += ["## Timings (seconds)", "", ", ".join(f"{k} {v:.1f}" for k, v in timings.items()) or "-", ""]
    lines += ["## Versions", ""] + [f"- {k}: `{v}`" for k, v in env.items()] + [""]
    lines += ["## Reproduce", "", "```", (opts.command_line or f"repro run {shlex.quote(str(opts.scenario_path))} --variant {variant.name}"), "```", ""]
    lines += ["## Raw stacks", ""] + stacks_details(evd.stacks_dir)
    return evd.write_text("REPORT.md", "\n".join(lines) + "\n")
