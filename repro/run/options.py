"""What a run is asked (:class:`RunOptions`), what it produced (:class:`RunResult`), the prepared plan
(:class:`Prepared`) and the errors raised before anything is launched."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from repro import evidence as ev
from repro.scenario import Scenario, Variant
from repro.verdict import Verdict


class RunError(Exception):
    """A run could not be prepared (bad input); the message names the fix. Nothing was launched."""


class UnresolvedSitesError(RunError):
    """A site of the plan resolves in no alternative in the server's sglang (found once it was healthy, before any
    burst; the server is torn down). The message names each site with the nearest names (``repro sites``)."""


@dataclass
class RunOptions:
    """What ``repro run`` was asked to do. ``None`` fields fall back to the scenario file."""

    scenario_path: Path
    variant: Optional[str] = None
    python: Optional[str] = None
    model: Optional[str] = None
    tp: Optional[int] = None
    label: Optional[str] = None
    evidence_root: Path = ev.DEFAULT_EVIDENCE_DIR
    requests: Optional[int] = None
    expect: Optional[str] = None
    native: bool = False
    command_line: str = ""
    pythonpath_prepend: Sequence[str] = ()
    extra_env: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RunResult:
    """The outcome: verdict, exit code (honouring ``--expect``), evidence folder and timings (seconds)."""

    verdict: Verdict
    exit_code: int
    evidence: Path
    expected: Optional[str]
    analysis: Any = None
    timings: dict = field(default_factory=dict)
    requests_ok: int = 0
    requests_total: int = 0
    injector: Any = None  # the run's InjectorReport (repro.injection_records), read once; None when never read


Observer = Callable[[str, dict], None]


def _noop(event: str, data: dict) -> None:
    pass


@dataclass
class Prepared:
    """Everything decided before launching: scenario, variant, evidence folder, plan, launch spec."""

    scenario: Scenario
    variant: Variant
    evidence: ev.EvidenceDir
    plan: dict
    spec: Any
    adapter: Any
    python: str
    on_testbed: bool
    arm_file: Path


ARM_FILE_NAME = ev.Layout.ARM.name
