"""The hunt's trial plan: the baseline burst's call places of each decision point become rows; each row ×
perturbation × rank is one trial (``repro hunt`` steps 1 and 2; the catalogue itself is :mod:`repro.catalogue`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from repro.catalogue import Catalogue, DecisionPoint, HuntError, Perturbation, glob_any, short_frame


@dataclass(frozen=True)
class Row:
    """One decision point at one call place seen in the baseline burst.

    Attributes:
        point: decision point name.
        caller: ``module:qualname`` of the site's direct (non-decorator) caller.
        loop_frame: the nearest frame (caller or up to 2 above it) executing inside a ``for`` loop, or None.
        loop_var: that loop's target name (innermost loop of that frame), or None (the call is in no loop).
        stack: caller chain seen (up to 8 frame names, innermost first).
        ranks: ranks on which the baseline saw this call place.
        server: the engine server of a multi-server stack (PD: ``prefill`` / ``decode``) on whose ranks the
            baseline saw it, None on a single server; a trial's injection then names it (``server``), so the
            perturbation fires on one rank of that server only.
    """

    point: str
    caller: str
    loop_frame: Optional[str]
    loop_var: Optional[str]
    stack: tuple[str, ...] = ()
    ranks: tuple[int, ...] = ()
    gate_frames: tuple[str, ...] = ()  # --sites rows: the call site's frames (all must match within max_depth)
    max_depth: int = 1
    server: Optional[str] = None

    @property
    def key(self) -> tuple:
        return (self.point, self.caller, self.loop_frame, self.loop_var) + ((self.server,) if self.server else ())

    @property
    def where(self) -> str:
        """``Scheduler._get_new_batch_prefill_raw, in `for req`'' (short, for tables; ``prefill: …`` on a stack)."""
        on = f"{self.server}: " if self.server else ""
        return on + self._where()

    def _where(self) -> str:
        caller = short_frame(self.caller)
        if self.gate_frames:
            return " ← ".join(short_frame(f) for f in self.gate_frames)  # all of them: the first two are often shared
        if not self.loop_var:
            return f"{caller}, outside loops"
        if self.loop_frame == self.caller:
            return f"{caller}, in `for {self.loop_var}`"
        return f"{caller} ← {short_frame(self.loop_frame or '')} in `for {self.loop_var}`"

    def gate(self, rank: int) -> dict:
        """Scenario gate for this row on one rank: direct caller (and loop frame) named, first matching call only."""
        if self.gate_frames:
            return {"called_from": list(self.gate_frames), "max_depth": self.max_depth, "ranks": [rank],
                    "occurrence": {"mode": "first"}}
        if self.loop_var and self.loop_frame:
            frames = [self.loop_frame] if self.loop_frame == self.caller else [self.loop_frame, self.caller]
            depth = 1 if self.loop_frame == self.caller else 3
            return {"called_from": frames, "inside_loop": self.loop_var, "max_depth": depth, "ranks": [rank],
                    "occurrence": {"mode": "first"}}
        return {"called_from": [self.caller], "max_depth": 1, "ranks": [rank], "occurrence": {"mode": "first"}}


def rows_from_seen(catalogue: Catalogue, seen: Sequence[dict], probe_points: dict[str, str]) -> list[Row]:
    """Turn the baseline's ``seen`` events into rows, one per (point, caller, loop frame, loop variable).

    Args:
        seen: fire-log ``seen`` events (``id``, ``rank``, ``caller``, ``stack``, ``loops``) of scheduler ranks.
        probe_points: probe injection id -> decision point name.
    Returns:
        Rows in catalogue order, then by first sighting. Points with ``callers`` keep only rows whose first three
        stack frames match one of those globs. An event with a ``server`` (a multi-server stack's engine server,
        :func:`read_seen`) makes a row of that server; points with ``servers`` keep only those servers' rows.
    """
    rows: dict[tuple, dict] = {}
    for e in seen:
        point = probe_points.get(e.get("id", ""))
        if point is None or e.get("rank") is None:
            continue
        p = catalogue.point(point)
        stack = tuple(e.get("stack") or (e.get("caller", "?"),))
        if p.callers and not glob_any(stack[:3], p.callers):
            continue
        loops = e.get("loops") or []
        loop_frame = loop_var = None
        for i, names in enumerate(loops[:3]):
            if names and i < len(stack):
                loop_frame, loop_var = stack[i], names[-1]
                break
        caller = e.get("caller") or stack[0]
        if p.loops and ((loop_var or "") if loop_frame == caller else "") not in p.loops:
            continue
        server = e.get("server") or None
        if server and p.servers and server not in p.servers:
            continue
        key = (point, caller, loop_frame, loop_var, server)
        r = rows.setdefault(key, {"stack": stack, "ranks": set()})
        r["ranks"].add(int(e["rank"]))
    order = {p.name: i for i, p in enumerate(catalogue.points)}
    out = [Row(k[0], k[1], k[2], k[3], v["stack"], tuple(sorted(v["ranks"])), server=k[4]) for k, v in rows.items()]
    return sorted(out, key=lambda r: order[r.point])  # stable: first sighting order within a point


_EXTRA_OP = {"all_reduce": "all_reduce", "all_gather": "all_gather", "all_gather_into_tensor": "all_gather",
             "broadcast": "broadcast", "broadcast_object": "broadcast", "barrier": "barrier"}


def site_rows(catalogue: Catalogue, records: Sequence[Any], since: float, matching: Sequence[str] = ()) -> tuple[Catalogue, list[Row]]:
    """``--sites``: one row per collective call site the ledger saw since ``since`` (epoch seconds).

    Args:
        records: ``repro.ledger.Record`` objects of every rank (``api``, ``op``, ``site``, ``t_enter``, ``inj``, ``rank``).
        matching: keep only call sites one of whose recorded frames (the ledger keeps up to 4, innermost first)
            matches one of these globs (default all); the row itself is still keyed by its first 3 frames.
    Returns:
        The catalogue extended with one decision point per API (``coll-<api>``, perturbations ``skip_collective``
        and, where the API has a group on ``self``, ``extra_<op>``) and the rows (gate: the call site's first 3 frames).
    """
    perts = dict(catalogue.perturbations)
    points: dict[str, DecisionPoint] = {}
    rows: dict[tuple, dict] = {}
    for r in records:
        if r.inj or r.t_enter < since or not r.site:
            continue
        api = next((a for a in catalogue.site_apis if a.site_of(r.api)), None)
        if api is None:
            continue
        frames = tuple(r.site[:3])
        if matching and not glob_any(tuple(r.site), matching):
            continue
        name = f"coll-{r.api}"
        if name not in points:
            skip_name = f"skip_{api.prefix.replace('.', '_')}"
            perts.setdefault(skip_name, Perturbation(skip_name, dict(api.skip), f"skips its {r.api} once", True))
            names = [skip_name]
            op = _EXTRA_OP.get(r.api.rsplit(".", 1)[-1])
            if api.extra_group and op:
                extra = f"extra_{op}"
                perts.setdefault(extra, Perturbation(extra, {"kind": "extra_collective", "op": op, "group": api.extra_group},
                                                     f"issues one extra {op} before it once", True))
                names.append(extra)
            points[name] = DecisionPoint(name, (api.site_of(r.api),), f"collective call site ({r.api})", tuple(names))
        row = rows.setdefault((name, frames), {"ranks": set()})
        row["ranks"].add(int(r.rank))
    out = [Row(k[0], k[1][0], None, None, k[1], tuple(sorted(v["ranks"])), gate_frames=k[1], max_depth=12)
           for k, v in rows.items()]
    cat = dataclasses.replace(catalogue, points=catalogue.points + tuple(points.values()), perturbations=perts)
    return cat, out


@dataclass(frozen=True)
class Trial:
    """One perturbation of one row on one rank (``n``: 1-based index in the hunt), under one workload
    (``workload``: a name of the workload file, ``repro.nemeses``; "" = the base scenario's burst)."""

    n: int
    row: Row
    perturbation: Perturbation
    rank: int
    workload: str = ""

    @property
    def name(self) -> str:
        """Variant / injection id: ``t007-get_num_allocatable_reqs-zero_once-r0`` (``…-r0-wmass_abort`` under a
        workload; ``…-prefill-r0`` for a row of a multi-server stack's prefill server)."""
        on = f"-{self.row.server}" if self.row.server else ""
        return f"t{self.n:03d}-{self.row.point}-{self.perturbation.name}{on}-r{self.rank}" + (f"-w{self.workload}" if self.workload else "")

    def injection(self, sites: Sequence[str]) -> dict:
        """The scenario injection (TOML-able dict) of this trial; a stack's row names its server (``server``)."""
        inj = {"id": self.name, "site": list(sites), "action": dict(self.perturbation.action), "gate": self.row.gate(self.rank)}
        if self.row.server:
            inj["server"] = self.row.server
        return inj


def plan_trials(catalogue: Catalogue, rows: Sequence[Row], ranks: Sequence[int], perturbations: Sequence[str] = (),
                workload: str = "", first_n: int = 1) -> list[Trial]:
    """Every row × its point's perturbations (or only those named) × each rank, in that order, under ``workload``
    (numbered from ``first_n``). A stack's row (``row.server``) is tried only on the ranks of ``ranks`` on which
    the baseline saw it: its server's TP size may differ from the base scenario's.

    Raises:
        HuntError: a name in ``perturbations`` is not in the catalogue.
    """
    unknown = [x for x in perturbations if x not in catalogue.perturbations]
    if unknown:
        raise HuntError(f"--perturbation {', '.join(unknown)}: not in {catalogue.path} (nor made by --sites for the call sites this baseline saw); defined: {', '.join(sorted(catalogue.perturbations))}")
    out: list[Trial] = []
    for row in rows:
        point = catalogue.point(row.point)
        for pname in point.perturbations:
            if perturbations and pname not in perturbations:
                continue
            for rank in ranks:
                if row.server and rank not in row.ranks:
                    continue
                out.append(Trial(first_n + len(out), row, catalogue.perturbations[pname], rank, workload))
    return out


def trial_seed(base: Any, trial: Trial) -> int:
    """The burst seed of one trial: the base scenario's seed + the trial number (the baseline uses the base seed)."""
    return int(base.burst.seed) + trial.n


def read_seen(injector_dir: Path, servers: Optional[dict[str, Path]] = None) -> list[dict]:
    """All ``seen`` events of an injector folder, each with the rank of its process (None if not a rank).

    Args:
        servers: a multi-server run's engine servers, role → that server's injector folder (``servers/<role>/``
            of the run folder, :func:`server_injector_dirs`); when given, the events are read from those folders
            instead, each tagged ``server`` = its role (ranks of two servers are numbered apart by it).
    """
    from repro import injection_records

    if not servers:
        return injection_records.read_injector_dir(injector_dir).seen()
    out = []
    for role, folder in servers.items():
        out += [{**e, "server": role} for e in injection_records.read_injector_dir(folder).seen()]
    return out


def server_injector_dirs(run_folder: Path) -> dict[str, Path]:
    """role → ``servers/<role>/injector/`` of a multi-server run folder (``repro.pd``); {} for a single server."""
    from repro.evidence import Layout

    servers = Layout.server_dir(run_folder, "*").parent
    return {d.parent.name: d for d in sorted(servers.glob(f"*/{Layout.INJECTOR.name}")) if d.is_dir()}
