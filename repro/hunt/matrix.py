"""``repro hunt --workload … --config …``: the base configuration and each named one × every workload, one hunt
per server group (:func:`repro.hunt.loop.hunt_group`), one top HUNT.md."""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

from repro import evidence as ev
from repro import nemeses
from repro.catalogue import HuntError, check_natural, hunt_catalogue, load_catalogue
from repro.hunt.loop import hunt_group
from repro.hunt.options import Clock, HuntOptions, HuntResult, Observer, noop
from repro.hunt.report import matrix_markdown
from repro.hunt.results import NOT_RUN
from repro.hunt.runs import Runs
from repro.hunt.workloads import nemeses_for
from repro.scenario import ScenarioError, load_scenario
from repro.scenario_toml import scenario_toml


def hunt_matrix(opts: HuntOptions, observe: Observer = noop, *, runs: Optional[Runs] = None) -> HuntResult:
    """``repro hunt --workload … --config …``: the base configuration and each named one × every workload.

    Workloads whose engine flags agree run on one server group (``repro.nemeses.server_groups``); each group is one
    hunt (its own folder, HUNT.md with each workload's clean verdict, trials under each workload). The budget is
    shared: each group gets the time left divided by the groups left. The top folder's HUNT.md has one row per
    group and workload: configuration, flags, clean verdict, rows, trials, verdicts, wall time.

    Returns:
        A :class:`HuntResult` of the top folder, with every group's rows and results.
    Raises:
        HuntError: bad workload/config name or file, before anything is launched; a group's own errors are
            recorded in its row and the next group runs.
        KeyboardInterrupt: after the running group tore its server down; the top HUNT.md says so.
    """
    try:
        base = load_scenario(opts.scenario_path)
    except ScenarioError as e:
        raise HuntError(str(e)) from None
    cat = load_catalogue(opts.catalogue_path or hunt_catalogue(base.server.adapter, opts.natural))
    if opts.natural:
        check_natural(cat)
    ncat = nemeses_for(opts, cat)
    wanted = list(opts.workloads)
    if "all" in wanted:
        if not ncat.workloads:  # "all" of nothing: the hunt would run the quiet burst alone, in a matrix folder
            raise HuntError(f"--workload all: {ncat.path} defines no workload (no [workloads.NAME] table); pass a "
                            "workloads TOML (the adapter's hunt_workloads.toml under scenarios/) with --workload-file")
        wanted = list(ncat.workloads)
    names = [nemeses.QUIET] + [w for w in dict.fromkeys(wanted) if w != nemeses.QUIET]
    configs = ["base"] + [c for c in dict.fromkeys(opts.configs) if c != "base"]
    try:
        for w in names:
            ncat.workload(w)
        groups = nemeses.server_groups(base.server.args, ncat, configs, names)
    except nemeses.NemesisError as e:
        raise HuntError(str(e)) from None
    try:
        top = ev.EvidenceDir(opts.evidence_root, base.name, "hunt-matrix")
    except ev.EvidenceError as e:
        raise HuntError(str(e)) from None
    top.hunt_scenarios_dir.mkdir(exist_ok=True)
    observe("hunt_folder", {"folder": str(top.path)})
    clock = Clock(opts.budget_min * 60.0)
    entries: list[dict] = []
    out = HuntResult(top.path, [], [])
    status = "running"

    def write() -> None:
        top.hunt_md.write(matrix_markdown(opts, ncat, groups, entries, status, clock.elapsed, top.path))
        top.matrix.write({"status": status, "wall_s": round(clock.elapsed, 1), "groups": entries})

    write()
    try:
        for i, g in enumerate(groups):
            entry: dict = {"config": g.config, "args": list(g.args), "workloads": list(g.workloads), "status": NOT_RUN}
            entries.append(entry)
            left = clock.remaining / max(1, len(groups) - i)
            if left <= 0:
                entry["why"] = f"budget of {opts.budget_min:g} min ended before this group"
                write()
                continue
            b = base.model_copy(update={"server": base.server.model_copy(update={"args": list(g.args)})})
            f = top.hunt_scenario(f"{i + 1:02d}-{g.label}.toml")
            ev.write_text_atomic(f, scenario_toml(b, b.name, f"repro hunt group {g.label}: {base.name} with flags "
                                                  f"{' '.join(g.args)}", [("base", "success", "the base burst", [])]))
            sub = dataclasses.replace(opts, scenario_path=f, workloads=(), configs=(), group_workloads=g.workloads,
                                      budget_min=left / 60.0, evidence_root=top.path, workload_file=ncat.path,
                                      catalogue_path=cat.path)
            t0 = time.time()
            try:
                r = hunt_group(sub, observe, runs=runs)
            except HuntError as e:
                entry.update(status="failed", error=str(e), wall_s=round(time.time() - t0, 1))
                write()
                continue
            baselines = r.workload_baselines  # the group's workload_baseline records, as its hunt.jsonl has them
            counts: dict[str, dict[str, int]] = {}
            for tr in r.results:
                counts.setdefault(tr.trial.workload or nemeses.QUIET, {}).setdefault(tr.verdict, 0)
                counts[tr.trial.workload or nemeses.QUIET][tr.verdict] += 1
            entry.update(status="interrupted" if r.interrupted else "complete", folder=str(r.folder), rows=len(r.rows),
                         trials=len(r.results), wall_s=round(time.time() - t0, 1), baselines=baselines, verdicts=counts,
                         budget_s=round(left, 1))
            out.rows += r.rows
            out.results += r.results
            out.findings += r.findings
            write()
    except KeyboardInterrupt:
        status = "interrupted"
        out.interrupted = True
        write()
        raise
    status = "complete"
    out.wall_s = clock.elapsed
    out.budget_exhausted = any(e["status"] == NOT_RUN for e in entries) or any(r.verdict == NOT_RUN for r in out.results)
    write()
    return out
