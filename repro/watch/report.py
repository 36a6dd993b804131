"""What a watch hang produced (:class:`HangOutcome`) and the watch's REPORT.md (:func:`watch_report`)."""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from repro import evidence as ev
from repro.watch.discovery import Discovery
from repro.watch.options import WatchOptions
from repro.watch.probes import HealthView


@dataclass
class HangOutcome:
    """What one declared hang produced.

    Attributes:
        verdict: ``DEADLOCKED`` (the DEADLOCKED rule held on two captures) or ``INCONCLUSIVE``.
        reason: one sentence.
        exit_code: 3 (hung with deadlock evidence) or 4 (hung without it).
        health: what /health said (:class:`HealthView`).
        evidence: the evidence folder written (None when nothing could be written anywhere).
        evidence_errors: paths that could not be written, with the reason.
        analysis: the confirming capture's ``repro.analysis.Analysis`` (None when nothing was captured).
        on_hang: the command's result (``rc``, ``duration_s``, ``timed_out``, ``output_tail``), or None if not run.
    """

    verdict: str
    reason: str
    exit_code: int
    health: HealthView
    evidence: Optional[Path] = None
    evidence_errors: list[str] = field(default_factory=list)
    analysis: Any = None
    on_hang: Optional[dict] = None


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int((t % 1) * 1000):03d}Z"


def watch_report(opts: WatchOptions, hang: dict, analysis: Any, history: Sequence[dict], disc: Discovery,
                 stacks_dir: Path, last_rounds: int = 15) -> str:
    """REPORT.md of a watch hang: verdict line first, the hang (what /health said), diagnosis + rank table,
    the probes before it, processes, metrics, what runs next, raw stacks."""
    from repro.diagnosis import md_cell
    from repro.report import rank_table, stacks_details

    lines = [f"# {hang['verdict']} — watch {opts.url}", "", f"**Reason:** {hang['reason']}", ""]
    h = hang["health_at_declaration"]
    ha = hang["health_after_capture"]
    lines += ["## Hang", "",
              f"- declared at {hang['declared_at']} after {hang['consecutive_failures']} consecutive failed generate "
              f"probes (first failure {hang['first_failure_at']}; probe timeout {opts.probe_timeout_s:g} s, "
              f"interval {opts.interval_s:g} s)",
              f"- last generate probe: `{json.dumps(hang['last_generate'])}`",
              f"- /health at declaration: **{h['kind']}** — {h['detail']}",
              f"- /health after capture: **{ha['kind']}** — {ha['detail']}", ""]
    st = hang.get("state_divergence")
    if st:  # seen live before the hang (repro.state_follow): the cause leads, the symptom follows
        lines += ["## Diagnosis", "", f"**First divergent state:** {md_cell(str(st.get('summary', '')))}", ""]
    if analysis is not None:
        lines += ([] if st else ["## Diagnosis", ""]) + [str(analysis.summary), ""] + rank_table(analysis) + [""]
        j = hang.get("judgement") or {}
        if j:
            cpu = ", ".join(f"TP{k} {v}%" for k, v in j.get("cpu_percent", {}).items())
            lines += [f"DEADLOCKED rule: {'holds' if j['deadlocked'] else 'does not hold'} — {j['reason']} "
                      f"(CPU between the two captures: {cpu or 'unknown'})", ""]
    servers = hang.get("servers") or {}
    if servers:
        shown = hang.get("diverged_server")
        lines += ["## Servers", "",
                  (f"**The {shown} server diverged**; the diagnosis above is its ranks'." if shown else
                   f"No server's ranks are deadlocked; the diagnosis above is the {stacks_dir.parent.name} server's."),
                  "Each server is captured and judged on its own (its ranks are its own TP group).", "",
                  "| server | ranks (pid) | deadlocked | reason | stacks |", "|---|---|---|---|---|"]
        for n, x in servers.items():
            ranks = ", ".join(f"{n} TP{k} ({pid})" for k, pid in x["rank_pids"].items())
            lines.append(f"| {n} | {ranks} | {x.get('deadlocked')} | {md_cell(str(x.get('reason', '')))[:300]} | "
                         f"`{x['stacks']}/` |")
        lines.append("")
    lines += ["## Probes before the hang", "", "| time | round | generate | health |", "|---|---|---|---|"]
    for r in list(history)[-last_rounds:]:
        g, hh = r.get("generate", {}), r.get("health", {})
        gtxt = f"{g.get('outcome')} {g.get('status') or ''} {g.get('latency_s', '')} s"
        htxt = f"{hh.get('outcome')} {hh.get('status') or ''}" + (f" ({hh['in_flight_s']} s)" if "in_flight_s" in hh else "")
        lines.append(f"| {r['ts']} | {r.get('round')} | {gtxt} | {htxt} |")
    lines += ["", "## Processes", "", f"Found by `{disc.method}`" + (f" ({disc.note})" if disc.note else "") + ".", ""]
    titles = {p.pid: p.title for p in disc.procs}
    for k, pid in sorted(disc.rank_pids.items()):
        lines.append(f"- TP{k}: pid {pid} `{titles.get(pid, '')[:80]}`")
    m = hang.get("metrics") or {}
    lines += ["", "## Metrics", "",
              (f"Raw `{m['path']}` kept in `{ev.Layout.METRICS.name}` ({m.get('bytes')} bytes)." if m.get("file")
               else f"`{m.get('path')}` not kept: {m.get('error') or m.get('note') or m.get('status')}"), ""]
    lines += ["## Next", "",
              (f"`{opts.on_hang}` runs after this folder is complete (`REPRO_EVIDENCE_DIR` = this folder); its exit "
               f"status and output are in `{ev.Layout.ON_HANG.name}` / `{ev.Layout.ON_HANG_LOG.name}`." if opts.on_hang
               else "No --on-hang command."),
              "", "Re-analyse: `repro analyze " + shlex.quote(str(stacks_dir.parent)) + "`", ""]
    lines += ["## Raw stacks", ""]
    if servers:
        for n in servers:
            lines += [f"### {n} server", ""] + stacks_details(stacks_dir.parent.parent / n / ev.Layout.STACKS.name)
    else:
        lines += stacks_details(stacks_dir)
    return "\n".join(lines) + "\n"
