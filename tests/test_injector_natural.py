"""The natural actions (environment nemeses) on a real 2-process gloo group, fired on rank 0 only: ``delay`` sleeps
the calling thread (the rank's other threads go on), ``stop`` stops the whole process (its other threads too),
``clock`` shifts ``time.time`` / ``time.monotonic`` from the fire on (the injector's records keep the real clock),
``fault`` raises once in a background thread (``fault_outcome`` says what the thread did), ``pending`` holds a
completion poll not-done for k polls. Every fire is labelled ``natural`` in the fire log. Lower bounds only (no
speed assertions): a stopped or delayed call takes at least its seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest

from repro.injection_records import read_injector_dir

REPO = Path(__file__).resolve().parent.parent
INJECTORS = REPO / "injectors"
GLOO_TIMEOUT_S = 60

MODULE = textwrap.dedent(
    """
    class Worker:
        def step(self):
            return "original"

    def step(w):
        return w.step()

    def transfer(i):
        return i

    class Event:
        def query(self):
            return True

    class SlowEvent:  # completes at its 4th query on every rank
        def __init__(self):
            self.queries = 0
        def query(self):
            self.queries += 1
            return self.queries > 3

    class Store:  # a storage backend: every key is stored
        def __init__(self):
            self.written = []
        def batch_exists(self, keys, extra_info=None):
            return len(keys)
        def batch_get(self, keys, targets=None):
            return ["page-" + k for k in keys]
        def batch_set(self, keys, values=None):
            self.written.extend(keys)
            return True
    """
)

PROGRAM = textwrap.dedent(
    """
    import datetime, json, os, sys, threading, time
    from time import monotonic as early_monotonic
    import torch
    import torch.distributed as dist
    import nmod

    rank, world, init_file, out, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=%d))
    res = {"rank": rank}

    def wait_for_event(name):
        folder = json.load(open(os.environ["REPRO_PLAN"]))["out_dir"]
        for _ in range(3000):
            for f in os.listdir(folder):
                if f.startswith("fires-") and f'"event": "{name}"' in open(os.path.join(folder, f)).read():
                    return True
            time.sleep(0.01)
        return False

    if mode in ("delay", "stop"):
        ticks, done = [], threading.Event()
        def ticker():
            while not done.is_set():
                ticks.append(time.monotonic())
                time.sleep(0.01)
        th = threading.Thread(target=ticker, daemon=True)
        th.start()
        while len(ticks) < 3:
            time.sleep(0.001)
        t0 = time.monotonic()
        res["step"] = nmod.step(nmod.Worker())
        t1 = time.monotonic()
        while not [t for t in ticks if t > t1]:  # the ticker ticked again after the call: the gap is closed
            time.sleep(0.001)
        done.set(); th.join()
        res["call_s"] = t1 - t0
        res["ticks_during"] = len([t for t in ticks if t0 < t < t1])
        res["max_gap_s"] = max(b - a for a, b in zip(ticks, ticks[1:])) if len(ticks) > 1 else 0.0
    elif mode == "clock":
        before_wall, before_mono = time.time(), time.monotonic()
        res["step"] = nmod.step(nmod.Worker())
        res["wall_moved_s"] = time.time() - before_wall
        res["mono_moved_s"] = time.monotonic() - before_mono
        res["early_bound_gap_s"] = time.monotonic() - early_monotonic()
        res["wall_after"] = time.time()
    elif mode in ("fault_caught", "fault_die", "fault_reraised"):
        errors = []
        def io_aux():
            for i in range(3):
                if mode == "fault_caught":
                    try:
                        nmod.transfer(i)
                    except Exception as e:
                        errors.append(type(e).__name__)
                elif mode == "fault_reraised":  # sglang's PD transfer_worker: catch, then raise another exception
                    try:
                        nmod.transfer(i)
                    except Exception as e:
                        raise RuntimeError(f"Transfer thread failed because of {e}") from e
                else:
                    nmod.transfer(i)
        th = threading.Thread(target=io_aux, name="io-aux")
        th.start(); th.join()
        res["errors"] = errors
        if rank == 0:
            res["outcome_seen"] = wait_for_event("fault_outcome")
    elif mode == "miss":
        st = nmod.Store()
        # the first query finds nothing (nothing to miss: no fire), the next two find 3 pages each
        res["exists"] = [st.batch_exists([]), st.batch_exists(["a", "b", "c"]), st.batch_exists(["a", "b", "c"])]
        res["get"] = st.batch_get(["a", "b", "c"])
    elif mode == "fail":
        st = nmod.Store()
        res["set"] = st.batch_set(["a", "b"], [1, 2])
        res["written"] = st.written
    elif mode == "fail_per_key":
        res["get"] = nmod.Store().batch_get(["a", "b", "c"])
    elif mode == "pending":
        ev, polls = nmod.Event(), 0
        while not ev.query():
            polls += 1
        res["not_done_polls"] = polls
    elif mode == "pending_per_object":
        evs = [nmod.Event(), nmod.Event()]
        res["answers"] = [[e.query() for e in evs] for _ in range(4)]
    elif mode == "pending_only_done":
        ev, polls = nmod.SlowEvent(), 0
        while not ev.query():
            polls += 1
        res["not_done_polls"], res["queries"] = polls, ev.queries
    t = torch.tensor([1], dtype=torch.int32)
    dist.all_reduce(t)  # the ranks are still in step afterwards
    res["after"] = int(t.item())
    with open(out, "w") as fh:
        json.dump(res, fh)
    dist.destroy_process_group()
    """
    % GLOO_TIMEOUT_S
)

SITES = {"delay": "nmod:Worker.step", "stop": "nmod:Worker.step", "clock": "nmod:Worker.step",
         "fault_caught": "nmod:transfer", "fault_die": "nmod:transfer",
         "fault_reraised": "nmod:transfer", "pending": "nmod:Event.query", "pending_only_done": "nmod:SlowEvent.query",
         "pending_per_object": "nmod:Event.query",
         "miss": "nmod:Store.batch_exists", "fail": "nmod:Store.batch_set", "fail_per_key": "nmod:Store.batch_get"}


def _run(python: str, tmp: Path, mode: str, action: dict) -> tuple[list[dict], Path]:
    inj = {"id": "nat", "site": {"alternatives": [SITES[mode]], "aliases": []},
           "gate": {"called_from": [], "not_called_from": [], "max_depth": 16, "inside_loop": None, "ranks": [0],
                    "rank_group": None, "occurrence": {"mode": "first", "nth": 1, "max_fires": 0}},
           "action": action}
    plan = {"version": 1, "scenario": "natural", "variant": mode, "out_dir": str(tmp / "out"),
            "arm_file": str(tmp / "arm"), "arm_poll_s": 0.1, "injections": [inj], "faulthandler_signal": "SIGUSR2"}
    (tmp / "arm").write_text("nat\n")
    (tmp / "plan.json").write_text(json.dumps(plan))
    (tmp / "prog.py").write_text(PROGRAM)
    (tmp / "nmod.py").write_text(MODULE)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "REPRO_PLAN")}
    env.update(PYTHONPATH=os.pathsep.join([str(INJECTORS), str(tmp)]), REPRO_PLAN=str(tmp / "plan.json"),
               GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([python, str(tmp / "prog.py"), str(r), "2", str(tmp / "init"), str(tmp / f"res{r}.json"), mode],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for r in range(2)]
    errs = []
    try:
        for p in procs:
            errs.append(p.communicate(timeout=GLOO_TIMEOUT_S * 3)[1])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for p, err in zip(procs, errs):
        assert p.returncode == 0, err[-3000:]
    return [json.loads((tmp / f"res{r}.json").read_text()) for r in range(2)], tmp / "out"


def _fires(out: Path):
    rep = read_injector_dir(out)
    fires = [f for log in rep.logs for f in log.fires]
    assert [f.rank for f in fires] == [0], fires  # the target rank only
    assert fires[0].nature == "natural"
    return fires[0]


def test_delay_sleeps_only_the_calling_thread(torch_python: str, tmp_path: Path):
    (r0, r1), out = _run(torch_python, tmp_path, "delay", {"kind": "delay", "delay_s": 1.5})
    assert r0["call_s"] >= 1.5 and r0["step"] == "original"
    assert r0["ticks_during"] >= 1  # the rank's other thread went on during the delay
    assert r0["after"] == r1["after"] == 2
    assert _fires(out).thread == "MainThread"


def test_stop_stops_every_thread_of_the_rank(torch_python: str, tmp_path: Path):
    (r0, r1), out = _run(torch_python, tmp_path, "stop", {"kind": "stop", "stop_s": 1.5})
    assert r0["call_s"] >= 1.5
    assert r0["max_gap_s"] >= 1.4  # the other thread stopped too: a gap in its ticks as long as the stop
    assert r0["after"] == r1["after"] == 2
    f = _fires(out)
    stopped = [e for e in f.effects if e["event"] == "stopped"]
    assert stopped and stopped[0]["stopped_s"] >= 1.4


def test_clock_step_moves_time_on_one_rank_but_not_the_injectors_records(torch_python: str, tmp_path: Path):
    (r0, r1), out = _run(torch_python, tmp_path, "clock", {"kind": "clock", "clocks": ["monotonic", "time"], "step_s": 1000.0})
    assert r0["wall_moved_s"] >= 1000 and r0["mono_moved_s"] >= 1000
    assert r1["wall_moved_s"] < 1000 and r1["mono_moved_s"] < 1000
    assert abs(r0["early_bound_gap_s"]) < 1000 <= r0["mono_moved_s"]  # bound before the fire: still the real clock
    f = _fires(out)
    assert f.time < r0["wall_after"] - 900  # the fire log's clock is the real one
    assert [e["step_s"] for e in f.effects if e["event"] == "clock_shifted"] == [1000.0]


def test_fault_caught_by_the_thread_is_recorded_as_caught(torch_python: str, tmp_path: Path):
    (r0, r1), out = _run(torch_python, tmp_path, "fault_caught", {"kind": "fault", "exception": "OSError", "observe_s": 0.5})
    assert r0["errors"] == ["OSError"] and r1["errors"] == []
    assert r0["outcome_seen"]
    f = _fires(out)
    assert f.thread == "io-aux"
    (oc,) = [e for e in f.effects if e["event"] == "fault_outcome"]
    assert oc["reentries"] == 2 and oc["outcome"].startswith("caught")


def test_fault_that_kills_the_thread_is_recorded_as_died(torch_python: str, tmp_path: Path):
    (r0, r1), out = _run(torch_python, tmp_path, "fault_die", {"kind": "fault", "observe_s": 0.5})
    assert r0["outcome_seen"]
    (oc,) = [e for e in _fires(out).effects if e["event"] == "fault_outcome"]
    assert oc["alive"] is False and oc["outcome"] == "thread died" and oc["thread"] == "io-aux"


def test_fault_re_raised_as_another_exception_is_recorded_as_died(torch_python: str, tmp_path: Path):
    """sglang 0.5.23's PD ``transfer_worker`` catches the exception and raises a RuntimeError from it: the thread died
    of the fault all the same (before: "ended without calling the site again", died_of_fault false; h37p)."""
    (r0, r1), out = _run(torch_python, tmp_path, "fault_reraised", {"kind": "fault", "exception": "OSError", "observe_s": 0.5})
    assert r0["outcome_seen"]
    (oc,) = [e for e in _fires(out).effects if e["event"] == "fault_outcome"]
    assert oc["alive"] is False and oc["died_of_fault"] is True, oc
    assert oc["outcome"] == "thread died (the injected OSError re-raised as RuntimeError)", oc


def test_pending_holds_a_completion_poll_not_done_for_k_polls(torch_python: str, tmp_path: Path):
    (r0, r1), out = _run(torch_python, tmp_path, "pending", {"kind": "pending", "polls": 5, "value": False})
    assert r0["not_done_polls"] == 5 and r1["not_done_polls"] == 0
    f = _fires(out)
    assert [e["polls_held"] for e in f.effects if e["event"] == "pending_done"] == [5]
    rep = read_injector_dir(out)
    assert rep.counts_by_rank("nat")["fired"] == {0: 1, 1: 0}  # one fire, its later polls held (not new fires)


def test_pending_holds_only_the_fired_objects_polls(torch_python: str, tmp_path: Path):
    """Two events polled in turn (two requests' senders): the first poll fires and holds that event's next polls;
    the other event's polls in between keep their own (done) answer and do not use up the hold."""
    (r0, r1), out = _run(torch_python, tmp_path, "pending_per_object", {"kind": "pending", "polls": 3, "value": False})
    assert r0["answers"] == [[False, True], [False, True], [False, True], [True, True]]
    assert r1["answers"] == [[True, True]] * 4
    assert [e["polls_held"] for e in _fires(out).effects if e["event"] == "pending_done"] == [3]


def test_pending_only_done_holds_the_first_poll_that_would_have_said_done(torch_python: str, tmp_path: Path):
    """The event completes at its 4th query; with only_done the 3 not-done polls are no fire, the 4th (done) is held
    not-done for 5 polls, each poll still called: rank 0 sees 3 + 5 not-done polls and 9 queries, rank 1 3 and 4."""
    (r0, r1), out = _run(torch_python, tmp_path, "pending_only_done",
                         {"kind": "pending", "polls": 5, "value": False, "only_done": True})
    assert (r0["not_done_polls"], r0["queries"]) == (8, 9) and (r1["not_done_polls"], r1["queries"]) == (3, 4)
    f = _fires(out)
    assert [e["true_answer"] for e in f.effects if e["event"] == "held_done"] == ["True"]
    assert [e["polls_held"] for e in f.effects if e["event"] == "pending_done"] == [5]
    assert read_injector_dir(out).counts_by_rank("nat")["fired"] == {0: 1, 1: 0}  # the not-done polls were taken back


def test_miss_answers_not_stored_from_the_first_call_that_found_pages(torch_python: str, tmp_path: Path):
    (r0, r1), out = _run(torch_python, tmp_path, "miss", {"kind": "miss", "keep_pages": 1})
    assert r0["exists"] == [0, 1, 3] and r1["exists"] == [0, 3, 3]  # the empty query was no fire; one fire (first)
    assert r0["get"] == r1["get"] == ["page-a", "page-b", "page-c"]  # another method: untouched
    f = _fires(out)  # the empty query's fire was taken back: one fire event, on rank 0
    (m,) = [e for e in f.effects if e["event"] == "missed"]
    assert (m["found_pages"], m["answered_pages"], m["keep_pages"]) == (3, 1, 1)
    rep = read_injector_dir(out)
    assert rep.counts_by_rank("nat")["fired"] == {0: 1, 1: 0}
    assert rep.counts_by_rank("nat")["matched"][0] == 2  # 3 calls: the one with nothing to miss did not match


def test_fail_reports_failure_without_writing(torch_python: str, tmp_path: Path):
    (r0, r1), out = _run(torch_python, tmp_path, "fail", {"kind": "fail", "answer": "false"})
    assert r0["set"] is False and r0["written"] == []  # the backend was not called: nothing written
    assert r1["set"] is True and r1["written"] == ["a", "b"]
    (e,) = [e for e in _fires(out).effects if e["event"] == "failed"]
    assert e["keys"] == 2 and e["answer"] == "False"


def test_fail_per_key_answers_one_failure_per_key(torch_python: str, tmp_path: Path):
    (r0, r1), out = _run(torch_python, tmp_path, "fail_per_key", {"kind": "fail", "answer": "none", "per_key": True})
    assert r0["get"] == [None, None, None] and r1["get"] == ["page-a", "page-b", "page-c"]
    _fires(out)


@pytest.fixture(autouse=True)
def _no_leftover_clock():
    yield
