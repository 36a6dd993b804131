"""Deterministic ``--shard K/N`` split of a hunt's trial plan (issue 31, part 2; not yet wired into the CLI).

A trial belongs to shard ``K`` (1-based) of ``N`` when a stable hash (sha256) of its key
``(point, perturbation, rank, workload)`` is ``K-1`` mod ``N``; the split depends only on the plan, never on a
baseline, a clock or the process, so every trial lies in exactly one shard on every machine.
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
