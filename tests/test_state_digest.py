"""The lockstep state digest without a process group: the probe files (the harness' schema, sglang 0.5.23's data),
the injector's restricted path syntax and per-tick digest, the analysis' diff of two ranks' digests, and old
evidence (no state lines, no ``state_divergence`` in verdict.json) read as "no digest recorded", never as equal."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "injectors"))

from repro_injector import _digest  # noqa: E402

from repro import evidence as ev  # noqa: E402
from repro.ledger import diagnose, load_ledgers  # noqa: E402
from repro.scenario import Scenario, compile_plan  # noqa: E402
from repro.state_digest import StateStatus, diagnose_state  # noqa: E402
from repro.targets.release_data import ReleaseDataError, load_release_file  # noqa: E402
from repro.targets.sglang import SGLangAdapter  # noqa: E402


# ---- probe files -------------------------------------------------------------------------------------------------

def _probe_sets():
    return SGLangAdapter().release_data().probe_sets()


def test_sglang_0_5_23_probe_file_names_the_lockstep_state_of_design_section_11():
    ps = _probe_sets()["0.5.23"]
    paths = {p.name: (p.path, p.kind) for p in ps.probe}
    assert paths["req_to_token_pool.available"] == ("req_to_token_pool.available_size()", "lockstep")
    assert paths["token_to_kv_pool_allocator.available"][0] == "token_to_kv_pool_allocator.available_size()"
    assert paths["tree_cache.evictable"][0] == "tree_cache.evictable_size()"
    assert paths["tree_cache.protected"][0] == "tree_cache.protected_size()"
    assert paths["waiting_queue.rids"][0] == "waiting_queue[*].rid"
    assert paths["running_batch.rids"][0] == "running_batch.reqs[*].rid"
    assert paths["hicache.host_pool.available"][0] == "tree_cache.cache_controller.mem_pool_host.available_size()"
    assert paths["hicache.ongoing_write_through"][1] == "info" and paths["hicache.ongoing_backup"][1] == "local"
    assert ps.tick_function == SGLangAdapter.tick_function
    for p in ps.probe:  # the injector's own parser accepts every path the harness validated
        _digest.parse_path(p.path)


def test_the_plan_carries_every_release_probe_list_and_a_digest_off_switch(tmp_path: Path):
    base = {"name": "s", "variants": [{"name": "v", "expect": "success", "injections": []}]}
    probes = SGLangAdapter().state_probe_plan()
    assert probes == SGLangAdapter().release_data().plan_probes("sglang")
    assert {"0.5.23", "0.5.18"} <= set(probes["releases"]) and probes["package"] == "sglang"
    plan = compile_plan(Scenario.model_validate(base), Scenario.model_validate(base).variants[0], tmp_path, tmp_path / "a",
                        state_probes=probes)
    assert plan["ledger"]["enabled"] and plan["ledger"]["digest"]["enabled"]
    assert plan["ledger"]["digest"]["releases"]["0.5.23"][0]["name"] == "req_to_token_pool.available"
    off = Scenario.model_validate({**base, "ledger": {"digest": False}})
    plan = compile_plan(off, off.variants[0], tmp_path, tmp_path / "a", state_probes=probes)
    assert plan["ledger"]["enabled"] and not plan["ledger"]["digest"]["enabled"]
    assert Scenario.model_validate({**base, "ledger": True}).digest_enabled  # the old spelling still parses
    none = Scenario.model_validate({**base, "ledger": False})
    assert not none.ledger_enabled and not none.digest_enabled


@pytest.mark.parametrize("path", ["__import__('os').system('x')", "a.b(1)", "len(a[*].rid)", "a[0].rid", "a;b", "a.b()()"])
def test_probe_paths_outside_the_restricted_syntax_are_refused_by_both_parsers(tmp_path: Path, path: str):
    f = tmp_path / "9.toml"
    f.write_text(f'engine = "sglang"\nrelease = "9"\n[state]\n[[state.probe]]\nname = "x"\npath = {json.dumps(path)}\n')
    with pytest.raises(ReleaseDataError, match=r"9.toml: state.probe.0.path: .*never free Python"):
        load_release_file(f)
    with pytest.raises(_digest.ProbeSyntaxError):
        _digest.parse_path(path)


def test_the_release_data_is_inside_the_adapter_package():
    assert SGLangAdapter.releases_dir == Path(__file__).resolve().parent.parent / "repro" / "targets" / "sglang" / "releases"


# ---- the injector's digest ---------------------------------------------------------------------------------------

class _Pool:
    def __init__(self, n: int) -> None:
        self.n = n

    def available_size(self) -> int:
        return self.n


class _Req:
    def __init__(self, rid: str) -> None:
        self.rid = rid


class _Sched:
    def __init__(self) -> None:
        self.req_to_token_pool = _Pool(4)
        self.waiting_queue = [_Req("a"), _Req("b")]
        self.tree_cache = None  # HiCache off

    def boom(self) -> int:
        raise ValueError("no")


def _digest_of(tmp_path: Path) -> _digest.Digest:
    return _digest.Digest({"probes": [
        {"name": "req", "path": "req_to_token_pool.available_size()"},
        {"name": "wq", "path": "waiting_queue[*].rid"},
        {"name": "nwq", "path": "len(waiting_queue)", "kind": "local"},
        {"name": "host", "path": "tree_cache.cache_controller.mem_pool_host.available_size()"},
        {"name": "boom", "path": "boom()"}], "ring": 4}, str(tmp_path), 123)


def test_digest_writes_a_full_record_then_only_changes_and_drops_a_failing_probe_once(tmp_path: Path):
    d = _digest_of(tmp_path)
    s = _Sched()
    first = [json.loads(x) for x in d.tick(1, s)]
    assert first[0] == {"e": "state_error", "tick": 1, "probe": "boom", "err": "ValueError: no"}
    assert first[1]["full"] and first[1]["kinds"] == {"nwq": "local"}
    v = first[1]["v"]
    assert v["req"] == 4 and v["host"] is None and v["nwq"] == 2 and v["wq"][0] == 2
    assert v["wq"][1] == _digest.set_hash(["b", "a"])  # order-free, not Python's salted hash()
    assert d.tick(2, s) == []  # nothing changed: nothing written
    s.req_to_token_pool.n = 3
    s.waiting_queue.pop()
    third = [json.loads(x) for x in d.tick(3, s)]
    assert third == [{"e": "state", "tick": 3, "v": {"req": 3, "wq": [1, _digest.set_hash(["a"])], "nwq": 1}}]
    ring = [json.loads(x) for x in (tmp_path / "digest-123.jsonl").read_text().splitlines()]
    assert ring == [{"tick": 1, "probe": "wq", "members": ["a", "b"]}, {"tick": 3, "probe": "wq", "members": ["a"]}]
    lines = [json.loads(x) for x in d.full_lines(9)]  # the start of a new ledger part: errors again, every value
    assert lines[0]["probe"] == "boom" and lines[1]["full"] and lines[1]["v"]["req"] == 3


def test_probes_for_release_picks_the_installed_version_or_says_why_not():
    probes, why = _digest.probes_for_release({"package": "pytest", "releases": {pytest.__version__: [{"name": "x", "path": "a"}]}})
    assert probes == [{"name": "x", "path": "a"}] and why == ""
    probes, why = _digest.probes_for_release({"package": "pytest", "releases": {"0.0.1": []}})
    assert probes is None and f"no state probes for pytest {pytest.__version__} (have: 0.0.1)" in why


# ---- the analysis ------------------------------------------------------------------------------------------------

def _ledger(folder: Path, pid: int, rank: int, states: list, enters: int = 0) -> None:
    lines = [{"e": "header", "pid": pid, "rank": rank, "part": 0, "dropped": 0, "max_records": 100, "time": 1.0},
             {"e": "group", "g": "1", "name": "1", "ranks": [0, 1], "backend": "gloo", "label": "tp/cpu"}]
    lines += states
    for i in range(1, enters + 1):
        lines.append({"e": "enter", "g": "1", "seq": i, "op": "broadcast", "api": "torch.distributed.broadcast",
                      "red": None, "shapes": [[1]], "dtypes": ["int64"], "site": ["m:f"], "tick": i, "t": float(i),
                      "inj": None, "thread": "MainThread"})
        lines.append({"e": "exit", "g": "1", "seq": i, "t": float(i) + 0.1, "err": None})
    (folder / f"ledger-{pid}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_first_divergent_state_names_the_probe_the_ranks_values_the_tick_and_the_odd_members(tmp_path: Path):
    full = {"e": "state", "tick": 1, "full": True, "kinds": {"n": "local"}, "v": {"req": 4, "wq": [1, "h1"], "n": 0}}
    _ledger(tmp_path, 10, 0, [full, {"e": "state", "tick": 3, "v": {"n": 5}},
                              {"e": "state", "tick": 5, "v": {"req": 3, "wq": [2, "h2"]}}], enters=7)
    _ledger(tmp_path, 11, 1, [full, {"e": "state", "tick": 5, "v": {"req": 4, "wq": [2, "h3"]}}], enters=7)
    (tmp_path / "digest-10.jsonl").write_text(json.dumps({"tick": 5, "probe": "wq", "members": ["a", "x"]}) + "\n")
    (tmp_path / "digest-11.jsonl").write_text(json.dumps({"tick": 5, "probe": "wq", "members": ["a", "y"]}) + "\n")
    st = diagnose_state(load_ledgers(tmp_path), collective_tick=7)
    assert st.status == StateStatus.DIVERGED and st.tick == 5  # the local probe's change at tick 3 is not compared
    assert st.fields == {"req": {0: 3, 1: 4}, "wq": {0: [2, "h2"], 1: [2, "h3"]}}
    assert st.only == {"wq": {0: ["x"], 1: ["y"]}}
    assert st.ticks_before_collective == 2 and st.compared == (1, 7)
    assert st.probes_compared == ["req", "wq"] and st.probes_local == ["n"]
    assert "`req` rank 0 = 3, rank 1 = 4" in st.summary and "2 tick(s) before the first divergent collective" in st.summary
    d = st.to_dict()
    assert d["status"] == "diverged" and d["fields"]["req"] == {"0": 3, "1": 4} and d["tick"] == 5


def test_a_change_after_the_last_tick_both_ranks_reached_is_not_compared(tmp_path: Path):
    full = {"e": "state", "tick": 1, "full": True, "v": {"req": 4}}
    _ledger(tmp_path, 10, 0, [full, {"e": "state", "tick": 9, "v": {"req": 3}}], enters=9)
    _ledger(tmp_path, 11, 1, [full], enters=6)  # rank 1 was last seen at tick 6
    st = diagnose_state(load_ledgers(tmp_path))
    assert st.status == StateStatus.EQUAL and st.compared == (1, 6) and "from 1 to 6" in st.summary


def test_a_probe_with_no_value_on_any_rank_is_not_counted_or_listed_as_compared(tmp_path: Path):
    """A HiCache or PD probe on a server without it reads None on every rank at every tick: equal, but vacuously —
    the report counts and lists only the probes that had a value (found by the newcomer pass: 12 'compared', 5 of
    them absent from the server)."""
    full = {"e": "state", "tick": 1, "full": True, "kinds": {"hicache.ongoing_backup": "local"},
            "v": {"req": 4, "hicache.host_pool.available": None, "hicache.ongoing_backup": None}}
    _ledger(tmp_path, 10, 0, [full, {"e": "state", "tick": 2, "v": {"req": 3}}], enters=3)
    _ledger(tmp_path, 11, 1, [full, {"e": "state", "tick": 2, "v": {"req": 3}}], enters=3)
    st = diagnose_state(load_ledgers(tmp_path))
    assert st.status == StateStatus.EQUAL and "(1 probes compared;" in st.summary, st.summary
    assert st.probes_absent == ["hicache.host_pool.available", "hicache.ongoing_backup"]
    line = next(x for x in st.markdown_lines() if x.startswith("State probes compared per rank:"))
    assert line.startswith("State probes compared per rank: req;") and "hicache" not in line, line
    assert "2 probe(s) with no value on this server" in line


def test_old_ledgers_without_state_lines_read_as_no_digest_recorded_never_equal(tmp_path: Path):
    _ledger(tmp_path, 10, 0, [], enters=3)
    _ledger(tmp_path, 11, 1, [], enters=3)
    diag = diagnose(tmp_path)
    assert diag.state.status == StateStatus.NOT_RECORDED and "no digest recorded" in diag.state.summary
    assert diag.to_dict()["state_divergence"]["status"] == "not_recorded"
    assert "First divergent state:** no digest recorded" in "\n".join(diag.markdown_lines(None))


def test_old_verdict_json_without_state_divergence_still_reads(tmp_path: Path):
    rec = ev.VerdictRecord.model_validate({"verdict": "DEADLOCKED", "reason": "r", "exit_code": 3})
    assert rec.state_divergence is None
    new = ev.VerdictRecord.model_validate({"verdict": "DEADLOCKED", "state_divergence": {"status": "diverged", "tick": 4}})
    assert new.to_json()["state_divergence"]["tick"] == 4


def test_repro_analyze_of_a_ledger_folder_leads_with_the_first_divergent_state(tmp_path: Path):
    import os
    import subprocess

    full = {"e": "state", "tick": 1, "full": True, "v": {"req_to_token_pool.available": 8}}
    _ledger(tmp_path, 10, 0, [full, {"e": "state", "tick": 3, "v": {"req_to_token_pool.available": 7}}], enters=4)
    _ledger(tmp_path, 11, 1, [full], enters=4)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    r = subprocess.run([sys.executable, "-m", "repro", "analyze", str(tmp_path)], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "First divergent state: at scheduler tick 3: `req_to_token_pool.available` rank 0 = 7, rank 1 = 8" in r.stdout
    r = subprocess.run([sys.executable, "-m", "repro", "analyze", str(tmp_path), "--json"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert json.loads(r.stdout)["ledger"]["state_divergence"]["tick"] == 3
