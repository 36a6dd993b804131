"""Shard split of a trial plan: every trial in exactly one shard; merge of shards == unsharded plan; bad K/N."""
from types import SimpleNamespace

import pytest

from repro.shard import ShardError, parse_shard, shard_trials, trial_key


def _plan():
    out = []
    for p in ("a", "b", "c", "get_num_allocatable_reqs"):
        for pert in ("zero_once", "raise_once"):
            for rank in (0, 1):
                out.append(SimpleNamespace(n=len(out) + 1, row=SimpleNamespace(point=p),
                                           perturbation=SimpleNamespace(name=pert), rank=rank, workload=""))
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_shards_partition_and_merge_equal_unsharded(n):
    plan = _plan()
    shards = [shard_trials(plan, k, n) for k in range(1, n + 1)]
    merged = sorted((t for s in shards for t in s), key=lambda t: t.n)
    assert [t.n for t in merged] == [t.n for t in plan]
    assert [trial_key(t) for t in merged] == [trial_key(t) for t in plan]
    assert [[trial_key(t) for t in s] for s in shards] == [[trial_key(t) for t in shard_trials(_plan(), k, n)] for k in range(1, n + 1)]


@pytest.mark.parametrize("bad", ["0/2", "3/2", "x/2", "1", "1/0", "1/2/3"])
def test_bad_shard_is_one_line_error(bad):
    with pytest.raises(ShardError) as e:
        parse_shard(bad)
    assert "\n" not in str(e.value) and "--shard" in str(e.value)


def test_parse_shard_ok():
    assert parse_shard("2/4") == (2, 4)
