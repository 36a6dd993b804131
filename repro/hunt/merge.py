"""``repro hunt-merge``: join the folders of a sharded hunt (``repro hunt --shard K/N``) into one HUNT.md.

Each shard folder holds its own ``hunt.jsonl`` (a ``shard`` event with K, N and the keys split before its baseline, a
``plan`` event with the unsharded plan's trial numbers and names, one ``trial`` line per trial). The merge reads
them, checks that they are shards of one plan, and writes ``HUNT.md`` + ``hunt.jsonl`` of every trial (in plan order)
into a new folder; the shards' evidence folders stay where they are and are linked from the merged HUNT.md.
"""
from __future__ import annotations

import json
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


# What each event line must hold for the merge to read it: field -> (JSON types, required). An int field is a JSON
# integer (not true/false, not "2"); None in a type tuple means the field may be null.
_OBJ, _LIST, _STR, _INT, _NUM = (dict,), (list,), (str,), (int,), (int, float)
_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number", type(None): "null"}
_SHARD = {"k": (_INT, True), "n": (_INT, True), "keys": (_LIST + (type(None),), False),
          "header": (_OBJ + (type(None),), False)}
_PLAN = {"trials": (_LIST, True)}
_ROWS = {"rows": (_LIST, True)}
_ROW = {"point": (_STR, True), "caller": (_STR, True), "max_depth": (_INT + (type(None),), False)}
_END = {"status": (_STR, False)}
_TRIAL = {"n": (_INT, True), "point": (_STR, True), "caller": (_STR, True), "perturbation": (_STR, True),
          "rank": (_INT, True), "verdict": (_STR, True), "reason": (_STR + (type(None),), False),
          "to_verdict_s": (_NUM + (type(None),), False), "action": (_OBJ + (type(None),), False),
          "diagnosis": (_OBJ + (type(None),), False), "entered": (_OBJ + (type(None),), False),
          "matched": (_OBJ + (type(None),), False), "fired": (_OBJ + (type(None),), False),
          "notes": (_LIST + (type(None),), False)}
_FIX = "re-run that shard (`repro hunt --shard K/N`) or fix the line"


def _kind(value: Any) -> str:
    """``null``, ``a list ([1, 2])``, ``true/false (true)``: what a JSON value is, with the value (cut at 40)."""
    if value is None:
        return "null"
    kind = "true/false" if isinstance(value, bool) else _NAMES.get(type(value), type(value).__name__)
    return f"{kind} ({json.dumps(value)[:40]})"


def _check(d: dict, spec: dict, where: str) -> None:
    """Refuse (:class:`MergeError`) the first field of ``d`` that ``spec`` requires and ``d`` lacks, or that holds
    the wrong JSON type; ``where`` is ``"<file>: line <n> ('<event>' event)"``."""
    for key, (types, required) in spec.items():
        if key not in d:
            if required:
                raise MergeError(f"{where}: field {key!r} is missing; expected {_NAMES[types[0]]}; {_FIX}")
            continue
        v = d[key]
        if isinstance(v, bool) or not isinstance(v, types):
            want = " or ".join(_NAMES[t] for t in types)
            raise MergeError(f"{where}: field {key!r} is {_kind(v)}; expected {want}; {_FIX}")


def _read(folder: Path) -> dict:
    """One shard folder's ``hunt.jsonl``, every line it reads checked (a torn last line, a shard killed mid-write,
    is skipped: that shard reads as "running (no end line)").

    Raises:
        MergeError: no hunt.jsonl, a line that is not JSON or not an object, a field of a shard/plan/rows/trial/end
            line missing or of the wrong type (file, line number and field named), or a shard K outside 1..N.
    """
    jsonl = ev.File(Path(folder), ev.Layout.HUNT_JSONL)
    if not jsonl.path.is_file():
        raise MergeError(f"{folder}: no {jsonl.member.name}; pass the folders `repro hunt --shard K/N` made")
    try:
        numbered = jsonl.read(numbered=True)  # a half-written last line (a shard killed mid-write) is skipped
    except ev.EvidenceFileError as e:
        raise MergeError(f"{e}; is this a hunt folder?") from None
    first: dict[str, tuple[int, dict]] = {}
    trials: list[tuple[int, dict]] = []
    end: Optional[tuple[int, dict]] = None
    for i, x in numbered:
        if not isinstance(x, dict):
            raise MergeError(f"{jsonl.path}: line {i} is {_kind(x)}, not a JSON object; "
                             f"expected one event object per line; {_FIX}")
        event = x.get("event")
        if event == "trial":
            trials.append((i, x))
        elif event == "end":
            end = (i, x)
        elif event in ("shard", "plan", "rows") and event not in first:
            first[event] = (i, x)
    where = lambda i, e: f"{jsonl.path}: line {i} ({e!r} event)"  # noqa: E731
    if "shard" not in first:
        raise MergeError(f"{folder}: not a shard (its {ev.Layout.HUNT_JSONL.name} has no 'shard' event); run the hunt "
                         "with --shard K/N")
    i, shard = first["shard"]
    _check(shard, _SHARD, where(i, "shard"))
    k, n = shard["k"], shard["n"]
    if n < 1 or not 1 <= k <= n:
        raise MergeError(f"{where(i, 'shard')}: shard {k}/{n} is not one of 1..N (need 1 <= K <= N); {_FIX}")
    plan = None
    if "plan" in first:
        i, p = first["plan"]
        _check(p, _PLAN, where(i, "plan"))
        for t in p["trials"]:
            if not (isinstance(t, list) and len(t) == 2 and type(t[0]) is int and isinstance(t[1], str)):
                raise MergeError(f"{where(i, 'plan')}: field 'trials' holds {json.dumps(t)[:40]}; expected "
                                 f"[number, name] pairs; {_FIX}")
        plan = [tuple(t) for t in p["trials"]]
    rows: list = []
    if "rows" in first:
        i, r = first["rows"]
        _check(r, _ROWS, where(i, "rows"))
        for row in r["rows"]:
            if not isinstance(row, dict):
                raise MergeError(f"{where(i, 'rows')}: field 'rows' holds {_kind(row)}; expected objects; {_FIX}")
            _check(row, _ROW, where(i, "rows") + " field 'rows'")
        rows = r["rows"]
    for i, t in trials:
        _check(t, _TRIAL, where(i, "trial"))
    if end is not None:
        _check(end[1], _END, where(end[0], "end"))
    return {"folder": Path(folder), "path": jsonl.path, "k": k, "n": n, "keys": shard.get("keys") or [],
            "header": shard.get("header") or {}, "plan": plan, "rows": rows, "trials": trials,
            "end": end[1] if end else {}}


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
        MergeError: a folder is no shard, a line of its hunt.jsonl is not a JSON object or a field the merge reads
            is missing or of the wrong JSON type (file, line and field named), a shard's K is outside 1..N, shards of
            different N or the same K twice, plans that number the same trial differently (their baselines saw
            different rows), or ``out_dir`` already holds a HUNT.md.
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
        for i, d in s["trials"]:
            try:
                results.append(_result(d, rows))
            except (KeyError, TypeError, ValueError, AttributeError) as e:  # a field nested below the checked ones
                what = f"field {e.args[0]!r} is missing" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
                raise MergeError(f"{s['path']}: line {i} ('trial' event): {what}; {_FIX}") from None
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
