"""Arming a served server: the arm file, and waiting until every rank's fire log says it noticed."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional, Sequence

from repro import evidence as ev


POLL_S = 0.2


ARM_ACK_TIMEOUT_S = 10.0  # seconds to wait for every rank's injector to acknowledge a new arm file


ARM_ACK_POLL_S = 0.02


def write_arm_file(arm_file: Path, injection_ids: Sequence[str]) -> None:
    """Arm (ids non-empty) or disarm (empty) a running server's injector: one injection id per line, atomically.

    Every write replaces the file (new inode), so writing the same ids again re-arms: occurrence counters restart.
    """
    head = f"# written by repro at {time.time():.3f}\n"
    ev.write_text_atomic(Path(arm_file), head + "".join(f"{i}\n" for i in injection_ids))


def fire_log_offsets(injector_dir: Path, pids: Sequence[int]) -> dict[int, int]:
    """Current size in bytes of each pid's ``fires-<pid>.jsonl`` (0 when absent): where :func:`wait_armed` starts."""
    out: dict[int, int] = {}
    for pid in pids:
        try:
            out[int(pid)] = (Path(injector_dir) / ev.Layout.fire_log(pid)).stat().st_size
        except OSError:
            out[int(pid)] = 0
    return out


def wait_armed(injector_dir: Path, offsets: dict[int, int], arm_file: Path, timeout_s: float = ARM_ACK_TIMEOUT_S) -> list[int]:
    """Block until every pid in ``offsets`` logged an ``armed`` event for the arm file as it is now.

    The injector of each rank polls the arm file on its own (every ``arm_poll_s``, 0.1 s by default), so right
    after :func:`write_arm_file` the ranks are armed at different moments; a burst sent at once can reach one rank's
    gated call site before that rank is armed and the next one after, on a later scheduler tick, with other state
    (measured in a hunt: rank 1 armed 85 ms after the burst started and fired two ticks late). Each rank's
    ``armed`` event names the arm file's mtime it read (``arm_file_mtime``), matched here to the file's current
    st_mtime_ns.

    Args:
        injector_dir: the evidence's injector folder (``fires-<pid>.jsonl``).
        offsets: pid -> byte offset to read from (from :func:`fire_log_offsets`, taken before writing the arm file).
        arm_file: the arm file just written.
        timeout_s: seconds to wait at most.
    Returns:
        The pids that did not acknowledge within ``timeout_s`` (empty when all did), sorted.
    """
    from repro.injection_records import read_fire_log

    try:
        want = Path(arm_file).stat().st_mtime_ns / 1e9
    except OSError:
        return sorted(offsets)
    pending = dict(offsets)
    deadline = time.monotonic() + timeout_s
    while True:
        for pid in list(pending):
            # complete lines only: an incomplete last line waits for the rest
            events, pending[pid] = read_fire_log(Path(injector_dir) / ev.Layout.fire_log(pid), pending[pid])
            if any(e.get("event") == "armed" and abs(float(e.get("arm_file_mtime") or 0) - want) < 1e-6 for e in events):
                del pending[pid]
        if not pending or time.monotonic() >= deadline:
            return sorted(pending)
        time.sleep(ARM_ACK_POLL_S)


def arm_and_wait(arm_file: Path, ids: Sequence[str], injector_dir: Optional[Path], rank_pids: dict[int, int],
                 timeout_s: float = ARM_ACK_TIMEOUT_S) -> list[int]:
    """Write the arm file (:func:`write_arm_file`) and, when arming, wait for every rank's acknowledgement
    (:func:`wait_armed`).

    Args:
        ids: injection ids (empty: disarm, nothing to wait for).
        injector_dir: the injector folder holding ``fires-<pid>.jsonl`` (None: do not wait).
        rank_pids: rank -> pid of the ranks to wait for (empty: do not wait).
    Returns:
        The ranks that did not acknowledge within ``timeout_s`` seconds, sorted (empty when all did or no wait).
    """
    offsets = fire_log_offsets(injector_dir, list(rank_pids.values())) if injector_dir and rank_pids else {}
    write_arm_file(arm_file, ids)
    late = wait_armed(injector_dir, offsets, arm_file, timeout_s) if ids and offsets else []
    by_pid = {v: k for k, v in rank_pids.items()}
    return sorted(by_pid.get(x, x) for x in late)
