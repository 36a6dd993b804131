"""Discovery's AST analysis (repro/discover/scan.py, run as a subprocess like in the target interpreter) on a small
synthetic engine package the test writes, plus the catalogue merge and one scan of the installed sglang 0.5.23.

The fake engine has the #30760 shape (a free-slot count read before and inside the loop over the waiting queue,
a `break` that skips later iterations reaching an all_reduce through a cache built by a factory), values every rank
agrees on that must NOT be candidates (the waiting queue's length, an all_reduced value, a broadcast object), an
attribute written by a Thread target, and a call that resolves to nothing (listed, not guessed).
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

from repro import discover as D
from repro import hunt as H
from repro.hunt import loop as HL

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "scenarios" / "sglang" / "discover_rules.toml"

FAKE = {
    "__init__.py": "",
    "dist/__init__.py": "",
    "dist/coord.py": """
        import torch.distributed as dist

        class GroupCoordinator:
            def all_reduce(self, t):
                dist.all_reduce(t, group=self.cpu_group)
                return t

        def broadcast_pyobj(data, rank, group):
            dist.broadcast_object_list([data], src=0, group=group)
            return data

        def get_tp_group() -> GroupCoordinator:
            return _TP
    """,
    "cache.py": """
        import torch
        from torch import distributed as tdist

        class BaseCache:
            def check_progress(self, handle):
                return True

        class PrefetchCache(BaseCache):
            def check_progress(self, handle):
                return self._can_terminate(handle)

            def _can_terminate(self, handle):
                t = torch.tensor([1])
                tdist.all_reduce(t)
                return t.item() == 1

        def make_cache() -> BaseCache:
            return PrefetchCache()

        class Op:
            def is_terminated(self):
                return self.flag
    """,
    "pool.py": """
        class Pool:
            def available_size(self):
                return self.free

        class PagedPool(Pool):
            def available_size(self):
                return self.free // 2
    """,
    "budget.py": """
        class Budget:
            def __init__(self, pool):
                self.pool = pool

            @property
            def remaining(self):
                return self.pool.available_size() - 1

            def has_room(self):
                return self.remaining > 0

        def make_budget(pool):
            return Budget(pool)

        class Adder:
            def __init__(self, pool):
                self.budget = make_budget(pool)

            def add(self, req):
                if not self.budget.has_room():
                    return 1
                return 0
    """,
    "sched.py": """
        import threading
        import torch
        import torch.distributed as dist
        from fakeengine.cache import Op, make_cache
        from fakeengine.pool import Pool
        from fakeengine.dist.coord import broadcast_pyobj, get_tp_group
        from fakeengine.budget import Adder

        class Batch:
            is_full: bool = False

        class Scheduler:
            def __init__(self):
                self.cache = make_cache()
                self.pool = Pool()
                self.waiting_queue = []
                self.ready = 0
                threading.Thread(target=self._poll_loop, daemon=True).start()

            def _poll_loop(self):
                while True:
                    self.ready = 1

            def free_slots(self) -> int:
                return self.pool.available_size()

            def admit(self, batch: Batch):
                if self.free_slots() <= 0:
                    return None
                n = len(self.waiting_queue)
                if n > 3:
                    self.cache.check_progress(None)
                out = []
                for req in self.waiting_queue:
                    if len(out) >= self.free_slots():
                        batch.is_full = True
                    if batch.is_full:
                        break
                    if not self.cache.check_progress(req):
                        continue
                    out.append(req)
                return out

            def agreed(self):
                x = self.free_slots()
                t = torch.tensor([x])
                dist.all_reduce(t)
                if t.item() > 0:
                    self.cache.check_progress(None)
                y = broadcast_pyobj(self.free_slots(), 0, None)
                if y:
                    get_tp_group().all_reduce(t)

            def mystery(self):
                if self.pool.available_size() == 0:
                    self.unknown_thing.frobnicate()
                    self.cache.check_progress(None)

            def tick(self):
                if self.ready:
                    dist.barrier()

            def adder_class(self) -> "type[Adder]":
                return Adder

            def admit_through_a_budget(self):
                adder = self.adder_class()(self.pool)
                for req in self.waiting_queue:
                    if adder.add(req) != 0:
                        break
                    self.cache.check_progress(req)

            def plan(self) -> "Batch":
                return Batch(self.free_slots())

            def maybe_batch(self):
                n = self.free_slots()
                if n == 0:
                    return None
                return self.waiting_queue[:n]

            def has_slots(self):
                return self.free_slots() > 0

            def step(self):
                if self.plan().size:
                    self.cache.check_progress(None)
                if self.maybe_batch() is None:
                    self.cache.check_progress(None)
                if not self.has_slots():
                    self.cache.check_progress(None)

            def progress(self, key):
                self.ops: dict[str, Op] = {}
                op = self.ops[key]
                if not op.is_terminated():
                    self.cache.check_progress(key)
    """,
}
PKG = "fakeengine"


def _write_fake(root: Path) -> Path:
    pkg = root / PKG
    for rel, text in FAKE.items():
        f = pkg / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(textwrap.dedent(text), encoding="utf-8")
    return pkg


def _rules(tmp_path: Path) -> Path:
    text = RULES.read_text(encoding="utf-8")
    text = text.replace('package = "sglang"', f'package = "{PKG}"').replace('include = ["sglang.srt"]', f'include = ["{PKG}"]')
    text = text.replace("sglang.srt.distributed.parallel_state:GroupCoordinator", f"{PKG}.dist.coord:GroupCoordinator")
    text = text.replace('object_broadcasts = ["sglang.srt.utils.common:broadcast_pyobj"]', f'object_broadcasts = ["{PKG}.dist.coord:broadcast_pyobj"]')
    # every override keeps its point here (the folding of overrides is tested in test_discover_cross_call.py)
    text = re.sub(r"(?m)^max_sites_per_call = \d+", "max_sites_per_call = 8", text)
    p = tmp_path / "rules.toml"
    p.write_text(text, encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> D.Discovery:
    tmp = tmp_path_factory.mktemp("fake")
    pkg = _write_fake(tmp)
    return D.discover(sys.executable, _rules(tmp), root=str(pkg), use_cache=False)


def _cands(d: D.Discovery, caller: str) -> list[D.Candidate]:
    return [c for c in d.candidates if c.caller == f"{PKG}.sched:Scheduler.{caller}"]


def test_the_30760_shape_gives_a_break_inside_the_loop_and_a_return_before_it(fake: D.Discovery) -> None:
    cs = _cands(fake, "admit")
    brk = [c for c in cs if c.guard == "break" and c.loop_var == "req"]
    assert brk, [c.why for c in cs]
    assert brk[0].sites == (f"{PKG}.sched:Scheduler.free_slots",) and brk[0].source_kind == "pool query"
    # the skipped later iterations reach the all_reduce through the factory-built cache (declared BaseCache: the
    # subclass's override is followed, never guessed by name)
    assert brk[0].chain[0] == f"{PKG}.cache:PrefetchCache.check_progress" and brk[0].chain[-1] == "torch.distributed.all_reduce"
    assert any(c.guard == "return" and c.loop_var is None for c in cs)
    names = {p.name: p for p in fake.points}
    loop_pts = [p for p in fake.points if p.caller.endswith("Scheduler.admit") and p.loop_var == "req"]
    assert len(loop_pts) == 1 and loop_pts[0].perturbations == ("zero_once", "minus_one") and loop_pts[0].name in names


def test_values_every_rank_agrees_on_are_not_candidates(fake: D.Discovery) -> None:
    # len(waiting_queue) is the request broadcast's: the `n > 3` branch is not a candidate
    assert not [c for c in _cands(fake, "admit") if c.guard == "branch"]
    # an all_reduced tensor and a broadcast object decide nothing rank-local
    assert _cands(fake, "agreed") == []
    # the result of a collective-reaching call (check_progress) guarding `continue` is not rank-local either
    assert not [c for c in _cands(fake, "admit") if c.guard == "continue"]


def test_an_unresolved_call_is_listed_not_guessed(fake: D.Discovery) -> None:
    cs = _cands(fake, "mystery")
    # a call on a Pool may land in its subclass's override: both are sites (the model builds one of them)
    assert cs and cs[0].sites == (f"{PKG}.pool:PagedPool.available_size", f"{PKG}.pool:Pool.available_size")
    assert cs[0].guard == "branch"
    unres = fake.scan["unresolved_in_guarded"][f"{PKG}.sched:Scheduler.mystery"]
    assert any("self.unknown_thing.frobnicate" in u for u in unres)
    assert "frobnicate" not in " ".join(" ".join(c.chain) for c in fake.candidates)


def test_an_attribute_a_thread_writes_is_rank_local_but_has_no_site_to_perturb(fake: D.Discovery) -> None:
    cs = _cands(fake, "tick")
    assert [(c.source_kind, c.guard, c.huntable) for c in cs] == [("thread-written attribute", "branch", False)]
    assert fake.scan["thread_attrs"][f"{PKG}.sched:Scheduler"] == ["ready"]


def test_points_merge_into_the_catalogue_and_hand_points_win(fake: D.Discovery, tmp_path: Path) -> None:
    hand = H.load_catalogue(H.DEFAULT_CATALOGUE)
    pt = fake.points[0]
    clash = D.DiscoveredPoint("d.clash", hand.points[0].sites[0], "m:f", "x", ("zero_once",), ())
    merged, added = D.merge_catalogue(hand, [pt, clash], D.load_rules(RULES))
    assert [p.name for p in merged.points[: len(hand.points)]] == [p.name for p in hand.points]
    assert added == [pt] and merged.point(pt.name).callers == (pt.caller,)
    alone, _ = D.merge_catalogue(hand, [pt, clash], D.load_rules(RULES), keep_hand_points=False)
    assert [p.name for p in alone.points] == [pt.name, "d.clash"] and alone.known == hand.known
    # the points as catalogue data load back as a hunt catalogue
    f = tmp_path / "cat.toml"
    perts = (REPO / "scenarios" / "sglang" / "hunt_catalogue.toml").read_text().split("[[points]]")[0].replace("version = 1", "")
    f.write_text(D.points_toml(fake.points) + perts, encoding="utf-8")
    back = H.load_catalogue(f)
    assert {p.name for p in back.points} == {p.name for p in fake.points}
    assert back.point(pt.name).loops == ((pt.loop_var or ""),)


def test_a_discovered_point_keeps_only_the_rows_of_its_loop() -> None:
    cat = H.load_catalogue(H.DEFAULT_CATALOGUE)
    import dataclasses

    p = H.DecisionPoint("d.x", ("m:C.f",), "", ("zero_once",), ("m:C.g",), ("req",))
    cat = dataclasses.replace(cat, points=(p,))
    seen = [{"event": "seen", "id": "probe-d.x", "rank": 0, "caller": "m:C.g", "stack": ["m:C.g"], "loops": [[]]},
            {"event": "seen", "id": "probe-d.x", "rank": 0, "caller": "m:C.g", "stack": ["m:C.g"], "loops": [["req"]]}]
    rows = H.rows_from_seen(cat, seen, {"probe-d.x": "d.x"})
    assert [(r.caller, r.loop_var) for r in rows] == [("m:C.g", "req")]


def test_bad_rules_name_the_file_and_field(tmp_path: Path) -> None:
    with pytest.raises(D.DiscoverError, match="not found"):
        D.load_rules(tmp_path / "none.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text('package = "x"\n[collectives]\ntorch_functions = []\n')
    with pytest.raises(D.DiscoverError, match=r"bad\.toml: collectives\.torch_functions"):
        D.load_rules(bad)


def test_binary_rules_file_is_a_clear_error(tmp_path: Path) -> None:
    # issue 29 item 2: `discover --rules <binary file>` was a UnicodeDecodeError traceback
    binary = tmp_path / "bin.dat"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 64)
    with pytest.raises(D.DiscoverError, match=r"bin\.dat: not a UTF-8 text file"):
        D.load_rules(binary)


def _testbed_python() -> str:
    from repro import testbed

    if not testbed.is_set_up():
        pytest.skip("the CPU testbed (sglang 0.5.23) is not set up: bash scripts/cpu_testbed/setup.sh")
    return str(testbed.testbed_python())


def test_the_30760_decision_points_are_among_the_candidates_in_the_installed_sglang() -> None:
    d = D.discover(_testbed_python(), RULES)
    prefill = "sglang.srt.managers.scheduler:Scheduler._get_new_batch_prefill_raw"
    gnar = "sglang.srt.managers.scheduler:Scheduler.get_num_allocatable_reqs"
    cs = [c for c in d.candidates if c.caller == prefill and gnar in c.sites]
    # inside `for req in self.waiting_queue`: the free-slot count decides a break that skips the later requests'
    # check_prefetch_progress (its all_reduce in UnifiedRadixCache._can_terminate_prefetch's path)
    inloop = [c for c in cs if c.loop_var == "req" and c.guard == "break"]
    assert inloop and "check_prefetch_progress" in inloop[0].collective
    assert inloop[0].chain[0].endswith("UnifiedRadixCache.check_prefetch_progress")
    # before the loop: the same count decides an early return / a break of the later loop
    assert any(c.loop_var is None and c.guard in ("return", "break") for c in cs)
    pts = {(p.site, p.caller, p.loop_var) for p in d.points}
    assert {(gnar, prefill, "req"), (gnar, prefill, None)} <= pts
    # the waiting queue's length is the request broadcast's: no candidate's source is len(self.waiting_queue)
    assert not [c for c in d.candidates if "waiting_queue" in c.source]
    # get_next_batch_to_run returns a NextBatchPlan (0.5.23): no value fits in its place, so it is no point (session
    # 6's hunt gave it 0 and crashed the scheduler); the free-slot count keeps its drifts
    nbr = "sglang.srt.managers.scheduler:Scheduler.get_next_batch_to_run"
    assert d.scan["return_types"][nbr] == ["object"] and not [p for p in d.points if p.site == nbr]
    assert {p.perturbations for p in d.points if p.site == gnar} == {("zero_once", "minus_one")}


# ------------------------------------------------------------------------------------------ the hunt, stand-in runner
def test_hunt_discover_without_hand_points_hunts_the_discovered_rows_and_judges_discovery(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from test_hunt import FakeRunner, _seen

    from repro.verdict import DEADLOCKED

    monkeypatch.setattr(HL, "SETTLE_S", 0.0)
    _write_fake(tmp_path)
    rules = _rules(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the scan's interpreter finds the fake engine with find_spec
    monkeypatch.setattr(HL, "_discovery_python", lambda opts, adapter: sys.executable)
    monkeypatch.setenv("REPRO_DISCOVER_CACHE", "off")
    # the fake engine imports torch, which this interpreter may lack: the patchability preflight (tested on the
    # real testbed below) would leave its sites out; the stand-in runner patches nothing anyway
    from repro.discover import hunting as Hn
    monkeypatch.setattr(Hn, "_unpatchable", lambda points, python: {})
    admit, mystery = f"{PKG}.sched:Scheduler.admit", f"{PKG}.sched:Scheduler.mystery"
    fr = FakeRunner({"-zero_once-r0": DEADLOCKED})

    class Session(fr.Session):  # the baseline sees the in-loop free-slot read and the paged pool (never the base Pool)
        def drive(self, variant, run_dir, n=None, native=False):
            out = super().drive(variant, run_dir, n, native)
            if variant.name == "baseline":
                ids = {i.id for i in variant.injections}
                loop = next(i for i in ids if i.endswith("free_slots--admit.in-req"))[len("probe-"):]
                paged = next(i for i in ids if "PagedPool.available_size--mystery" in i)[len("probe-"):]
                lines = [_seen(loop, [admit, "m:a"], [["req"], []]), _seen(loop, [admit, "m:a"], [[], []]),
                         _seen(paged, [mystery, "m:a"], [[], []])]
                (self.p.evidence.injector_dir / "fires-100.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
            return out

    fr.Session = Session
    res = H.hunt(H.HuntOptions(scenario_path=REPO / "scenarios" / "sglang" / "hicache_prefetch_30760.toml",
                               evidence_root=tmp_path / "ev", discover=True, hand_points=False, discover_rules=rules,
                               perturbations=("zero_once",), ranks=(0,)), runs=fr)
    # only the loop's row of the in-loop point (its out-of-loop sighting belongs to the other point) and the paged pool
    assert sorted((r.caller, r.loop_var) for r in res.rows) == [(admit, "req"), (mystery, None)]
    assert all(r.point.startswith("d.") for r in res.rows)
    p = res.discovery["points"]
    assert p["reached"] == 2 and p["fired"] == 2 and p["deadlocked"] == 2
    assert res.discovery["rows"] == {"discovered": {"reached": 2, "fired": 2}}
    prec = (res.folder / "discovery" / "PRECISION.md").read_text()
    assert "`Pool.available_size` is never built by this model; it built `PagedPool.available_size` instead" in prec
    assert (res.folder / "discovery" / "catalogue.toml").is_file() and "discovery/DISCOVERY.md" in (res.folder / "HUNT.md").read_text()


def test_no_hand_catalogue_needs_discover(tmp_path: Path) -> None:
    with pytest.raises(H.HuntError, match="--no-hand-catalogue needs --discover"):
        H.hunt(H.HuntOptions(scenario_path=REPO / "scenarios" / "sglang" / "hicache_prefetch_30760.toml",
                             evidence_root=tmp_path, hand_points=False))


def test_a_desynced_trial_gets_its_section_a_scenario_expecting_desync_and_a_named_collective(tmp_path: Path) -> None:
    from test_hunt import FakeRunner, _opts

    from repro.scenario import load_scenario
    from repro.verdict import DESYNCED

    res = H.hunt(_opts(tmp_path), runs=FakeRunner({"-zero_once-r0": DESYNCED}))
    des = [r for r in res.results if r.verdict == DESYNCED]
    assert des and all(r.scenario_file for r in des)
    assert load_scenario(des[0].scenario_file).variants[0].expect == "desync"
    md = (res.folder / "HUNT.md").read_text()
    assert "## Desyncs (the collective ledgers show" in md
    assert H.rank_key(des[0]) < H.rank_key(next(r for r in res.results if r.verdict != DESYNCED))
    # the desync record's call-site frames name the collective like a deadlock's stacks do
    from repro.hunt.classify import desync_diagnosis

    cat = H.load_catalogue(H.DEFAULT_CATALOGUE)
    rec = {"0": {"rank": 0, "op": "broadcast", "site": ["m:Scheduler.recv_requests"]},
           "1": {"rank": 1, "op": "all_reduce", "site": ["sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache._can_terminate_prefetch",
                                                        "sglang.srt.managers.scheduler:Scheduler._get_new_batch_prefill_raw"]}}
    d = desync_diagnosis({"group": "tp", "seq": 7, "records": rec}, cat)
    assert d.collective.startswith("prefetch all_reduce") and d.known == "sglang#30760" and d.family == H.FAMILY_SCHED


def test_a_value_returned_through_a_factory_a_property_and_two_methods_keeps_its_innermost_query(fake: D.Discovery) -> None:
    # adder = self.adder_class()(pool); adder.add(req) → budget.has_room() → budget.remaining (a property) →
    # pool.available_size(): the break in the loop is guarded by the pool query four calls down, and the point to
    # perturb is that query in the rows of its own direct caller (the property's getter), in whatever loop
    cs = [c for c in _cands(fake, "admit_through_a_budget") if c.guard == "break"]
    assert cs and cs[0].source == "adder.add()" and cs[0].loop_var == "req"
    assert "check_progress" in cs[0].collective
    pool, getter = f"{PKG}.pool:Pool.available_size", f"{PKG}.budget:Budget.remaining"
    assert (pool, getter, "pool query") in cs[0].leaves
    pts = [p for p in fake.points if p.site == pool and p.caller == getter]
    assert pts and pts[0].any_loop and pts[0].loops == ()
    assert "zero_once" in pts[0].perturbations
    toml = D.points_toml(pts)
    assert 'loops = []' in toml and f'callers = ["{getter}"]' in toml


def test_an_element_of_an_annotated_container_has_its_class(fake: D.Discovery) -> None:
    # self.ops: dict[str, Op]; op = self.ops[key]; op.is_terminated() is a poll deciding a collective-reaching call
    cs = _cands(fake, "progress")
    assert [(c.source_kind, c.guard, c.sites) for c in cs] == [("poll", "branch", (f"{PKG}.cache:Op.is_terminated",))]


def test_a_discovered_site_the_injector_cannot_patch_is_left_out_with_the_reason() -> None:
    # a property getter (reading it is a call, but the injector wraps functions and methods) and a module whose
    # optional dependency is missing in the testbed (lmcache) are named, not hunted; a plain method stays
    from repro.discover import hunting as Hn

    mk = lambda name, site: D.DiscoveredPoint(name, site, "c", "what", ("zero_once",), ())  # noqa: E731
    got = Hn._unpatchable([
        mk("prop", "sglang.srt.managers.schedule_policy:PrefillAdder.rem_total_tokens"),
        mk("lm", "sglang.srt.mem_cache.storage.lmcache.lmcache_unified_radix_cache:LMCacheUnifiedRadixCache._allocate_external_slots"),
        mk("ok", "sglang.srt.managers.scheduler:Scheduler.get_num_allocatable_reqs"),
    ], _testbed_python())
    assert set(got) == {"prop", "lm"}
    assert "property" in got["prop"] and "lmcache" in got["lm"]


def test_a_returner_sites_perturbation_follows_what_it_returns(fake: D.Discovery) -> None:
    # plan() -> "Batch" built from the free-slot count: an object, so no value fits in its place (0 crashed sglang's
    # scheduler in session 6) and no point is made at it; maybe_batch() returns None or a slice: "returns None once"
    # and "an empty list once";
    # has_slots() a comparison: "returns False once"; free_slots() -> int keeps the pool query's drifts
    rt = fake.scan["return_types"]
    sched = f"{PKG}.sched:Scheduler"
    assert rt[f"{sched}.plan"] == ["object"] and rt[f"{sched}.maybe_batch"] == ["container", "none"]
    assert rt[f"{sched}.has_slots"] == ["bool"] and rt[f"{sched}.free_slots"] == ["number"]
    assert {c.source for c in _cands(fake, "step")} == {"self.plan()", "self.maybe_batch()", "self.has_slots()"}
    perts = {p.site.rsplit(".", 1)[-1]: p.perturbations for p in fake.points if p.caller == f"{sched}.step"}
    assert perts == {"maybe_batch": ("none_once", "empty_once"), "has_slots": ("false_once",)}
    assert [p.perturbations for p in fake.points if p.site == f"{sched}.free_slots"][0] == ("zero_once", "minus_one")


def test_return_types_read_annotations_before_return_statements() -> None:
    import ast

    from repro.discover.astscan.infer import return_types

    def rt(src: str) -> list[str]:
        return return_types(ast.parse(textwrap.dedent(src)).body[0])

    assert rt("def f(self) -> Optional[Batch]:\n    return self.x\n") == ["none", "object"]
    assert rt("def f(self) -> 'int | None':\n    return self.x\n") == ["none", "number"]
    assert rt("def f(self) -> bool:\n    return self.x\n") == ["bool"]
    assert rt("def f(self) -> NextBatchPlan:\n    if a:\n        return\n    return NextBatchPlan(x)\n") == ["none", "object"]
    assert rt("def f(self):\n    return len(self.q) - 1\n") == ["number"]
    assert rt("def f(self) -> List[Req]:\n    return self.x\n") == ["container"]
    assert rt("def f(self) -> Tuple[List[Req], float]:\n    return self.x\n") == ["object"]
    assert rt("def f(self):\n    return [r for r in self.q]\n") == ["container"]
    assert rt("def f(self):\n    return self.pool.available_size()\n") == ["unknown"]
