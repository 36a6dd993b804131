"""The ``repro hunt`` entry: one server group (:func:`repro.hunt.loop.hunt_group`) or, with workloads or server
configurations, the matrix of them (:func:`repro.hunt.matrix.hunt_matrix`)."""

from __future__ import annotations

from typing import Optional

from repro.catalogue import HuntError
from repro.hunt.loop import hunt_group
from repro.hunt.matrix import hunt_matrix
from repro.hunt.options import HuntOptions, HuntResult, Observer, noop
from repro.hunt.runs import Runs
from repro.option_checks import positive_number_problem


def hunt(opts: HuntOptions, observe: Observer = noop, *, runs: Optional[Runs] = None) -> HuntResult:
    """Run a hunt: baseline burst → rows → one trial per row × perturbation × rank on a shared server; with
    ``opts.workloads`` / ``opts.configs``, one such hunt per server group of the workloads × configurations.

    Args:
        opts: see :class:`repro.hunt.options.HuntOptions`.
        observe: progress callback ``(event, data)`` (events: :func:`repro.hunt.loop.hunt_group`).
        runs: how servers are prepared, run and recorded (default: the real runner, ``repro.hunt.runs``).
    Returns:
        The :class:`HuntResult`; results also stream to ``HUNT.md`` / ``hunt.jsonl`` in ``result.folder``.
    Raises:
        HuntError: bad scenario/catalogue/option, or the baseline burst failed (message says why and where).
        KeyboardInterrupt: after the server tree was torn down, the overlay removed and HUNT.md marked interrupted.
    """
    bad_budget = positive_number_problem("--budget-min", opts.budget_min, "minutes")  # nan/inf too
    if bad_budget:
        raise HuntError(bad_budget)
    if opts.shard and (opts.workloads or opts.configs):
        raise HuntError("--shard with --workload/--config is not supported yet; shard a hunt without workloads, or "
                        "run the workloads on one box")
    if (opts.workloads or opts.configs) and not opts.group_workloads:
        return hunt_matrix(opts, observe, runs=runs)
    return hunt_group(opts, observe, runs=runs)
