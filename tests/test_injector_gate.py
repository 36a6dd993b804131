"""The stack gate on real frames: caller patterns, decorator frames, depth, inside_loop, qualname fallback."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "injectors"))

from repro_injector.gate import Gate, frame_name, loop_ranges  # noqa: E402

MOD = __name__


def decorator(fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        return fn(*a, **k)

    return wrapper


class Scheduler:
    """Shapes mirror sglang's Scheduler: a loop site, a decorated stage method, a bulk pre-pass."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.seen: list[tuple[str, bool]] = []

    def site(self, tag: str) -> None:
        self.seen.append((tag, self.gate.check(sys._getframe(1))))

    def get_new_batch(self, queue):
        self.site("before")
        for req in queue:
            self.site(f"in:{req}")
        self.site("after")  # req is still bound here: must not count as inside the loop

    def tuple_loop(self, queue):
        for i, req in enumerate(queue):
            self.site(f"in:{i}")
        self.site("after")

    def loop_with_handler(self, queue):
        for req in queue:
            try:
                raise KeyError(req)
            except KeyError:
                self.site("handler")  # an out-of-line except block of the loop body
        self.site("after")

    @decorator
    def decorated_stage(self):
        self.site("decorated")

    def via_decorated(self):
        self.decorated_stage()

    def bulk_check(self):
        self.get_new_batch([1])

    def deep(self, n):
        if n == 0:
            self.site("deep")
        else:
            self.deep(n - 1)


def run(gate: Gate, method: str, *args) -> list[tuple[str, bool]]:
    s = Scheduler(gate)
    getattr(s, method)(*args)
    return s.seen


def test_called_from_matches_only_the_named_caller():
    g = Gate([f"{MOD}:Scheduler.get_new_batch"])
    assert run(g, "get_new_batch", [1]) == [("before", True), ("in:1", True), ("after", True)]
    assert run(g, "tuple_loop", [1]) == [("in:0", False), ("after", False)]
    assert g.last_caller is None or g.last_caller == f"{MOD}:Scheduler.get_new_batch"


def test_pattern_without_module_and_globs():
    assert run(Gate(["Scheduler.get_new_*"]), "get_new_batch", [])[0] == ("before", True)
    assert run(Gate(["*:Scheduler.get_new_batch"]), "get_new_batch", [])[0] == ("before", True)
    assert run(Gate(["other.module:Scheduler.get_new_batch"]), "get_new_batch", [])[0] == ("before", False)


def test_not_called_from_blocks_a_bulk_prepass():
    g = Gate([f"{MOD}:Scheduler.get_new_batch"], not_called_from=["*:Scheduler.bulk_check"])
    assert run(g, "get_new_batch", [1])[0] == ("before", True)
    assert run(g, "bulk_check")[0] == ("before", False)


def test_decorator_wrapper_frames_are_transparent_and_not_counted_in_depth():
    # site <- decorated_stage <- wrapper (functools closure) <- via_decorated: with max_depth=2 the wrapper frame
    # must not use up a slot, otherwise via_decorated would be out of reach.
    g = Gate([f"{MOD}:Scheduler.via_decorated"], max_depth=2)
    assert run(g, "via_decorated") == [("decorated", True)]
    g1 = Gate([f"{MOD}:Scheduler.via_decorated"], max_depth=1)
    assert run(g1, "via_decorated") == [("decorated", False)]
    # the wrapper itself is never a match target
    assert run(Gate([f"{MOD}:decorator.<locals>.wrapper"]), "via_decorated") == [("decorated", False)]


def test_max_depth_bounds_the_search():
    g = Gate([f"{MOD}:test_max_depth_bounds_the_search"], max_depth=3)
    assert run(g, "deep", 5) == [("deep", False)]
    g_far = Gate([f"{MOD}:test_max_depth_bounds_the_search"], max_depth=12)
    assert run(g_far, "deep", 5) == [("deep", True)]


def test_inside_loop_matches_only_while_the_loop_runs():
    g = Gate([f"{MOD}:Scheduler.get_new_batch"], inside_loop="req")
    assert run(g, "get_new_batch", [1, 2]) == [("before", False), ("in:1", True), ("in:2", True), ("after", False)]


def test_inside_loop_with_tuple_target_and_except_handler():
    g = Gate(["Scheduler.tuple_loop"], inside_loop="req")
    assert run(g, "tuple_loop", ["a"]) == [("in:0", True), ("after", False)]
    h = Gate(["Scheduler.loop_with_handler"], inside_loop="req")
    assert run(h, "loop_with_handler", ["a", "b"]) == [("handler", True), ("handler", True), ("after", False)]


def test_inside_loop_of_another_name_never_matches():
    g = Gate([f"{MOD}:Scheduler.get_new_batch"], inside_loop="item")
    assert [m for _, m in run(g, "get_new_batch", [1])] == [False, False, False]
    assert loop_ranges(Scheduler.get_new_batch.__code__, "item") == ()
    assert loop_ranges(Scheduler.get_new_batch.__code__, "req")


@pytest.mark.parametrize("use_qualname", [True, False])
def test_qualname_fallback_names_methods_by_their_defining_class(use_qualname):
    class Base:
        def caller(self):
            return sys._getframe(0)

    class Child(Base):
        pass

    frame = Child().caller()
    name = frame_name(frame, use_qualname=use_qualname)
    assert name.endswith(".Base.caller")  # the defining class, not type(self)
    assert name == frame_name(frame, use_qualname=True)
    g = Gate(["*Base.caller"], use_qualname=use_qualname)
    assert g.check(frame)
    assert not Gate(["*Child.caller"], use_qualname=use_qualname).check(frame)


def test_qualname_fallback_gate_with_loop_and_decorators():
    g = Gate([f"{MOD}:Scheduler.get_new_batch"], inside_loop="req", use_qualname=False)
    assert run(g, "get_new_batch", [7]) == [("before", False), ("in:7", True), ("after", False)]
    d = Gate([f"{MOD}:Scheduler.via_decorated"], max_depth=2, use_qualname=False)
    assert run(d, "via_decorated") == [("decorated", True)]


def test_trivial_gate_always_passes():
    assert run(Gate(), "get_new_batch", []) == [("before", True), ("after", True)]
