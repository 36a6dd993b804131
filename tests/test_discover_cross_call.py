"""Discovery across calls (issue 31), on a small synthetic engine the test writes: an attribute of self written from a
rank-local query in one method and read in another, a membership test and an emptiness check on per-rank containers,
callables stored on self (a bound method, a lambda), a fixture written like sglang's pre-fix
``HiRadixCache.writing_check`` (an early return on an empty local set before the all_reduce), and the folding of
overrides of one call into one point, and of reads of one query that decide the same guards. The scan runs as a subprocess in this interpreter, as in the target's."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

from repro import discover as D
from test_discover import FAKE, PKG, _rules

CROSS = {
    "__init__.py": "",
    "dist/__init__.py": "",
    "dist/coord.py": FAKE["dist/coord.py"],
    "pool.py": """
        class Pool:
            def available_size(self):
                return self.free

        class PagedPool(Pool):
            def available_size(self):
                return self.free // 2

        class SwaPool(Pool):
            def available_size(self):
                return self.free // 4
    """,
    # the pre-fix writing_check shape: the set is filled on this rank only when its host pool had room
    "cache.py": """
        import torch
        import torch.distributed as dist

        class HiCache:
            def __init__(self, pool):
                self.pool = pool
                self.ongoing_write_through = {}
                self.on_flush = self._sync_flush

            def write_backup(self, node_id, n):
                if self.pool.available_size() >= n:
                    self.ongoing_write_through[node_id] = n

            def writing_check(self):
                if not self.ongoing_write_through:
                    return  # EARLY-RETURN
                t = torch.tensor([len(self.ongoing_write_through)])
                dist.all_reduce(t)

            def _sync_flush(self):
                t = torch.tensor([0])
                dist.all_reduce(t)
    """,
    # the same decision reached twice: two helpers read the pool and feed the same one branch (one point, the other
    # folded in); a third read feeds a branch of its own (its own point)
    "stats.py": """
        import torch
        import torch.distributed as dist
        from fakeengine.pool import Pool

        class Stats:
            def __init__(self, pool: Pool):
                self.pool = pool
                self.mamba = False

            def token_info(self):
                return self.pool.available_size()

            def mamba_info(self):
                return self.pool.available_size() - 1

            def headroom(self):
                if self.mamba:
                    return self.mamba_info()
                return self.token_info()

            def report(self):
                if self.headroom() > 0:  # SAME-DECISION
                    t = torch.tensor([0])
                    dist.all_reduce(t)

            def spare(self):
                return self.pool.available_size() + 1

            def flush(self):
                if self.spare() > 2:  # OWN-DECISION
                    t = torch.tensor([0])
                    dist.all_reduce(t)
    """,
    "sched.py": """
        import torch
        import torch.distributed as dist
        from fakeengine.cache import HiCache
        from fakeengine.pool import Pool

        class Scheduler:
            def __init__(self, pool: Pool):
                self.pool = pool
                self.cache = HiCache(self.pool)
                self.budget = 0
                self.ongoing_prefetch = {}
                self.finish_cb = lambda: self._sync()

            def plan(self):
                self.budget = self.pool.available_size()

            def run_batch(self):
                if self.budget > 0:  # CROSS-READ
                    self.cache.on_flush()

            def admit(self, rid):
                self.ongoing_prefetch[rid] = 1

            def check(self, rid):
                if rid in self.ongoing_prefetch:  # MEMBERSHIP
                    self._sync()

            def _sync(self):
                t = torch.tensor([0])
                dist.all_reduce(t)

            def tick(self):
                self.plan()
                self.admit(1)
                self.cache.write_backup(1, 2)
                self.cache.writing_check()
                self.check(1)
                self.run_batch()
                if self.pool.available_size() == 0:
                    return  # CALLABLE-GUARD
                self.finish_cb()
    """,
}


def _line(rel: str, tag: str) -> int:
    lines = textwrap.dedent(CROSS[rel]).splitlines()
    return next(i for i, x in enumerate(lines, 1) if tag in x)


@pytest.fixture(scope="module")
def cross(tmp_path_factory: pytest.TempPathFactory) -> D.Discovery:
    tmp = tmp_path_factory.mktemp("cross")
    pkg = tmp / PKG
    for rel, text in CROSS.items():
        f = pkg / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(textwrap.dedent(text), encoding="utf-8")
    rules = _rules(tmp)  # the fake engine's names; the shipped folding cap, as on a real engine
    cap = D.load_rules(D.default_rules_path("sglang"))["points"]["max_sites_per_call"]
    rules.write_text(re.sub(r"(?m)^max_sites_per_call = \d+", f"max_sites_per_call = {cap}", rules.read_text()))
    return D.discover(sys.executable, rules, root=str(pkg), use_cache=False)


def _cands(d: D.Discovery, caller: str) -> list[D.Candidate]:
    return [c for c in d.candidates if c.caller == f"{PKG}.{caller}"]


def _points_of(d: D.Discovery, c: D.Candidate) -> list[D.DiscoveredPoint]:
    return [p for p in d.points if c in p.candidates]


def test_an_attribute_written_from_a_query_in_one_method_and_read_in_another_is_rank_local(cross: D.Discovery) -> None:
    cs = [c for c in _cands(cross, "sched:Scheduler.run_batch") if c.source_kind == "cross-call attribute"]
    assert cs and cs[0].guard == "branch" and cs[0].source_line == _line("sched.py", "CROSS-READ"), [c.why for c in cs]
    # the value is perturbed where it is written: the pool query in plan()
    assert (f"{PKG}.pool:Pool.available_size", f"{PKG}.sched:Scheduler.plan", "pool query") in cs[0].leaves
    pts = _points_of(cross, cs[0])
    assert any(p.caller == f"{PKG}.sched:Scheduler.plan" and p.any_loop for p in pts), [p.name for p in pts]


def test_a_membership_test_on_a_per_rank_container_perturbs_its_writer(cross: D.Discovery) -> None:
    cs = [c for c in _cands(cross, "sched:Scheduler.check") if c.source_kind == "per-rank container"]
    assert cs and cs[0].guard == "branch" and cs[0].source_line == _line("sched.py", "MEMBERSHIP")
    assert cs[0].leaves == ((f"{PKG}.sched:Scheduler.admit", f"{PKG}.sched:Scheduler.tick", "container write"),)
    pts = _points_of(cross, cs[0])
    assert [(p.site, p.caller, p.perturbations) for p in pts] == [
        (f"{PKG}.sched:Scheduler.admit", f"{PKG}.sched:Scheduler.tick", ("skip_once",))]


def test_the_pre_fix_writing_check_early_return_on_an_empty_local_set_is_a_point(cross: D.Discovery) -> None:
    cs = [c for c in _cands(cross, "cache:HiCache.writing_check") if c.guard == "return"]
    assert cs, [c.why for c in cross.candidates]
    c = cs[0]
    assert c.source_kind == "per-rank container" and c.guard_line == _line("cache.py", "EARLY-RETURN")
    assert "all_reduce" in " ".join(c.chain) or "all_reduce" in c.collective
    leaves = set(c.leaves)
    # the set's writer (skipped once: this rank's set stays empty) and the pool query that decides the write
    assert (f"{PKG}.cache:HiCache.write_backup", f"{PKG}.sched:Scheduler.tick", "container write") in leaves
    assert (f"{PKG}.pool:Pool.available_size", f"{PKG}.cache:HiCache.write_backup", "pool query") in leaves
    pts = _points_of(cross, c)
    assert {(p.site, p.caller) for p in pts} >= {(f"{PKG}.cache:HiCache.write_backup", f"{PKG}.sched:Scheduler.tick")}
    assert all(p.huntable if hasattr(p, "huntable") else True for p in pts)


def test_callables_stored_on_self_are_followed_to_their_collective(cross: D.Discovery) -> None:
    # `self.finish_cb = lambda: self._sync()`: the early return skips a call that reaches the all_reduce
    cs = [c for c in _cands(cross, "sched:Scheduler.tick") if c.guard == "return"]
    assert cs and cs[0].guard_line == _line("sched.py", "CALLABLE-GUARD") and "self.finish_cb" in cs[0].collective
    assert cs[0].chain[0] == f"{PKG}.sched:Scheduler._sync"
    # `self.on_flush = self._sync_flush` on another class, called as `self.cache.on_flush()`
    rb = [c for c in _cands(cross, "sched:Scheduler.run_batch")]
    assert rb and rb[0].chain[0] == f"{PKG}.cache:HiCache._sync_flush"
    assert cross.scan["stored_callables"] >= 2


def test_overrides_of_one_call_are_folded_into_at_most_the_cap(cross: D.Discovery) -> None:
    # Pool.available_size in tick() lands in three overrides: one point (the rules' cap), the others named as folded
    cap = D.load_rules(D.default_rules_path("sglang"))["points"]["max_sites_per_call"]
    pts = [p for p in cross.points if p.caller == f"{PKG}.sched:Scheduler.tick" and p.site.endswith("available_size")]
    assert len(pts) == cap, [p.name for p in pts]
    folded = [x for p in pts for x in p.folded]
    assert len(folded) == 3 - cap and "folded in" in " ".join(p.what for p in pts)
    assert {p.site for p in pts} | set(folded) == {f"{PKG}.pool:{c}.available_size" for c in ("Pool", "PagedPool", "SwaPool")}
    assert f"{PKG}.pool:Pool.available_size" in {p.site for p in pts}  # no class preferred: the base class's kept


def test_the_prefer_rule_picks_the_overrides_kept(tmp_path: Path) -> None:
    groups = {(f"m:{c}.available_size", "m:S.tick", None): [] for c in ("A", "B", "C", "D")}
    rules = {"points": {"max_sites_per_call": 1, "prefer_sites": ["*:C.*"]}}
    folded = D._fold_overrides(groups, rules)
    assert list(groups) == [("m:C.available_size", "m:S.tick", None)]
    assert folded == {("m:C.available_size", "m:S.tick", None, False): ("m:A.available_size", "m:B.available_size", "m:D.available_size")}


def test_reads_of_one_query_deciding_the_same_guards_are_one_point(cross: D.Discovery) -> None:
    # token_info and mamba_info both read Pool.available_size and feed only `if self.headroom() > 0` in report():
    # the same decision reached twice, one point; spare() feeds flush()'s branch too and keeps its own
    pts = [p for p in cross.points if p.site.endswith("available_size") and p.caller.startswith(f"{PKG}.stats:")]
    callers = sorted(p.caller.rsplit(".", 1)[-1] for p in pts)
    assert len(callers) == 2 and "spare" in callers and len({"token_info", "mamba_info"} & set(callers)) == 1, callers
    kept = next(p for p in pts if not p.caller.endswith("spare"))
    other = ({"token_info", "mamba_info"} - set(callers)).pop()
    assert [c.rsplit(".", 1)[-1] for _s, c in kept.same_decisions] == [other]
    assert "also reached through" in kept.what and not next(p for p in pts if p.caller.endswith("spare")).same_decisions
    guards = {(c.caller, c.guard_line) for c in kept.candidates}
    assert guards == {(f"{PKG}.stats:Stats.report", _line("stats.py", "SAME-DECISION"))}
    assert "# folded in (the same query deciding the same guards)" in D.points_toml(cross.points)


def test_same_decisions_fold_only_when_the_rules_ask() -> None:
    c = D.Candidate("m:S.report", "pool query", "self.h()", 3, ("m:S.h",), None, "branch", 3, "x", (), "", 1,
                    leaves=(("m:P.available_size", "m:S.a", "pool query"), ("m:P.available_size", "m:S.b", "pool query")))
    on = {"points": {"max_sites_per_call": 1, "fold_same_decisions": True}, "perturbations_by_kind": {"pool query": ["zero_once"]}}
    off = {"points": {"max_sites_per_call": 1}, "perturbations_by_kind": {"pool query": ["zero_once"]}}
    leaf = lambda ps: sorted(p.caller for p in ps if p.site == "m:P.available_size")  # noqa: E731
    assert leaf(D.discovered_points([c], on, ["zero_once"])) == ["m:S.a"]
    assert leaf(D.discovered_points([c], off, ["zero_once"])) == ["m:S.a", "m:S.b"]


def test_the_scan_reports_its_cpu_seconds_per_stage(cross: D.Discovery) -> None:
    # issue 31's scan-time goal is read in CPU seconds on a shared box: every timed stage has its CPU figure
    wall, cpu = cross.scan["seconds"], cross.scan["cpu_seconds"]
    assert set(cpu) == set(wall) >= {"parse", "types", "returners", "cross_call", "guards", "total"}
    assert 0 < cpu["total"] and sum(v for k, v in cpu.items() if k != "total") <= cpu["total"] + 0.05


def test_an_unreached_point_names_the_reads_folded_into_it(cross: D.Discovery) -> None:
    from repro.discover import hunting as Hn

    kept = next(p for p in cross.points if p.same_decisions)
    st = Hn.DiscoveryState(cross, [kept], (), True)
    line = Hn.after_baseline(st, [])[kept.name]
    assert "fold_same_decisions" in line and kept.same_decisions[0][1].rsplit(".", 1)[-1] in line, line
