"""The storage-warm workload: the `after` requests repeat the first burst prompts (their pages are then in the
storage backend only, once the driver flushed the caches); it needs after >= 1 and says so."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from repro.nemeses import Workload, warm_prompts


def test_after_requests_repeat_the_first_burst_prompts():
    prompts = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]]
    w = Workload(after=2, warm_storage={"wait_s": 0})
    assert warm_prompts(prompts, w) == [[1, 2], [3, 4], [5, 6], [1, 2], [3, 4]]
    assert warm_prompts(prompts, Workload(after=2)) == prompts  # without warm_storage: distinct prompts stay


def test_warm_storage_without_after_requests_is_refused_naming_the_fix():
    with pytest.raises(ValidationError) as e:
        Workload(warm_storage={})
    assert "set after >= 1" in str(e.value)


def test_repeat_first_repeats_the_first_burst_prompts_without_a_flush_and_needs_after():
    prompts = [[1, 2], [3, 4], [5, 6], [7, 8]]
    w = Workload(after=1, repeat_first=True)
    assert w.warm_storage is None and warm_prompts(prompts, w) == [[1, 2], [3, 4], [5, 6], [1, 2]]
    with pytest.raises(ValidationError) as e:
        Workload(repeat_first=True)
    assert "repeat_first repeats burst prompts" in str(e.value) and "set after >= 1" in str(e.value)
