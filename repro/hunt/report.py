"""The hunt's reports: ``hunt.jsonl`` (appended per trial) and ``HUNT.md`` (rewritten per trial), and the top
``HUNT.md`` of a workloads × configurations matrix."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional, Sequence

from repro import evidence as ev
from repro.catalogue import short_frame
from repro.diagnosis import md_cell
from repro.hunt.classify import FAMILY_SCHED, FAMILY_UNCLEAR
from repro.hunt.options import HuntOptions
from repro.hunt.plan import Row
from repro.hunt.results import NOT_RUN, TrialResult, rank_key
from repro.verdict import DEADLOCKED, DESYNCED


_md = md_cell  # the one markdown escape (repro.diagnosis)


def report_of(evidence: Optional[Path], base: Path) -> str:
    """The link from ``base`` to the REPORT.md of the run folder ``evidence`` ("" for None)."""
    return rel_path(ev.Layout.REPORT.at(evidence), base) if evidence else ""


def rel_path(path: Optional[Path], base: Path) -> str:
    """``path`` relative to ``base`` for a markdown link (``..`` where needed); "" for None."""
    if path is None:
        return ""
    try:
        return str(Path(path).resolve().relative_to(base.resolve(), walk_up=True))  # type: ignore[call-arg]
    except TypeError:  # python < 3.12
        import os

        return os.path.relpath(Path(path).resolve(), base.resolve())
    except ValueError:
        return str(path)


def version_header(versions: dict, adapter: Any) -> dict:
    """HUNT.md's version facts from a baseline's env.json fields: ``engine`` (``sglang 0.5.23``: the run's adapter's
    name and the version the injector saw), ``torch``, ``python``."""
    lc = adapter.ref_location
    ver = versions.get("engine_version") or versions.get(lc.version_key or lc.package)
    return {"engine": f"{adapter.name} {ver or 'version unknown'}", "torch": versions.get("torch"),
            "python": versions.get("python")}


class HuntLog:
    """Streams results to ``hunt.jsonl`` (appended per trial) and ``HUNT.md`` (rewritten atomically per trial).

    Args:
        folder: the hunt folder. header: facts for the top of HUNT.md (scenario, versions, ref, budget…).
    """

    def __init__(self, folder: Path, header: dict) -> None:
        self.folder = Path(folder)
        self.header = dict(header)
        self.rows: list[Row] = []
        self.results: list[TrialResult] = []
        self.status = "running"
        self.store = ev.EvidenceDir.open(self.folder)
        self.jsonl = self.store.hunt_jsonl.path
        self.md = self.store.hunt_md.path
        self._write_md()

    def event(self, kind: str, **data: Any) -> dict:
        """Append a non-trial line (``baseline``, ``rows``, ``end``) to hunt.jsonl; returns the line's record."""
        rec = {"event": kind, "time": time.time(), **data}
        self.store.hunt_jsonl.append(rec)
        return rec

    def set_rows(self, rows: Sequence[Row]) -> None:
        self.rows = list(rows)
        self.event("rows", rows=[{**asdict(r), "where": r.where} for r in rows])
        self._write_md()

    def add(self, r: TrialResult) -> None:
        self.results.append(r)
        self.store.hunt_jsonl.append({"event": "trial", **r.to_json()})
        self._write_md()

    def finish(self, status: str, **data: Any) -> None:
        self.status = status
        self.header.update(data)
        self.event("end", status=status, **data)
        self._write_md()

    def markdown(self) -> str:
        """HUNT.md: header, findings (scheduling/cache deadlocks first), the full trial table, the rows."""
        h = self.header
        out = ["# repro hunt", ""]
        for k in ("scenario", "catalogue", "discovery", "ref", "engine", "torch", "python", "ranks", "shard", "budget_min", "command",
                  "restarts", "interrupted_during", "error"):
            if h.get(k) not in (None, ""):
                out.append(f"- **{k}**: {_md(h[k])}")
        done = [r for r in self.results if r.verdict != NOT_RUN]
        out.append(f"- **status**: {self.status}; {len(done)} trial(s) run"
                   + (f" of {h['trials_total']}" if h.get("trials_total") else "")
                   + (f"; wall time {h['wall_s']:.0f} s" if h.get("wall_s") else ""))
        out.append("")
        if h.get("workload_baselines"):
            out += ["## Workloads: each run clean first (no perturbation)", "",
                    "A deadlock or desync here needs no perturbation at all: the engine is unsafe under this load "
                    f"({ev.Layout.workload_finding('<workload>')}).", "",
                    "| workload | what the clients do | verdict | requests ok / aborted / failed | admin calls (status) | server log | evidence |",
                    "|---|---|---|---|---|---|---|"]
            for b in h["workload_baselines"]:
                evl = f"[{Path(b['evidence']).name}]({report_of(b['evidence'], self.folder)})" if b.get("evidence") else ""
                out.append(f"| `{b['workload']}` | {_md(b.get('says', ''))} | {b['verdict']} | {b.get('ok', 0)} / {b.get('aborted', 0)} / "
                           f"{b.get('failed', 0)} | {_md(b.get('admin', '') or '—')} | {_md(b.get('log', '') or '—')} | {evl} |")
            out.append("")
        res = sorted(self.results, key=rank_key)
        dl = [r for r in res if r.verdict == DEADLOCKED]
        found = [r for r in dl if r.confirmed]
        out += ["## Findings", "",
                "New deadlocks in a scheduling/cache collective that deadlocked again when their scenario file was run "
                "on a fresh server (`--confirm`); a finding is only a finding if its scenario file reproduces it.", ""]
        if not found:
            out.append("None." if self.status != "running" else "None so far.")
        for r in found:
            out.append(f"- {_md(r.hazard)}. Scenario: [`{rel_path(r.scenario_file, self.folder)}`]({rel_path(r.scenario_file, self.folder)}); "
                       f"evidence: [{rel_path(r.evidence, self.folder)}]({report_of(r.evidence, self.folder)})")
        out += ["", "## Deadlocks", ""]
        if not dl:
            out.append("None so far." if self.status == "running" else "None.")
        for r in dl:
            d = r.diagnosis
            tag = d.family if d else FAMILY_UNCLEAR
            known = f" — known issue {d.known}" if d and d.known else (" — not a known issue" if tag == FAMILY_SCHED else "")
            conf = {True: " — reproduced again from its scenario file (finding)",
                    False: " — NOT reproduced by its scenario file (not a finding)",
                    None: " — by construction (not a candidate)" if r.trial.perturbation.by_construction else (
                        " — candidate: not re-run from its scenario file (use --confirm)" if tag == FAMILY_SCHED and not (d and d.known) else "")}[r.confirmed]
            out.append(f"- **[{tag}]** {_md(r.hazard)}{known}{conf}. Evidence: [{rel_path(r.evidence, self.folder)}]"
                       f"({report_of(r.evidence, self.folder)}); scenario: [`{rel_path(r.scenario_file, self.folder)}`]"
                       f"({rel_path(r.scenario_file, self.folder)})")
            if r.ledger:
                out.append(f"  - collective ledger: {_md(r.ledger)}")
        desynced = [r for r in res if r.verdict == DESYNCED]
        if desynced:
            out += ["", "## Desyncs (the collective ledgers show the ranks entered different collectives)", ""]
            for r in desynced:
                fam = r.diagnosis.family if r.diagnosis else FAMILY_UNCLEAR
                out.append(f"- **[{fam}]** {_md(r.hazard)}: {_md(r.ledger or r.reason)}. Evidence: "
                           f"[{rel_path(r.evidence, self.folder)}]({report_of(r.evidence, self.folder)})")
        crashes = [r for r in res if r.desync_crash and r.verdict != DESYNCED]
        if crashes:
            out += ["", "## Desync crashes (gloo caught the mismatch and aborted a rank)", ""]
            for r in crashes:
                fam = r.diagnosis.family if r.diagnosis else FAMILY_UNCLEAR
                out.append(f"- **[{fam}]** {_md(r.hazard)}. Evidence: [{rel_path(r.evidence, self.folder)}]"
                           f"({rel_path(ev.Layout.SERVER_LOG.at(r.evidence), self.folder) if r.evidence else ''})")
        out += ["", "## Trials", "",
                "| # | decision point | row (caller, loop) | perturbation | nature | rank | fired on rank | verdict | s to verdict | effect (probe moved; reconciled / first divergent state) | diverged in | family | hazard | evidence |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in res:
            t, d = r.trial, r.diagnosis
            div = d.collective if (d and (r.verdict == DEADLOCKED or r.desync_crash)) else ""
            fam = d.family if (d and (r.verdict == DEADLOCKED or r.desync_crash)) else ""
            evl = f"[{r.evidence.name}]({report_of(r.evidence, self.folder)})" if r.evidence else ""
            if r.scenario_file:
                evl += f" · [scenario]({rel_path(r.scenario_file, self.folder)})"
            secs = f"{r.to_verdict_s:.1f}" if r.verdict != NOT_RUN else ""
            out.append(f"| {t.n} | `{t.row.point}` | {_md(t.row.where)} | {t.perturbation.name}{' under ' + t.workload if t.workload else ''} | "
                       f"{r.nature} | {t.rank} | {r.fired_on_target if r.verdict != NOT_RUN else ''} | {r.verdict} | "
                       f"{secs} | {_md(r.effect)} | {_md(div)} | {fam} | {_md(r.hazard or r.reason)} | {evl} |")
        if self.rows:
            out += ["", "## Rows seen in the baseline burst", "", "| decision point | caller | loop | ranks | stack |", "|---|---|---|---|---|"]
            for row in self.rows:
                loop = f"{short_frame(row.loop_frame or '')} `for {row.loop_var}`" if row.loop_var else "—"
                on = f"{row.server} " if row.server else ""
                out.append(f"| `{row.point}` | `{short_frame(row.caller)}` | {loop} | {on}{', '.join(map(str, row.ranks))} | "
                           f"{_md(' ← '.join(short_frame(s) for s in row.stack[:4]))} |")
        unseen = h.get("points_not_seen") or []
        if unseen:
            out += ["", f"Decision points not reached by the baseline burst (no rows, nothing tried): {', '.join(f'`{u}`' for u in unseen)}."]
        return "\n".join(out) + "\n"

    def _write_md(self) -> None:
        self.store.hunt_md.write(self.markdown())


def matrix_markdown(opts: HuntOptions, ncat: Any, groups: Sequence[Any], entries: Sequence[dict], status: str,
                    wall_s: float, folder: Path) -> str:
    """The top HUNT.md of :func:`hunt_matrix`: one row per server group × workload."""
    out = ["# repro hunt: workloads × server configurations", "",
           f"- **scenario**: {_md(str(opts.scenario_path))}", f"- **workload file**: {_md(str(ncat.path))}",
           f"- **budget**: {opts.budget_min:g} min; **status**: {status}; wall time {wall_s:.0f} s; "
           f"{len(groups)} server group(s)", f"- **command**: {_md(opts.command_line)}", "",
           "Each workload runs clean first (its own verdict: a deadlock or desync there needs no perturbation and gets a "
           f"{ev.Layout.workload_finding('<workload>')}), then under each perturbation of every row it reached.", "",
           "| group | config | flags | workload | clean verdict | requests ok / aborted / failed | admin | log | trials (verdicts) | group wall s | "
           f"{ev.Layout.HUNT_MD.name} |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, e in enumerate(entries):
        link = (f"[{ev.Layout.HUNT_MD.name}]({rel_path(ev.Layout.HUNT_MD.at(e['folder']), folder)})" if e.get("folder")
                else _md(e.get("error") or e.get("why") or ""))
        flags = " ".join(e["args"])
        by = {b["workload"]: b for b in e.get("baselines") or []}
        for w in e["workloads"]:
            b = by.get(w, {})
            vc = (e.get("verdicts") or {}).get(w, {})
            tv = ", ".join(f"{k} {n}" for k, n in sorted(vc.items())) or "—"
            out.append(f"| {i + 1} | {e['config']} | `{_md(flags)}` | `{w}` | {b.get('verdict', e['status'])} | "
                       f"{b.get('ok', '')} / {b.get('aborted', '')} / {b.get('failed', '')} | {_md(b.get('admin') or '—')} | "
                       f"{_md(b.get('log') or '—')} | {tv} | {e.get('wall_s', '')} | {link} |")
    if ncat.not_run:
        out += ["", "## Not run on this testbed, and why", ""] + [f"- `{k}`: {_md(v)}" for k, v in ncat.not_run.items()]
    return "\n".join(out) + "\n"
