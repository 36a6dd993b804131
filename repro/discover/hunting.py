"""The hunt's side of discovery: merge discovered points into the catalogue, then judge them by what the hunt saw.

``repro hunt --discover`` calls :func:`prepare` before choosing points (the discovered points join the hand
catalogue; hand entries win, ``--no-hand-catalogue`` drops the hand points), :func:`after_baseline` once the baseline
burst has made the rows (a discovered point never reached is reported with the sibling class the model did build,
where one was reached), and :func:`finish` at the end: DISCOVERY.md + discover.json in the hunt folder with the
precision of discovery (of the candidates' points: reached, fired, deadlocked/desynced) and the rows reached and
fired by hand points vs discovered points. Nothing here renders to a console.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from repro.discover import (DiscoverError, Discovery, DiscoveredPoint, POINT_PREFIX, default_rules_path, discover,
                            merge_catalogue, points_toml)
from repro.evidence import EvidenceDir, Layout

DESYNCED = "DESYNCED"  # the ledger proof's verdict (repro/verdict.py, when present); compared by name


@dataclass
class DiscoveryState:
    """Discovery's part of one hunt: the scan, the points it added, and what the hunt learned about them."""

    discovery: Discovery
    added: list[DiscoveredPoint]
    hand_points: tuple[str, ...]
    keep_hand: bool
    not_reached: dict = field(default_factory=dict)  # point -> sentence ("the model built Y instead")
    unpatchable: dict = field(default_factory=dict)  # point -> why the injector cannot patch its site here

    @property
    def added_names(self) -> set:
        return {p.name for p in self.added}


def prepare(cat: Any, python: str, *, rules_path: Optional[Path] = None, keep_hand_points: bool = True,
            adapter: Any) -> tuple[Any, DiscoveryState]:
    """Run discovery in ``python`` and merge its points into ``cat`` (a ``repro.catalogue.Catalogue``).

    Raises:
        repro.catalogue.HuntError: the rules file is bad or the scan failed (the message names the file / interpreter),
            or discovery proposed nothing huntable while the hand points were dropped.
    """
    from repro.catalogue import HuntError

    try:
        path = Path(rules_path) if rules_path else default_rules_path(adapter, cat.path)
        d = discover(python, path, known_perturbations=list(cat.perturbations))
    except DiscoverError as e:
        raise HuntError(f"--discover: {e}") from None
    unpatchable = _unpatchable(d.points, python)
    points = [p for p in d.points if p.name not in unpatchable]
    merged, added = merge_catalogue(cat, points, _rules(path), keep_hand_points=keep_hand_points)
    if not merged.points:
        raise HuntError(f"--discover: {path} proposed no huntable decision point in {python}'s "
                        f"{d.scan.get('package')} and --no-hand-catalogue dropped the hand points: nothing to hunt")
    return merged, DiscoveryState(d, added, tuple(p.name for p in cat.points) if keep_hand_points else (), keep_hand_points,
                                  unpatchable=unpatchable)


def check_natural_rules(cat: Any, rules_path: Optional[Path], adapter: Any) -> None:
    """``--natural --discover``, before the scan: the rules must be able to propose a natural perturbation.

    Discovery gives a point the perturbations its rules map the point's source kind / return type to
    (``perturbations_by_kind`` / ``perturbations_by_return``) that the catalogue defines; a natural hunt takes only the
    natural ones (``repro.catalogue.check_natural``). When no name the rules map to is a natural perturbation of
    ``cat``, discovery cannot add a single point: refused here, before a scan (~20-60 s) and a baseline server that
    would change nothing.

    Raises:
        repro.catalogue.HuntError: one line naming the rules file, what it maps to, and the fix.
    """
    from repro.catalogue import HuntError

    path = Path(rules_path) if rules_path else default_rules_path(adapter, cat.path)
    try:
        rules = _rules(path)
    except DiscoverError as e:
        raise HuntError(f"--discover: {e}") from None
    names: list[str] = []
    for table in ("perturbations_by_kind", "perturbations_by_return"):
        for vals in (rules.get(table) or {}).values():
            names += [n for n in (vals if isinstance(vals, list) else []) if n not in names]
    natural = sorted(n for n, pt in cat.perturbations.items() if pt.nature == "natural")
    if not any(n in natural for n in names):
        raise HuntError(f"--natural --discover: {path} maps what it finds only to {', '.join(names) or 'nothing'}, none "
                        f"of them a natural perturbation of {cat.path} ({', '.join(natural)}), so discovery could add "
                        "no point; drop --discover, or map a source kind to one of those names in the rules' "
                        "[perturbations_by_kind]")


def _unpatchable(points: Sequence[DiscoveredPoint], python: str) -> dict:
    """Discovered points whose site the injector cannot patch in ``python`` (its module does not import there —
    an optional dependency such as lmcache missing —, or the name is no function or method), from one preflight of
    the injector's own resolver (``repro.sites``, ~15 s: it imports the sites' modules). Point name -> why. A
    preflight that cannot run keeps every point (the launched server's own check still stops a bad site)."""
    from repro import sites as S

    if not points:
        return {}
    request = {"injections": [{"id": p.name, "alternatives": [p.site], "patterns": [], "method": None} for p in points]}
    try:
        answer = S._run_preflight(str(python), request, S.PREFLIGHT_TIMEOUT_S)
    except S.SitesPreflightError:
        return {}
    out = {}
    for p, got in zip(points, answer.get("injections") or []):
        alts = got.get("alternatives") or []
        if not any(a.get("status") == "resolved" and not a.get("static") for a in alts):
            a = alts[0] if alts else {}
            how = "found only in its source (its module does not import here)" if a.get("static") else a.get("status", "?")
            out[p.name] = f"`{_short(p.site)}` cannot be patched in this interpreter: {how}; {a.get('detail', '')}".rstrip("; ")
    return out


def _rules(path: Path) -> dict:
    from repro.discover import load_rules

    return load_rules(path)


def write_inputs(state: DiscoveryState, folder: Path) -> None:
    """The hunt folder's ``discovery/``: DISCOVERY.md, discover.json, catalogue.toml (the added points as data)."""
    d = EvidenceDir.open(folder).discovery
    d.discovery_points.write(points_toml(state.added, header=(
        f"Points proposed by `repro hunt --discover` ({state.discovery.rules_path}, {state.discovery.python}).\n"
        "Same shape as hunt_catalogue.toml's [[points]]: append them there to keep them.")))
    d.discovery_json.write(state.discovery.to_json())
    d.discovery_md.write(state.discovery.markdown())


def after_baseline(state: DiscoveryState, rows: Sequence[Any]) -> dict:
    """For each added point the baseline never reached: which sibling class (the same method elsewhere in the
    hierarchy) was reached instead, when one was. Returns (and keeps) point -> sentence."""
    seen_sites = {}
    by_name = {p.name: p for p in state.added}
    for r in rows:
        p = by_name.get(r.point)
        if p is not None:
            seen_sites.setdefault(p.site, p.name)
    reached = {r.point for r in rows}
    out = {}
    for p in state.added:
        if p.name in reached:
            continue
        built = [s for s in p.family if s in seen_sites]
        if built:
            out[p.name] = (f"`{_short(p.site)}` is never built by this model; it built `{_short(built[0])}` instead "
                           f"(point `{seen_sites[built[0]]}`)")
        elif getattr(p, "folded", ()) or getattr(p, "same_decisions", ()):
            parts = []
            if getattr(p, "folded", ()):
                parts.append("the same call's other overrides were folded into it (one per call: [points] "
                             "max_sites_per_call): " + ", ".join('`' + _short(s) + '`' for s in p.folded[:4]))
            if getattr(p, "same_decisions", ()):
                parts.append("the same query deciding the same guards was folded into it ([points] fold_same_decisions): "
                             + ", ".join(f"`{_short(s).rsplit('.', 1)[-1]}` in `{_short(c)}`" for s, c in p.same_decisions[:4]))
            out[p.name] = "not reached; " + "; ".join(parts)
        elif p.family:
            out[p.name] = f"not reached; the same method elsewhere in its hierarchy: {', '.join('`' + _short(s) + '`' for s in p.family[:4])}"
        else:
            out[p.name] = "not reached by the baseline burst"
    out.update(state.unpatchable)
    state.not_reached = out
    return out


def _short(q: str) -> str:
    return q.split(":", 1)[-1]


def _fired(r: Any) -> bool:
    return sum((r.fired or {}).values()) > 0


def tally(state: Optional[DiscoveryState], rows: Sequence[Any], results: Sequence[Any]) -> dict:
    """Rows reached and fired, split by where the point came from (hand / discovered), and discovery's precision.

    A row is *fired* when at least one of its trials fired its perturbation; a discovered point is *reached* when
    the baseline saw it (≥ 1 row), *fired* when one of its trials fired, *deadlocked* / *desynced* when one trial
    ended so (by-construction perturbations excluded). Returns a JSON-able dict.
    """
    from repro.verdict import DEADLOCKED

    added = state.added_names if state else set()

    def origin(point: str) -> str:
        if point in added:
            return "discovered"
        if point.startswith("coll-"):
            return "sites"
        return "hand"

    out: dict = {"rows": {}, "points": {}}
    keys = {}
    for r in rows:
        keys[r.key] = origin(r.point)
    fired_rows = {}
    for res in results:
        k = res.trial.row.key
        if _fired(res):
            fired_rows[k] = True
    for k, o in keys.items():
        e = out["rows"].setdefault(o, {"reached": 0, "fired": 0})
        e["reached"] += 1
        e["fired"] += 1 if fired_rows.get(k) else 0
    if state:
        names = [p.name for p in state.added]
        reached = {r.point for r in rows if r.point in added}
        fired = {res.trial.row.point for res in results if res.trial.row.point in added and _fired(res)}
        bad = lambda v: {res.trial.row.point for res in results  # noqa: E731
                         if res.trial.row.point in added and res.verdict == v and not res.trial.perturbation.by_construction}
        crashed = {res.trial.row.point for res in results if res.trial.row.point in added and getattr(res, "desync_crash", False)}
        out["points"] = {"candidates": len(state.discovery.candidates),
                         "huntable_candidates": sum(1 for c in state.discovery.candidates if c.huntable),
                         "points_added": len(names), "reached": len(reached), "fired": len(fired),
                         "deadlocked": len(bad(DEADLOCKED)), "desynced": len(bad(DESYNCED)),
                         "desync_crashed": len(crashed),
                         "deadlocked_points": sorted(bad(DEADLOCKED)), "desynced_points": sorted(bad(DESYNCED) | crashed)}
    return out


def finish(state: DiscoveryState, folder: Path, rows: Sequence[Any], results: Sequence[Any]) -> dict:
    """Write the hunt's verdict on discovery (``discovery/PRECISION.md`` + into discover.json); returns :func:`tally`."""
    t = tally(state, rows, results)
    d = EvidenceDir.open(folder).discovery
    p = t.get("points") or {}
    lines = ["# Discovery, judged by the hunt", "",
             f"- candidates: {p.get('candidates', 0)} ({p.get('huntable_candidates', 0)} with a patchable site) → "
             f"{p.get('points_added', 0)} points added to the catalogue"
             + ("" if state.keep_hand else " (hand points dropped: discovery alone)"),
             f"- of those points: reached by the baseline {p.get('reached', 0)}, perturbation fired {p.get('fired', 0)}, "
             f"deadlocked {p.get('deadlocked', 0)}, desynced {p.get('desynced', 0)} (ledger) / {p.get('desync_crashed', 0)} "
             "(gloo caught a size mismatch)", ""]
    lines += ["| rows from | reached | fired |", "|---|---|---|"]
    for o, e in sorted(t["rows"].items()):
        lines.append(f"| {o} | {e['reached']} | {e['fired']} |")
    if state.not_reached:
        lines += ["", "## Discovered points the baseline never reached", ""]
        for name, why in state.not_reached.items():
            lines.append(f"- `{name}`: {why}")
    d.precision.write("\n".join(lines) + "\n")
    d.tally.write({**t, "not_reached": state.not_reached})
    return t


def is_discovered(point: str) -> bool:
    """Is this a point name discovery made (``d.`` prefix)?"""
    return point.startswith(POINT_PREFIX)


def header_line(state: DiscoveryState, t: dict) -> str:
    """HUNT.md's ``discovery`` line at the end of a hunt: what was searched and what came of it."""
    s = state.discovery.summary()
    p = t.get("points") or {}
    rows = t.get("rows") or {}
    d = Layout.DISCOVERY.name
    r = "; ".join(f"{o} rows reached {e['reached']}, fired {e['fired']}" for o, e in sorted(rows.items()))
    return (f"searched {s['package']} ({s['modules']} modules, {s['functions']} functions; rules "
            f"{state.discovery.rules_path}): {s['candidates']} candidates ({s['huntable']} with a patchable site) → "
            f"{len(state.added)} points added {'beside' if state.keep_hand else 'without'} the hand points; of them "
            f"reached {p.get('reached', 0)}, fired {p.get('fired', 0)}, deadlocked {p.get('deadlocked', 0)}, desynced "
            f"{p.get('desynced', 0) + p.get('desync_crashed', 0)}; {r} ({d}/{Layout.DISCOVERY_MD.name}, "
            f"{d}/{Layout.PRECISION.name})")
