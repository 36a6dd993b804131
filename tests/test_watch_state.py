"""The watch follows the lockstep state digest live (issue 33 item 1, the part without a server): a state
divergence is a warning line (JSON) with the tick, the ranks and each rank's values, as soon as every rank has
reached the tick, and before any request fails. Ledgers are written here line for line in the injector's format
(``injectors/repro_injector/_ledger.py``, ``_digest.py``); the real-server case rides on the watch e2e tests.
"""

from __future__ import annotations

import json
from pathlib import Path

from repro.ledger_follow import LedgerFollower, forget_followers
from repro.watch import WatchOptions, Watcher

PIDS = {0: 4100, 1: 4101}


def _append(d: Path, rank: int, *lines: dict) -> None:
    with open(d / f"ledger-{PIDS[rank]}.jsonl", "a") as f:
        for ln in lines:
            f.write(json.dumps(ln) + "\n")


def _start(d: Path) -> None:
    for r in (0, 1):
        _append(d, r, {"e": "header", "pid": PIDS[r], "rank": r, "part": 0, "dropped": 0, "max_records": 1000, "time": 0},
                {"e": "state", "tick": 1, "full": True, "kinds": {"hicache.ongoing_backup": "local"},
                 "v": {"req_to_token_pool.available": 8, "waiting_queue.rids": [0, "0" * 16],
                       "hicache.ongoing_backup": 0}})


def _enter(tick: int, seq: int) -> dict:
    return {"e": "enter", "g": "1", "seq": seq, "op": "broadcast", "api": "torch.distributed.broadcast", "red": None,
            "shapes": [[1]], "dtypes": ["int64"], "site": ["m:f"], "tick": tick, "t": 1.0 + tick, "thread": "MainThread"}


def test_a_divergence_is_found_once_every_rank_reached_its_tick_and_local_probes_never_count(tmp_path):
    _start(tmp_path)
    _append(tmp_path, 0, {"e": "state", "tick": 3, "v": {"req_to_token_pool.available": 1}}, _enter(3, 1))
    _append(tmp_path, 1, {"e": "state", "tick": 2, "v": {"hicache.ongoing_backup": 5}}, _enter(2, 1))
    f = LedgerFollower(tmp_path, PIDS)
    f.poll()
    assert f.state.check() is None  # rank 1 has not reached tick 3 yet: behind is not diverged
    assert f.state.through == 2
    _append(tmp_path, 1, _enter(3, 2))
    f.poll()
    st = f.state.check()
    assert st is not None and st["tick"] == 3 and st["status"] == "diverged"
    assert st["fields"] == {"req_to_token_pool.available": {"0": 1, "1": 8}}
    assert "at scheduler tick 3: `req_to_token_pool.available` rank 0 = 1, rank 1 = 8" in st["summary"]
    assert f.state.check() is None  # reported once
    f.close()


def test_watch_logs_the_state_divergence_as_a_warning_line_before_any_hang(tmp_path):
    forget_followers()
    _start(tmp_path)
    for r in (0, 1):
        _append(tmp_path, r, _enter(2, 1))
    log: list[dict] = []
    w = Watcher(WatchOptions(url="http://127.0.0.1:9", ledger_dir=tmp_path, evidence_root=tmp_path / "ev"),
                log=log.append, discover=lambda: dict(PIDS))
    assert w._ledger_check() is False and not [e for e in log if e["event"] == "state_divergence"]
    _append(tmp_path, 1, {"e": "state", "tick": 4, "v": {"waiting_queue.rids": [1, "9f2c1a0b9f2c1a0b"]}}, _enter(4, 2))
    _append(tmp_path, 0, _enter(4, 2))
    assert w._ledger_check() is False  # a warning, not a hang
    warn = [e for e in log if e["event"] == "state_divergence"]
    assert len(warn) == 1 and warn[0]["level"] == "warning" and warn[0]["tick"] == 4 and warn[0]["ranks"] == ["0", "1"]
    assert warn[0]["fields"] == {"waiting_queue.rids": {"0": [0, "0" * 16], "1": [1, "9f2c1a0b9f2c1a0b"]}}
    assert warn[0]["reason"].startswith("First divergent state: at scheduler tick 4: `waiting_queue.rids` rank 0 = 0")
    assert w.state == "starting" and w.state_divergence["tick"] == 4
    json.dumps(warn[0])
    forget_followers()


def test_a_watch_hangs_report_and_verdict_lead_with_the_state_seen_live(tmp_path):
    from repro import evidence as ev
    from repro.watch import Discovery, watch_report

    st = {"status": "diverged", "tick": 4, "ranks": ["0", "1"], "fields": {"w": {"0": 1, "1": 2}},
          "compared_ticks": [1, 4], "summary": "at scheduler tick 4: `w` rank 0 = 1, rank 1 = 2 (ticks 1–4 compared)"}
    health = {"kind": "silent", "detail": "200"}
    hang = {"verdict": "DEADLOCKED", "reason": "proof", "health_at_declaration": health, "health_after_capture": health,
            "declared_at": "t", "consecutive_failures": 0, "first_failure_at": None, "last_generate": {},
            "state_divergence": st}
    (tmp_path / "stacks").mkdir()
    md = watch_report(WatchOptions(url="http://127.0.0.1:9"), hang, None, [], Discovery({}, "given"), tmp_path / "stacks")
    lines = md.splitlines()
    i = lines.index("## Diagnosis")
    assert lines[i + 2] == "**First divergent state:** at scheduler tick 4: `w` rank 0 = 1, rank 1 = 2 (ticks 1–4 compared)"
    rec = ev.verdict_record({"verdict": "DEADLOCKED", "reason": "proof"}, exit_code=3, evidence=tmp_path, kind="watch",
                            state_divergence=st)
    assert rec.state_divergence["tick"] == 4


def test_live_state_stays_bounded_when_nobody_checks(tmp_path):
    from repro.state_follow import MAX_SNAPSHOTS, LiveState

    st = LiveState([0, 1])
    for r in (0, 1):
        st.add(r, {"e": "state", "tick": 1, "full": True, "v": {"a": 0}})
    for t in range(2, 3 * MAX_SNAPSHOTS):
        for r in (0, 1):
            st.add(r, {"e": "state", "tick": t, "v": {"a": t}})
    assert all(len(q) <= MAX_SNAPSHOTS for q in st.snaps.values()) and st.dropped == 0
    st.add(1, {"e": "state", "tick": 3 * MAX_SNAPSHOTS, "v": {"a": -1}})
    st.add(0, {"e": "state", "tick": 3 * MAX_SNAPSHOTS, "v": {"a": 3 * MAX_SNAPSHOTS}})
    d = st.check()
    assert d is not None and d["tick"] == 3 * MAX_SNAPSHOTS and d["fields"]["a"] == {"0": 3 * MAX_SNAPSHOTS, "1": -1}
