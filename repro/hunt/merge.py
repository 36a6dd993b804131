"""``repro hunt-merge``: join the folders of a sharded hunt (``repro hunt --shard K/N``) into one HUNT.md.

Each shard folder holds its own ``hunt.jsonl`` (a ``shard`` event with K, N and the keys split before its baseline, a
``plan`` event with the unsharded plan's trial numbers and names, one ``trial`` line per trial). The merge reads
them, checks that they are shards of one plan, and writes ``HUNT.md`` + ``hunt.jsonl`` of every trial (in plan order)
into a new folder; the shards' evidence folders stay where they are and are linked from the merged HUNT.md.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

from repro import evidence as ev
from repro.catalogue import Perturbation
from repro.diagnosis import CollectiveDiagnosis, CollectiveFamily, CrashKind
from repro.hunt.plan import Row, Trial
from repro.hunt.report import HuntLog
from repro.hunt.results import TrialResult


class MergeError(ValueError):
    """Shard folders that cannot be merged (the message names the folder and the fix)."""


def _read(folder: Path) -> dict:
    jsonl = ev.File(Path(folder), ev.Layout.HUNT_JSONL)
    if not jsonl.path.is_file():
        raise MergeError(f"{folder}: no {jsonl.member.name}; pass the folders `repro hunt --shard K/N` made")
    try:
        lines = jsonl.read()  # a half-written last line (a shard killed mid-write) is skipped
    except ev.EvidenceFileError as e:
        raise MergeError(f"{e}; is this a hunt folder?") from None
    shard = next((x for x in lines if x.get("event") == "shard"), None)
    if shard is None:
        raise MergeError(f"{folder}: not a shard (its {ev.Layout.HUNT_JSONL.name} has no 'shard' event); run the hunt "
                         "with --shard K/N")
    plan = next((x for x in lines if x.get("event") == "plan"), None)
    rows = next((x for x in lines if x.get("event") == "rows"), None)
    end = next((x for x in reversed(lines) if x.get("event") == "end"), None)
    return {"folder": Path(folder), "k": int(shard["k"]), "n": int(shard["n"]), "keys": shard.get("keys") or [],
            "header": shard.get("header") or {},
            "plan": [tuple(x) for x in plan["trials"]] if plan else None, "rows": rows["rows"] if rows else [],
            "trials": [x for x in lines if x.get("event") == "trial"], "end": end or {}}


def _result(d: dict, rows: Sequence[Any]) -> Any:
    """A :class:`repro.hunt.results.TrialResult` back from its ``hunt.jsonl`` line (``TrialResult.to_json``)."""
    row = next((r for r in rows if (r.point, r.caller, r.loop_frame, r.loop_var, r.server)
                == (d["point"], d["caller"], d.get("loop_frame"), d.get("loop_var"), d.get("server") or None)), None)
    if row is None:
        row = Row(d["point"], d["caller"], d.get("loop_frame"), d.get("loop_var"), server=d.get("server") or None)
    pert = Perturbation(d["perturbation"], dict(d.get("action") or {}), "", bool(d.get("by_construction")),
                        control=d.get("nature") == "control")
    trial = Trial(int(d["n"]), row, pert, int(d["rank"]), d.get("workload") or "")
    diag = None
    if d.get("diagnosis"):
        g = dict(d["diagnosis"])
        diag = CollectiveDiagnosis(CollectiveFamily(g["family"]), g["collective"], tuple(g.get("in_ranks") or ()),
                                   {int(k) if str(k).isdigit() else k: v for k, v in (g.get("where") or {}).items()},
                                   tuple(g.get("chain") or ()), g.get("known"),
                                   CrashKind(g["crash"]) if g.get("crash") else None)
    ints = lambda m: {int(k): v for k, v in (m or {}).items()}  # noqa: E731
    return TrialResult(trial, d["verdict"], d.get("reason", ""), float(d.get("to_verdict_s") or 0.0), diag,
                       d.get("hazard", ""), Path(d["evidence"]) if d.get("evidence") else None,
                       Path(d["scenario_file"]) if d.get("scenario_file") else None, ints(d.get("entered")),
                       ints(d.get("matched")), ints(d.get("fired")), tuple(d.get("notes") or ()), d.get("confirmed"),
                       d.get("ledger") or "", d.get("effect") or "", d.get("effect_status") or "")


def _row(r: dict) -> Any:
    return Row(r["point"], r["caller"], r.get("loop_frame"), r.get("loop_var"), tuple(r.get("stack") or ()),
               tuple(r.get("ranks") or ()), tuple(r.get("gate_frames") or ()), int(r.get("max_depth") or 1),
               r.get("server") or None)


def merge_shards(folders: Sequence[Path], out_dir: Optional[Path] = None, evidence_root: Path = ev.DEFAULT_EVIDENCE_DIR) -> Path:
    """Merge shard folders of one sharded hunt into one folder with HUNT.md and hunt.jsonl.

    Args:
        folders: hunt folders made by ``repro hunt --shard K/N`` (same N, each K once; missing K are listed, not
            an error: a shard that never ran is reported as such).
        out_dir: the merged folder (created; must not hold a HUNT.md). Default: a new ``<root>/<scenario>/<time>-hunt-merged``.
        evidence_root: where the default folder goes.
    Returns:
        The merged folder.
    Raises:
        MergeError: a folder is no shard, shards of different N or the same K twice, plans that number the same
            trial differently (their baselines saw different rows), or ``out_dir`` already holds a HUNT.md.
    """
    if not folders:
        raise MergeError("no shard folder given; pass the folders `repro hunt --shard K/N` made")
    shards = [_read(f) for f in folders]
    ns = sorted({s["n"] for s in shards})
    if len(ns) > 1:
        which = ", ".join(f"{s['k']}/{s['n']} in {s['folder']}" for s in shards)
        raise MergeError(f"shards of different N ({which}); merge the shards of one split")
    n = ns[0]
    seen: dict[int, Path] = {}
    for s in shards:
        if s["k"] in seen:
            raise MergeError(f"shard {s['k']}/{n} twice: {seen[s['k']]} and {s['folder']}; pass each shard once")
        seen[s["k"]] = s["folder"]
    missing = [k for k in range(1, n + 1) if k not in seen]
    plans = [s for s in shards if s["plan"] is not None]
    by_n: dict[int, str] = {}
    for s in plans:
        for num, name in s["plan"]:
            if by_n.setdefault(int(num), name) != name:
                raise MergeError(f"trial {num} is {by_n[int(num)]!r} in one shard and {name!r} in {s['folder']}: their "
                                 "baselines saw different rows; re-run the shards from one engine build and scenario")
    rows: list = []
    seen_rows: set = set()
    for s in shards:
        for r in s["rows"]:
            row = _row(r)
            if row.key not in seen_rows:
                seen_rows.add(row.key)
                rows.append(row)
    results = []
    for s in shards:
        results += [_result(d, rows) for d in s["trials"]]
    results.sort(key=lambda r: r.trial.n)
    if out_dir is None:
        scen = Path(shards[0]["folder"]).parent.name
        folder = ev.EvidenceDir(evidence_root, scen, "hunt-merged").path
    else:
        folder = Path(out_dir)
        if ev.Layout.HUNT_MD.at(folder).exists():
            raise MergeError(f"{folder} already holds a {ev.Layout.HUNT_MD.name}; pass a new --out folder")
        folder.mkdir(parents=True, exist_ok=True)
    statuses = {s["k"]: s["end"].get("status", "running (no end line)") for s in shards}
    header = {**shards[0]["header"], "shard": f"merged {len(shards)} of {n} shard(s): " + "; ".join(
        f"{k}/{n} {statuses[k]} ({seen[k]})" for k in sorted(seen))
        + (f"; MISSING shard(s) {', '.join(f'{k}/{n}' for k in missing)} (their trials are not in this report)" if missing else "")}
    if plans:
        header["trials_total"] = len(by_n)
    log = HuntLog(folder, header)
    log.rows = rows
    for r in results:
        log.results.append(r)
    log.store.hunt_jsonl.append({"event": "merge", "n": n, "shards": {str(k): str(v) for k, v in sorted(seen.items())},
                                 "missing": missing})
    for r in results:
        log.store.hunt_jsonl.append({"event": "trial", **r.to_json()})
    log.finish("incomplete" if missing or any(v != "complete" for v in statuses.values()) else "complete")
    return folder
