"""Deterministic ``--shard K/N`` split of a hunt's trial plan (``repro hunt --shard K/N``, issue 31).

A trial belongs to shard ``K`` (1-based) of ``N`` when a stable hash (sha256) of its key
``(point, perturbation, rank, workload)`` is ``K-1`` mod ``N``; the split depends only on the plan, never on a
baseline, a clock or the process, so every trial lies in exactly one shard on every machine. The key leaves out the
row (caller, loop) the baseline finds, so a shard's keys are known before any server starts
(:func:`shard_plan_keys`); every row of a key goes to that key's shard.
"""
from __future__ import annotations

import hashlib
from typing import Any, Sequence


class ShardError(ValueError):
    """A ``--shard`` value that is not ``K/N`` with ``1 <= K <= N``."""


def parse_shard(text: str) -> tuple[int, int]:
    """``"2/4"`` → ``(2, 4)``.

    Raises:
        ShardError: not two integers ``K/N`` with ``1 <= K <= N`` (one line naming the fix).
    """
    parts = str(text).strip().split("/")
    try:
        k, n = (int(p) for p in parts)
    except ValueError:
        raise ShardError(f"--shard {text!r}: expected K/N with integers 1 <= K <= N, e.g. --shard 1/4") from None
    if n < 1 or not 1 <= k <= n:
        raise ShardError(f"--shard {text!r}: need 1 <= K <= N (got K={k}, N={n}), e.g. --shard 1/{max(n, 1)}")
    return k, n


def trial_key(trial: Any) -> tuple[str, str, int, str]:
    """The shard key of a ``repro.hunt.Trial``: (point, perturbation name, rank, workload)."""
    return (trial.row.point, trial.perturbation.name, int(trial.rank), trial.workload or "")


def shard_of(key: Sequence[Any], n: int) -> int:
    """The 1-based shard (of ``n``) of ``key`` (a tuple of str/int), by sha256 of its ``repr``."""
    digest = hashlib.sha256(repr(tuple(key)).encode()).digest()
    return int.from_bytes(digest[:8], "big") % n + 1


def shard_trials(trials: Sequence[Any], k: int, n: int) -> list[Any]:
    """The trials of shard ``k`` of ``n``, in plan order (trial numbers ``n`` kept as in the unsharded plan)."""
    if n < 1 or not 1 <= k <= n:
        raise ShardError(f"shard {k}/{n}: need 1 <= K <= N")
    return [t for t in trials if shard_of(trial_key(t), n) == k]


def shard_plan_keys(points: Sequence[Any], ranks: Sequence[int], perturbations: Sequence[str], k: int, n: int,
                    workload: str = "") -> list[tuple[str, str, int, str]]:
    """The (point, perturbation, rank, workload) keys of shard ``k`` of ``n``, before any baseline.

    Args:
        points: ``repro.hunt.DecisionPoint`` s (``name``, ``perturbations``) the hunt will probe.
        ranks: ranks the hunt perturbs. perturbations: the names asked for (empty: every one a point offers).
    Returns:
        The keys in plan order (point, then its perturbations, then rank), as :func:`trial_key` makes them.
    """
    out = []
    for pt in points:
        for pname in pt.perturbations:
            if perturbations and pname not in perturbations:
                continue
            for rank in ranks:
                key = (pt.name, pname, int(rank), workload or "")
                if shard_of(key, n) == k:
                    out.append(key)
    return out
