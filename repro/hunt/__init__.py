"""``repro hunt``: search a live server for collective-desync hazards nobody has reported yet (docs/pipeline.md, the hunt in README.md).

Every desync bug of this family has one shape: a value local to one rank (free slots, a transfer's completion, a
clock, the emptiness of a local list) steers control flow around a collective. The engine adapter contributes a
*catalogue* of such rank-local decision points (data: ``scenarios/sglang/hunt_catalogue.toml``), each with the
perturbations that make sense for it. The hunt then:

1. **baseline** — launches the base scenario's server with an observe-only probe on every decision point (action
   ``none`` + ``record_callers``: the injector writes one ``seen`` event per distinct call place, with the caller
   chain and the ``for`` loops enclosing the call), sends one clean burst, and splits each point into **rows**, one per
   (caller, enclosing loop) seen — so "inside the admission loop" and "before it" are different rows;
2. **trials** — relaunches with one injection per row × perturbation × rank in a single plan (all unarmed) and, on
   that one healthy server, arms each trial in turn (re-arming, no restart), runs the burst, records verdict and
   evidence, disarms; the server is restarted only after a hang or a crash (its tree SIGKILLed after
   ``STOP_GRACE_S``), or with ``--spare`` replaced by a spare server launched in the background while the trials
   ran (:class:`repro.hunt.spare.SparedSession`; on the 2-core CPU testbed it did not pay: benchmarks/RESULTS.md);
3. **results** stream to ``hunt.jsonl`` and ``HUNT.md`` as they come (an interrupted hunt keeps what it found): per
   trial the verdict, time to verdict, the collective that diverged, whether it is in the model's forward or in a
   scheduling/cache collective (the family we hunt, ranked first), a one-line hazard statement and, for each
   deadlock, a ready-to-run scenario file (a finding becomes a regression scenario in one step).

The package renders nothing: progress goes to an optional observer ``(event, data)``. No sglang import here.
By role (as PyTorch's flight_recorder splits types / loader / builder / matching / report):

- :mod:`repro.catalogue` — the catalogue's records and loader (shared with ``repro discover`` and ``repro reproduce``);
- :mod:`.plan` — rows from the baseline's ``seen`` events, trials; :mod:`.options` — what was asked, what came out;
- :mod:`.classify` — the diverged collective, its family, known issues, the hazard line; :mod:`.results` — a
  trial's record; :mod:`.report` — hunt.jsonl and HUNT.md; :mod:`.findings` — regression scenarios and FINDING files;
- :mod:`.loop` — the baseline and the trials on a shared server (through :mod:`.runs`, the real runner by default),
  :mod:`.spare` — the spare trial server, :mod:`.workloads` / :mod:`.matrix` — workloads and configurations,
  :mod:`.main` — the entry, :mod:`.merge` — ``repro hunt-merge`` of a sharded hunt.

This module only re-exports the names callers use (``from repro.hunt import hunt, HuntOptions, …``).
"""

from __future__ import annotations

from repro.catalogue import (DEFAULT_CATALOGUE, Catalogue, DecisionPoint, HuntError, KnownIssue, NamedCollective,
                             Perturbation, SiteApi, catalogue_for, load_catalogue)
from repro.hunt.classify import (FAMILY_FORWARD, FAMILY_SCHED, FAMILY_UNCLEAR, Diagnosis, crash_diagnosis,
                                 desync_diagnosis, diagnose, hazard_statement, known_issue)
from repro.hunt.findings import finding_scenario
from repro.hunt.loop import MAX_RESTART_FAILURES, STOP_GRACE_S, hunt_group
from repro.hunt.main import hunt
from repro.hunt.matrix import hunt_matrix
from repro.hunt.options import Clock, HuntOptions, HuntResult, Observer
from repro.hunt.plan import Row, Trial, plan_trials, read_seen, rows_from_seen, site_rows, trial_seed
from repro.hunt.report import HuntLog, matrix_markdown
from repro.hunt.results import NOT_RUN, TrialResult, rank_key
from repro.hunt.runs import Runs, RunnerRuns
from repro.hunt.spare import SparedSession
from repro.hunt.workloads import workload_extra
from repro.scenario_toml import scenario_toml

__all__ = [
    "DEFAULT_CATALOGUE", "Catalogue", "DecisionPoint", "HuntError", "KnownIssue", "NamedCollective", "Perturbation",
    "SiteApi", "catalogue_for", "load_catalogue", "FAMILY_FORWARD", "FAMILY_SCHED", "FAMILY_UNCLEAR", "Diagnosis",
    "crash_diagnosis", "desync_diagnosis", "diagnose", "hazard_statement", "known_issue", "finding_scenario",
    "MAX_RESTART_FAILURES", "STOP_GRACE_S", "hunt_group", "hunt", "hunt_matrix", "Clock", "HuntOptions", "HuntResult",
    "Observer", "Row", "Trial", "plan_trials", "read_seen", "rows_from_seen", "site_rows", "trial_seed", "HuntLog",
    "matrix_markdown", "NOT_RUN", "TrialResult", "rank_key", "Runs", "RunnerRuns", "SparedSession", "workload_extra",
    "scenario_toml",
]
