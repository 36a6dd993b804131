"""`repro reproduce`: the hang signature, candidates read off a dump and mapped onto an engine's source, bad input.

No SGLang here: a small engine package (``fakeeng``, written into tmp_path) stands in for the target's source; the
mapping runs ``repro/reproduce_src.py`` in this interpreter, as it runs in the target one. Dumps are py-spy text
(the format the project's hung runs keep in ``stacks/``), the shape of tests/fixtures/dumps/sglang_tp2_cpu_hang.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from repro.cli import app
from repro.reproduce import (EXIT_DIFFERENT_HANG, EXIT_NOT_REPRODUCED, EXIT_REPRODUCED, ReproduceInputError,
                             check_input, load_rules, map_frames, plan, read_dumps, rules_path, scenario_text,
                             signature)
from repro.scenario import load_scenario

FIXTURES = Path(__file__).parent / "fixtures"

ENGINE = textwrap.dedent('''\
    import torch


    class Sched:
        def loop(self):
            while True:
                self.recv()
                self.admit()

        def recv(self):
            torch.distributed.broadcast(self.t, 0, group=self.tp_cpu_group)

        def admit(self):
            for req in self.queue:
                if self.free() <= 0:
                    break
                self.cache.check(req)

        def free(self):
            return 1


    class Cache:
        def check(self, req):
            return self.can_stop(req)

        def can_stop(self, req):
            self._all_reduce(req, 1)

        def _all_reduce(self, t, op):
            torch.distributed.all_reduce(t, op=op, group=self.g)
''')


def _line(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def _pyspy(pid: int, frames: list[tuple[str, str, int]], status: str = "idle") -> str:
    body = "\n".join(f"    {fn} ({f}:{ln})" for fn, f, ln in frames)
    return (f"Process {pid}: python -m fakeeng\nPython v3.11.7 (/usr/bin/python3.11)\n\n"
            f"Thread {pid} ({status}): \"MainThread\"\n{body}\n")


def _engine(tmp_path: Path, monkeypatch) -> Path:
    pkg = tmp_path / "src" / "fakeeng"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sched.py").write_text(ENGINE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "src"))
    return pkg


def _hang(tmp_path: Path, *, rank0_pid: int = 100, shift: int = 0, injector: bool = False, odd_first: bool = True,
          name: str = "dumps") -> Path:
    """Rank 0 blocked in Cache's extra all_reduce inside the admission loop; rank 1 in the request broadcast."""
    L = lambda s: _line(ENGINE, s) + shift  # noqa: E731
    c10d = "torch/distributed/distributed_c10d.py"
    odd = [("all_reduce", c10d, 3913 + shift)]
    if injector:
        odd.append(("_patch.<locals>.wrapped", "sitecustomize.py", 22))
    odd += [("Cache._all_reduce", "fakeeng/sched.py", L("torch.distributed.all_reduce")),
            ("Cache.can_stop", "fakeeng/sched.py", L("self._all_reduce(req")),
            ("Cache.check", "fakeeng/sched.py", L("return self.can_stop")),
            ("Sched.admit", "fakeeng/sched.py", L("self.cache.check(req)")),
            ("Sched.loop", "fakeeng/sched.py", L("self.admit()"))]
    other = [("broadcast", c10d, 2800 + shift), ("Sched.recv", "fakeeng/sched.py", L("torch.distributed.broadcast")),
             ("Sched.loop", "fakeeng/sched.py", L("self.recv()"))]
    d = tmp_path / name
    d.mkdir()
    first, second = (odd, other) if odd_first else (other, odd)
    (d / "rank0.txt").write_text(_pyspy(rank0_pid, first))
    (d / "rank1.txt").write_text(_pyspy(rank0_pid + 1, second))
    return d


# ------------------------------------------------------------------------------------------------ signature
def test_signature_ignores_rank_ids_pids_line_numbers_and_injector_frames(tmp_path):
    a = read_dumps([str(_hang(tmp_path, name="a"))])
    b = read_dumps([str(_hang(tmp_path, name="b", rank0_pid=7000, shift=3, injector=True, odd_first=False))])
    sa, sb = signature(*a), signature(*b)
    assert sa == sb
    keys = {k.frames for k, _ in sa.entries}
    assert ("sched:Cache._all_reduce", "sched:Cache.can_stop", "sched:Cache.check") in keys
    assert ("sched:Sched.recv", "sched:Sched.loop") in keys
    assert all("sitecustomize" not in f for k in keys for f in k)


def test_signature_differs_when_a_group_blocks_elsewhere(tmp_path):
    a = read_dumps([str(_hang(tmp_path, name="a"))])
    d = _hang(tmp_path, name="b")
    text = (d / "rank1.txt").read_text().replace("broadcast (", "all_gather (")
    (d / "rank1.txt").write_text(text)
    assert signature(*a) != signature(*read_dumps([str(d)]))


def test_signature_of_the_real_smoke_hang_names_both_sides():
    s = signature(*read_dumps([str(FIXTURES / "dumps" / "sglang_tp2_cpu_hang")]))
    lines = s.lines()
    assert any(l.startswith("1× all_reduce ← scheduler:Scheduler.event_loop_normal") for l in lines)
    assert any("vocab_parallel_embedding:VocabParallelEmbedding.forward" in l for l in lines)


# ------------------------------------------------------------------------------------------------ candidates
def test_frames_map_to_the_call_at_the_line_and_the_loop_around_it(tmp_path, monkeypatch):
    import sys

    _engine(tmp_path, monkeypatch)
    a, caps = read_dumps([str(_hang(tmp_path))])
    from repro.reproduce import chain_frames

    frames = chain_frames(caps[0])[2]
    maps = map_frames(sys.executable, "fakeeng", frames)
    by = {m["qualname"]: m for m in maps}
    assert by["Cache._all_reduce"]["call"]["collective"] and by["Cache._all_reduce"]["call"]["group"] == "g"
    assert by["Sched.admit"]["loop_var"] == "req"
    assert by["Sched.admit"]["call"]["name"] == "check"
    assert by["Cache.check"]["loop_var"] is None


def test_plan_gates_the_extra_collective_on_the_callers_and_the_loop(tmp_path, monkeypatch):
    import sys

    _engine(tmp_path, monkeypatch)
    a, caps = read_dumps([str(_hang(tmp_path))])
    rules = {"package": "fakeeng"}
    p = plan(a, caps, sys.executable, "sglang", rules)
    extra = [c for c in p.candidates if c.kind == "extra_collective" and c.injections[0]["gate"]["ranks"] == [0]]
    assert extra, [c.name for c in p.candidates]
    inj = extra[0].injections[0]
    assert inj["site"] == "fakeeng.sched:Cache._all_reduce"
    assert inj["action"] == {"kind": "extra_collective", "op": "all_reduce", "group": "g"}
    assert inj["gate"]["called_from"][0] == "fakeeng.sched:Sched.admit"
    assert inj["gate"]["inside_loop"] == "req"
    assert "fakeeng.sched:Cache.can_stop" in inj["gate"]["called_from"]


def test_root_cause_candidates_come_from_discovery_points_on_the_odd_path(tmp_path, monkeypatch):
    import sys

    from repro.discover import DiscoveredPoint
    from repro.hunt import Perturbation

    _engine(tmp_path, monkeypatch)
    a, caps = read_dumps([str(_hang(tmp_path))])
    on_path = DiscoveredPoint("d.Sched.free--admit.in-req", "fakeeng.sched:Sched.free", "fakeeng.sched:Sched.admit",
                              "discovered", ("zero_once",), (), (), "req")
    elsewhere = DiscoveredPoint("d.X.y--z", "fakeeng.sched:Sched.free", "fakeeng.sched:Other.z", "discovered",
                                ("zero_once",), (), (), None)
    perts = {"zero_once": Perturbation("zero_once", {"kind": "return_value", "value": 0}, "returns 0 once")}
    p = plan(a, caps, sys.executable, "sglang", {"package": "fakeeng"}, points=[on_path, elsewhere],
             perturbations=perts)
    roots = [c for c in p.candidates if c.kind == "root_cause"]
    assert len(roots) == 1
    inj = roots[0].injections[0]
    assert inj["site"] == ["fakeeng.sched:Sched.free"] and inj["action"] == {"kind": "return_value", "value": 0}
    assert inj["gate"]["called_from"] == ["fakeeng.sched:Sched.admit"] and inj["gate"]["inside_loop"] == "req"
    assert inj["gate"]["ranks"] == [1]  # the peer leaves the loop early; rank 0 is the one left in the all_reduce


def test_written_scenario_loads_and_a_missing_function_is_named_with_nearest(tmp_path, monkeypatch):
    import sys

    _engine(tmp_path, monkeypatch)
    d = _hang(tmp_path)
    t = (d / "rank0.txt").read_text().replace("Cache.can_stop", "Cache.can_stopp")
    (d / "rank0.txt").write_text(t)
    a, caps = read_dumps([str(d)])
    p = plan(a, caps, sys.executable, "sglang", {"package": "fakeeng"})
    assert any("Cache.can_stopp" in x and "Cache.can_stop" in x.split("nearest names:")[1] for x in p.drift), p.drift
    f = tmp_path / "r.toml"
    f.write_text(scenario_text(p, None, str(d)))
    sc = load_scenario(f)
    assert [v.name for v in sc.variants] == [c.name for c in p.candidates]


def test_sglang_rules_file_is_found_and_guesses_hicache_from_cache_frames():
    from repro.reproduce import server_guess

    rules = load_rules(rules_path("sglang"))
    args, says, needs = server_guess(rules, [], ["hiradix_cache:HiRadixCache.check_prefetch_progress"])
    assert "--enable-hierarchical-cache" in args and says and needs
    assert server_guess(rules, [], ["scheduler:Scheduler.run_batch"]) == ([], [], [])


def test_exit_codes_are_distinct_from_the_other_verbs():
    assert {EXIT_REPRODUCED, EXIT_DIFFERENT_HANG, EXIT_NOT_REPRODUCED}.isdisjoint({0, 1, 2, 3, 4, 5, 6, 7, 8, 130, 143})


# ------------------------------------------------------------------------------------------------ bad input
def _cli(args: list[str]):
    # --python points nowhere: a refusal must come before any interpreter is chosen (nothing launched)
    return CliRunner().invoke(app, ["reproduce", *args, "--python", "/nonexistent/python", "--out", "/nonexistent/out"])


@pytest.mark.parametrize("what,path,words", [
    ("ranks agree", FIXTURES / "dumps" / "sglang_tp2_cpu_idle", "nothing to reproduce"),
    ("a single rank", FIXTURES / "dumps" / "sglang_tp2_cpu_hang" / "rank0.txt", "only one rank's dump was read"),
    ("a busy rank", FIXTURES / "pasted" / "busy_main_background_collective", "busy (on CPU, not blocked)"),
    ("a non-Python dump", FIXTURES / "pasted" / "gdb_bt_gloo3", "has no Python frames"),
])
def test_bad_input_is_one_line_exit_2_nothing_launched(what, path, words):
    r = _cli([str(path)])
    assert r.exit_code == 2, (what, r.output)
    lines = [l for l in r.output.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], (what, r.output)
    assert "Traceback" not in r.output and "nonexistent/python" not in r.output


def test_a_binary_dump_is_said_to_hold_nothing_readable_as_analyze_says(tmp_path):
    """Issue 29 item 5: ``reproduce bin.dat`` said "only one rank's dump was read" when nothing was read."""
    f = tmp_path / "bin.dat"
    f.write_bytes(bytes(range(256)) * 64)
    r = _cli([str(f)])
    lines = [l for l in r.output.splitlines() if l.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert "no rank's stack could be read" in lines[0] and "a binary file" in lines[0], r.output
    assert "one rank" not in lines[0] and "Traceback" not in r.output
    a = CliRunner().invoke(app, ["analyze", str(f)])
    assert a.exit_code == 2
    # the same reason in both verbs, after "could be read from <where>: "
    assert lines[0].split(": ", 2)[2] == " ".join(a.output.split()).split(": ", 2)[2], (lines[0], a.output)


def test_an_engine_with_no_adapter_is_one_line_exit_2_nothing_launched(tmp_path):
    """A hung TP=2 job whose rank processes carry titles of an engine no adapter knows (ray workers: the real vLLM
    pynccl dump of tests/fixtures/pasted with its worker titles rewritten to ray's)."""
    src = (FIXTURES / "pasted" / "vllm_titles_pynccl" / "py-spy.txt").read_text()
    f = tmp_path / "ray.txt"
    f.write_text(src.replace("VLLM::Worker_TP0_EP0", "ray::RayWorkerWrapper.execute_method --local-rank=0")
                 .replace("VLLM::Worker_TP1_EP0", "ray::RayWorkerWrapper.execute_method --local-rank=1"))
    r = _cli([str(f)])
    lines = [l for l in r.output.splitlines() if l.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and "ray's, and no adapter is registered" in lines[0], r.output
    assert "Traceback" not in r.output and "nonexistent/python" not in r.output


def test_check_input_accepts_a_diverged_two_rank_hang(tmp_path):
    a, caps = read_dumps([str(_hang(tmp_path))])
    assert check_input(a, caps) == "sglang"
    with pytest.raises(ReproduceInputError, match="only one rank.s dump was read"):
        check_input(a, caps[:1])


# ------------------------------------------------------------------------------------------------ judging runs
def test_judge_compares_a_run_hang_with_the_original_signature(tmp_path):
    from repro.reproduce import DIFFERENT_HANG, NOT_REPRODUCED, REPRODUCED, Tried, exit_code, judge

    orig = signature(*read_dumps([str(_hang(tmp_path, name="orig"))]))
    same = _hang(tmp_path, name="same", rank0_pid=900, shift=5, injector=True)
    other = FIXTURES / "dumps" / "sglang_tp2_cpu_hang"
    assert judge(orig, "DEADLOCKED", same)[0] == REPRODUCED
    assert judge(orig, "DEADLOCKED", other)[0] == DIFFERENT_HANG
    assert judge(orig, "ALL REQUESTS SUCCEEDED", same)[0] == NOT_REPRODUCED
    t = lambda o: Tried("c", "", tmp_path, o)  # noqa: E731
    assert exit_code([t(NOT_REPRODUCED), t(REPRODUCED)]) == EXIT_REPRODUCED
    assert exit_code([t(NOT_REPRODUCED), t(DIFFERENT_HANG)]) == EXIT_DIFFERENT_HANG
    assert exit_code([t(NOT_REPRODUCED)]) == EXIT_NOT_REPRODUCED


def test_reproduction_md_shows_both_signatures_the_scenario_and_the_compare_command(tmp_path, monkeypatch):
    import sys

    from repro.reproduce import REPRODUCED, Tried, Written, judge, reproduction_markdown

    _engine(tmp_path, monkeypatch)
    a, caps = read_dumps([str(_hang(tmp_path))])
    p = plan(a, caps, sys.executable, "sglang", {"package": "fakeeng"})
    w = Written(tmp_path / "reproduce.toml", signature(a, caps), p, sys.executable, [])
    run = _hang(tmp_path, name="run", rank0_pid=555, injector=True)
    outcome, sig, _ = judge(w.signature, "DEADLOCKED", run)
    md = reproduction_markdown(w, [Tried(p.candidates[0].name, "DEADLOCKED", run, outcome, sig)], "dumps/", 12.0)
    assert md.startswith(f"# {REPRODUCED}")
    assert md.count("sched:Cache._all_reduce") >= 2  # original and reproduction side by side
    assert f"repro compare {w.scenario_file} --variant {p.candidates[0].name}" in md


def _strip_injector(src: Path, dst: Path) -> None:
    import re

    pat = re.compile(r"repro_injector|sitecustomize\.py|repro_ledger\[|repro_injected\[")
    out, skip = [], False
    for line in src.read_text().splitlines():
        if line.startswith("Thread "):
            skip = '"repro-' in line
        if not skip and not pat.search(line):
            out.append(line)
    dst.write_text("\n".join(out) + "\n")


def test_a_real_injected_hang_and_its_stripped_copy_have_one_signature(tmp_path):
    """The reproduction's evidence (py-spy JSON, injector and ledger frames) judges REPRODUCED against the same
    hang's text stacks copied out with every injector frame removed."""
    from repro.reproduce import REPRODUCED, judge

    real = FIXTURES / "reproduce" / "smoke_watch_hang"
    clean = tmp_path / "clean"
    clean.mkdir()
    for r in (0, 1):
        _strip_injector(real / f"rank{r}.txt", clean / f"rank{r}.txt")
    assert "repro" not in (clean / "rank0.txt").read_text()
    orig = signature(*read_dumps([str(clean)]))
    assert judge(orig, "DEADLOCKED", real)[0] == REPRODUCED
    assert any(l.startswith("1× all_reduce ← scheduler:Scheduler.event_loop_normal") for l in orig.lines())


def test_the_smoke_hang_stripped_maps_to_the_smoke_scenario_site_on_the_testbed(tmp_path):
    """On sglang 0.5.23's own source: rank 0's innermost frame (event_loop_normal at the run_batch line) gives the
    smoke scenario's injection: an extra all_reduce on tp_cpu_group at Scheduler.run_batch, gated on the loop."""
    from repro import testbed

    if not testbed.is_set_up():
        pytest.skip("the CPU testbed (sglang 0.5.23) is not set up: bash scripts/cpu_testbed/setup.sh")
    clean = tmp_path / "clean"
    clean.mkdir()
    for r in (0, 1):
        _strip_injector(FIXTURES / "reproduce" / "smoke_watch_hang" / f"rank{r}.txt", clean / f"rank{r}.txt")
    a, caps = read_dumps([str(clean)])
    p = plan(a, caps, str(testbed.testbed_python()), "sglang", load_rules(rules_path("sglang")))
    inj = next(c for c in p.candidates if c.name == "extra_collective_r0").injections[0]
    assert inj["site"] == "sglang.srt.managers.scheduler:Scheduler.run_batch"
    assert inj["action"] == {"kind": "extra_collective", "op": "all_reduce", "group": "tp_cpu_group"}
    assert inj["gate"]["called_from"][0] == "sglang.srt.managers.scheduler:Scheduler.event_loop_normal"
    assert inj["gate"]["ranks"] == [0]


# ------------------------------------------------------------------------------------------------ sglang#30760 dumps
HICACHE = FIXTURES / "reproduce"
_INJECTOR_WORDS = ("repro_injector", "repro_ledger[", "repro_injected[", "repro_tick[", "sitecustomize", '"repro-')


@pytest.mark.parametrize("name", ["hicache_30760_extra_collective", "hicache_30760_allocatable_drift"])
def test_30760_dumps_hold_no_injector_frame_and_sign_the_prefetch_all_reduce_against_the_model(name):
    """Both #30760 dumps (real hung runs, injector stripped): one rank in the cache's prefetch all_reduce called from
    _can_terminate_prefetch, the other in the model's first all_reduce."""
    d = HICACHE / name
    for f in d.glob("rank*.txt"):
        text = f.read_text()
        assert not any(w in text for w in _INJECTOR_WORDS), f
    sig = signature(*read_dumps([str(d)]))
    keys = sorted(k.frames for k, _ in sig.entries)
    prefetch = ("unified_radix_cache:UnifiedRadixCache._all_reduce_attn_groups",
                "unified_radix_cache:UnifiedRadixCache._all_reduce",
                "unified_radix_cache:UnifiedRadixCache._can_terminate_prefetch")
    peer = {"hicache_30760_extra_collective": ("all_reduce", ("vocab_parallel_embedding:VocabParallelEmbedding.forward",
                                                              "llama:LlamaModel.forward",
                                                              "llama:LlamaForCausalLM.forward")),
            "hicache_30760_allocatable_drift": ("broadcast", ("request_receiver:SchedulerRequestReceiver."
                                                              "_broadcast_reqs_across_ranks",
                                                              "request_receiver:SchedulerRequestReceiver.recv_requests",
                                                              "scheduler:Scheduler.ingest_requests"))}[name]
    got = sorted((k.op, k.frames) for k, _ in sig.entries)
    assert got == sorted([("all_reduce", prefetch), peer]), sig.lines()
    assert all(k.state == "collective" and n == 1 for k, n in sig.entries)


def test_the_30760_symptom_and_root_cause_dumps_have_different_signatures():
    """The extra collective leaves the peer in the model's all_reduce; the free-slot drift leaves it in the next
    tick's request broadcast: a symptom-only reproduction of the root-cause dump is a DIFFERENT HANG."""
    a = signature(*read_dumps([str(HICACHE / "hicache_30760_extra_collective")]))
    b = signature(*read_dumps([str(HICACHE / "hicache_30760_allocatable_drift")]))
    assert a != b


@pytest.mark.parametrize("name", ["hicache_30760_extra_collective", "hicache_30760_allocatable_drift"])
def test_30760_candidates_on_the_testbed_are_the_loop_call_and_the_free_slot_drift(name, tmp_path):
    """On sglang 0.5.23's source, each #30760 dump gives (a) the extra all_reduce on the prefetch rank at entry to the
    cache's all_reduce helper (its own method, so the reproduction's stack shows the same frames), gated on the
    waiting-queue loop of _get_new_batch_prefill_raw, and (b) the root cause from discovery: the OTHER rank's
    get_num_allocatable_reqs (the free-slot count) returning 0 once inside that `for req` loop."""
    from repro import testbed
    from repro.reproduce import write_candidates

    if not testbed.is_set_up():
        pytest.skip("the CPU testbed (sglang 0.5.23) is not set up: bash scripts/cpu_testbed/setup.sh")
    d = HICACHE / name
    a, caps = read_dumps([str(d)])
    odd = [s.rank for s in a.ranks if "_all_reduce_attn_groups" in (s.blocked_frame or "")]
    w = write_candidates([str(d)], tmp_path, python=str(testbed.testbed_python()))
    assert w.release.version == "0.5.23" and w.release.candidates == ["0.5.23"]  # the testbed's frames fit 0.5.23 only
    assert "release: sglang 0.5.23: the dump's" in w.scenario_file.read_text()
    by = {c.name: c for c in w.plan.candidates}
    loop = "sglang.srt.managers.scheduler:Scheduler._get_new_batch_prefill_raw"
    extra = [c for c in by.values() if c.kind == "extra_collective"]
    assert len(extra) == 1, list(by)
    inj = extra[0].injections[0]
    assert inj["site"] == "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache._all_reduce_attn_groups"
    assert inj["action"] == {"kind": "extra_collective", "op": "all_reduce", "method": "_all_reduce_attn_groups"}
    assert inj["gate"]["called_from"][0] == loop and inj["gate"]["inside_loop"] == "req"
    prefetch_rank = inj["gate"]["ranks"]
    assert prefetch_rank == odd and len(odd) == 1
    drift = [c for c in by.values() if c.kind == "root_cause"
             and c.injections[0]["site"][0] == "sglang.srt.managers.scheduler:Scheduler.get_num_allocatable_reqs"
             and c.injections[0]["action"] == {"kind": "return_value", "value": 0}]
    assert len(drift) == 1, list(by)
    g = drift[0].injections[0]["gate"]
    assert g["called_from"] == [loop] and g["inside_loop"] == "req"
    assert g["ranks"] == [r for r in (0, 1) if r not in prefetch_rank]
    assert load_scenario(w.scenario_file).variant(drift[0].name)


def test_reproduction_md_shows_a_different_hang_beside_the_original_even_when_another_reproduced(tmp_path):
    """The #30760 root-cause dump judged against a run that hung like the symptom dump (DIFFERENT HANG) and one that
    hung like itself (REPRODUCED): both runs' signatures appear next to the original's."""
    from repro.reproduce import DIFFERENT_HANG, REPRODUCED, Plan, Tried, Written, judge, reproduction_markdown

    orig_dir = HICACHE / "hicache_30760_allocatable_drift"
    w = Written(tmp_path / "reproduce.toml", signature(*read_dumps([str(orig_dir)])),
                Plan([], [], [], [], [], "sglang", 2), "python", [])
    runs = []
    for name, run in (("extra", HICACHE / "hicache_30760_extra_collective"), ("root", orig_dir)):
        outcome, sig, _ = judge(w.signature, "DEADLOCKED", run)
        runs.append(Tried(name, "DEADLOCKED", run, outcome, sig))
    assert [t.outcome for t in runs] == [DIFFERENT_HANG, REPRODUCED]
    md = reproduction_markdown(w, runs, "dumps/", 1.0)
    assert md.startswith(f"# {REPRODUCED}")
    assert f"## {DIFFERENT_HANG}: `extra`" in md and "VocabParallelEmbedding.forward" in md
    # the original beside the reproduction and beside the different hang, plus the reproduction's own row
    assert md.count("SchedulerRequestReceiver._broadcast_reqs_across_ranks") == 3


def test_when_nothing_reproduced_the_closest_hang_is_named_and_never_offered_as_the_one_to_keep(tmp_path):
    """The #30760 root-cause dump, two candidates that both hung like the symptom dump (one blocked place in common:
    the broadcast of the ranks that did not take the extra all_reduce): the root-cause one is the closest (a tie on shared lines), the page says nothing reproduced and offers no
    compare command (a fix that stops another hang proves nothing about the reported one)."""
    from repro.reproduce import (DIFFERENT_HANG, Candidate, Plan, Tried, Written, closest_hang, judge,
                                 reproduction_markdown)

    orig_dir = HICACHE / "hicache_30760_allocatable_drift"
    cands = [Candidate("extra_collective_r1", "extra_collective", "rank 1: one extra all_reduce", []),
             Candidate("root_x_zero_once_r1", "root_cause", "rank 0: x returns 0 once", [])]
    w = Written(tmp_path / "reproduce.toml", signature(*read_dumps([str(orig_dir)])),
                Plan(cands, [], [], [], [], "sglang", 2), "python", [])
    runs = []
    for c in cands:
        outcome, sig, _ = judge(w.signature, "DEADLOCKED", HICACHE / "hicache_30760_extra_collective")
        runs.append(Tried(c.name, "DEADLOCKED", tmp_path, outcome, sig))
    assert [t.outcome for t in runs] == [DIFFERENT_HANG, DIFFERENT_HANG]
    assert closest_hang(w.signature, runs, {c.name: c for c in cands}).candidate == "root_x_zero_once_r1"
    md = reproduction_markdown(w, runs, "dumps/", 1.0)
    assert md.startswith(f"# {DIFFERENT_HANG}") and "## Keep it" not in md and "repro compare" not in md
    assert "## Closest hang (nothing reproduced)" in md and "The closest is `root_x_zero_once_r1` (root_cause; 1 of 2 blocked place(s)" in md
    assert "| original | reproduction (root_x_zero_once_r1) |" in md


def test_each_candidate_runs_on_a_server_no_other_candidate_touched(tmp_path, monkeypatch):
    """run_candidates asks run_many for a fresh server per candidate (a root cause run after others hung elsewhere)."""
    from repro import reproduce as R
    from repro import runner

    seen = {}

    def fake_run_many(opts, names, observe=None, on_result=None, fresh_each=False):
        seen.update(names=list(names), fresh_each=fresh_each)
        return []

    monkeypatch.setattr(runner, "run_many", fake_run_many)
    cands = [R.Candidate("a", "root_cause", "", []), R.Candidate("b", "extra_collective", "", [])]
    w = R.Written(tmp_path / "reproduce.toml", None, R.Plan(cands, [], [], [], [], "sglang", 2), "python", [])
    assert R.run_candidates(w, tmp_path) == []
    assert seen == {"names": ["a", "b"], "fresh_each": True}


def test_the_winning_candidate_is_kept_alone_as_a_scenario_that_loads(tmp_path, monkeypatch):
    import sys

    from repro.reproduce import NOT_REPRODUCED, REPRODUCED, Tried, Written, keep_winner

    _engine(tmp_path, monkeypatch)
    a, caps = read_dumps([str(_hang(tmp_path))])
    p = plan(a, caps, sys.executable, "sglang", load_rules(rules_path("sglang")) | {"package": "fakeeng",
                                                                                    "default_group": "g"})
    assert len(p.candidates) >= 2, [c.name for c in p.candidates]
    f = tmp_path / "reproduce.toml"
    f.write_text(scenario_text(p, None, "dumps"))
    w = Written(f, signature(a, caps), p, sys.executable, [])
    first, second = p.candidates[0].name, p.candidates[1].name
    assert keep_winner(w, [Tried(first, "DEADLOCKED", tmp_path, NOT_REPRODUCED)], tmp_path) is None
    kept = keep_winner(w, [Tried(first, "ALL REQUESTS SUCCEEDED", tmp_path, NOT_REPRODUCED),
                           Tried(second, "DEADLOCKED", tmp_path, REPRODUCED)], tmp_path)
    sc = load_scenario(kept)
    assert [v.name for v in sc.variants] == [second]
    assert sc.server == load_scenario(f).server


@pytest.mark.parametrize("tp, words", [("-3", "--tp must be ≥ 1 and ≤ 64 (got -3)"),
                                       ("0", "--tp must be ≥ 1 and ≤ 64 (got 0)"),
                                       ("65", "--tp must be ≥ 1 and ≤ 64 (got 65)"),
                                       ("1", "needs at least 2 ranks (TP size 1); use --tp 2 or more")])
def test_reproduce_checks_tp_as_run_does_one_line_exit_2_nothing_written(tp: str, words: str):
    """--tp -3 was a pydantic traceback, --tp 0 silently became 2, --tp 1 wrote a scenario whose suggested
    `repro run` is then refused: the same check as `repro run --tp` (scenario.tp_option_problem), first."""
    r = _cli([str(FIXTURES / "dumps" / "sglang_tp2_cpu_hang"), f"--tp={tp}"])
    lines = [l for l in r.output.splitlines() if l.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], r.output
    assert "Traceback" not in r.output and "nonexistent/python" not in r.output


def test_run_and_reproduce_share_one_tp_check():
    from repro.scenario import tp_option_problem

    assert tp_option_problem(None, 2, [("variant 'v'", "deadlock")]) == ""
    assert tp_option_problem(None, 1, [("variant 'v'", "deadlock")]).startswith("variant 'v' expects a deadlock")
    assert tp_option_problem(1, 2, [("variant 'c'", "success")]) == ""
    assert "got 0" in tp_option_problem(0, 2, []) and "got 65" in tp_option_problem(65, 2, [])
