"""What ``repro hunt`` was asked (:class:`HuntOptions`), what it produced (:class:`HuntResult`), its progress
observer and its budget clock."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from repro import evidence as ev
from repro.verdict import DEADLOCKED

Observer = Callable[[str, dict], None]


def noop(event: str, data: dict) -> None:
    """The observer that ignores every progress event."""


@dataclass
class HuntOptions:
    """What ``repro hunt`` was asked.

    Attributes:
        scenario_path: base scenario (server + burst; its variants are ignored).
        catalogue_path: hunt catalogue (default: the base scenario's adapter's, ``Adapter.hunt_catalogue``).
        only: decision point names to hunt (default all). perturbations: perturbation names (default all that apply).
        ranks: ranks to perturb one at a time (default every rank of the TP group).
        budget_min: wall-clock budget in minutes for the whole hunt; trials not started in time are NOT RUN.
        ref: code to hunt in, a REF (``repro.refs``) (``installed``, ``patch:FILE``, ``git:PATH@REV``, ``python:PATH``).
        sites: also perturb every collective call site the ledger saw in the baseline burst (skip once, extra once);
            ``sites_matching``: only call sites whose frames match these globs.
        confirm: re-run each new scheduling/cache finding from its scenario file on a fresh server.
        discover: add the decision points ``repro discover`` proposes from the engine's source (hand points win);
            ``hand_points`` False drops the hand catalogue's points (discovery alone; its perturbations, collective
            names and known issues stay); ``discover_rules``: the rules file (default: the adapter's).
        spare: a second trial server (same plan, its own folder ``…-hunt-spare``) is launched as soon as the trial
            server is healthy; after a hang or a crash the hunt swaps to it instead of restarting (False, the
            default: restart). Pays where start-up leaves the CPU idle (weights read from disk); on the 2-core CPU
            testbed start-up is CPU-bound and it did not (benchmarks/RESULTS.md, benchmarks/hunt_restarts.py).
        natural: the natural hunt (``--natural``): the catalogue defaults to ``natural_nemeses.toml`` beside the
            adapter's hunt catalogue and must hold only natural perturbations plus at most one ``control = true``
            (``repro.catalogue.check_natural``); rows carry the nature and the state effect (``repro.natural_effect``).
    """

    scenario_path: Path
    catalogue_path: Optional[Path] = None  # None: the base scenario's adapter's catalogue
    only: Sequence[str] = ()
    perturbations: Sequence[str] = ()
    ranks: Sequence[int] = ()
    budget_min: float = 30.0
    evidence_root: Path = ev.DEFAULT_EVIDENCE_DIR
    python: Optional[str] = None
    ref: str = "installed"
    sites: bool = False
    sites_matching: Sequence[str] = ()
    confirm: bool = False
    requests: Optional[int] = None
    command_line: str = ""
    discover: bool = False
    hand_points: bool = True
    discover_rules: Optional[Path] = None
    workloads: Sequence[str] = ()  # workload nemeses (repro.nemeses; "all": every one of the file); quiet always first
    configs: Sequence[str] = ()  # server configurations (axes) beside the base scenario's own
    workload_file: Optional[Path] = None  # default: hunt_workloads.toml beside the catalogue
    group_workloads: Sequence[str] = ()  # set by hunt_matrix: the workloads of one server group (one hunt)
    clean_only: bool = False  # with workloads: only each workload's clean run (no trials): "is the engine safe under it?"
    spare: bool = False  # keep a spare trial server starting in the background; a hang swaps to it (SparedSession)
    shard: Optional[tuple[int, int]] = None  # (K, N): only the trials of shard K of N (repro.shard); None: all
    natural: bool = False  # only natural nemeses (+ one control row): the adapter's natural catalogue by default


@dataclass
class HuntResult:
    """What a hunt produced: its folder (HUNT.md, hunt.jsonl, scenarios/), rows, results, timings (seconds)."""

    folder: Path
    rows: list
    results: list
    interrupted: bool = False
    budget_exhausted: bool = False
    wall_s: float = 0.0
    baseline: Optional[Path] = None
    discovery: Optional[dict] = None  # --discover: rows reached/fired by origin and discovery's precision
    findings: list = field(default_factory=list)  # FINDING-<workload>.md of clean workloads that deadlocked/desynced
    workload_baselines: list = field(default_factory=list)  # hunt.jsonl's workload_baseline records, as written
    empty_shard: str = ""  # --shard K/N whose part of the plan is empty: "K/N" (no baseline, no server, nothing run)

    @property
    def deadlocks(self) -> list:
        return [r for r in self.results if r.verdict == DEADLOCKED]


class Clock:
    """The hunt's budget: seconds ``elapsed`` since it was made and ``remaining`` of ``budget_s`` (never below 0)."""

    def __init__(self, budget_s: float) -> None:
        self.t0 = time.time()
        self.budget_s = budget_s

    @property
    def elapsed(self) -> float:
        return time.time() - self.t0

    @property
    def remaining(self) -> float:
        return max(0.0, self.budget_s - self.elapsed)
