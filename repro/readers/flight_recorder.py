"""torch's watchdog / Flight Recorder text (ProcessGroupNCCL's timeout report; torch 2.4–2.14 wording).

``Stack trace of the failed collective:`` then frames ``#<k> <function> from <file>:<line>`` innermost first,
mixing C++ (``c10d::ProcessGroupNCCL::…``, ``from ??:0``) and Python frames. The watchdog's message names the op,
sequence number and rank: ``[PG ID 0 PG GUID 0(default_pg) Rank 3] Watchdog caught collective operation timeout:
WorkNCCL(SeqNum=1234, OpType=ALLREDUCE, …)``; gloo's ``monitoredBarrier`` messages name the rank that failed.
Without a stack (only the watchdog lines pasted), the op the message names stands for the rank's stack, as a
one-frame thread, with a note. No tool on this machine produces it (no NCCL here): the fixtures of this format are
written by hand.
"""

from __future__ import annotations

import re

from repro.readers.common import is_native_file, shorten_path
from repro.readers.types import Frame

HEAD_RE = re.compile(r"Stack trace of the failed collective:\s*(.*)$")
FRAME_RE = re.compile(r"^#(\d+)\s+(.+?) from (.+?)(?::(\d+))?\s*$")
WORK_RE = re.compile(r"Work(NCCL|Gloo|MPI|UCC)?\((?:SeqNum=(\d+))?[^)]*?OpType=(\w+)")
PGRANK_RE = re.compile(r"\[PG(?: ID)? [^\]]*?Rank (\d+)\]")
MONITORED_RE = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier|[Rr]ank (\d+) .*monitoredBarrier")

# a superset of the lines :func:`handle` can take outside its ``fr`` mode (the reader gate, see readers/__init__.py):
# all of them are found anywhere in the line
GATE_START = r"(?!)"
GATE_SUBSTRINGS: tuple = ("Stack trace of the failed collective:", "Work(", "WorkNCCL(", "WorkGloo(", "WorkMPI(",
                          "WorkUCC(", "monitoredBarrier")


def handle(asm, s: str, n: int) -> bool:
    """Consume one watchdog / Flight Recorder line; False when it is not one."""
    m = HEAD_RE.search(s)
    if m:
        cur = asm.cur
        if cur is not None and cur["fmt"] == "flight-recorder" and cur["threads"] and all(
                t.get("from_message") for t in cur["threads"]):
            cur["threads"].clear()  # the stack replaces the one-frame stand-in taken from the watchdog's message
            asm.close_thread()
        elif cur is None or cur["fmt"] != "flight-recorder" or cur["threads"]:
            asm.new_process("flight-recorder", n)
        asm.new_thread("flight-recorder", n, "", "failed collective", is_main=True)
        asm.thr["fr"] = True
        asm.mode = "fr"
        return True
    if asm.mode == "fr":
        m = FRAME_RE.match(s.strip())
        if m:
            func, file, line = m.group(2), m.group(3), m.group(4)
            py = file.endswith(".py")
            asm.add_frame(Frame(function=func, module_or_file=shorten_path(file) if py else file.rsplit("/", 1)[-1],
                                line=int(line) if line and line != "0" else None,
                                native=not py and (is_native_file(file) or file.startswith("?") or "::" in func)))
            return True
    m = WORK_RE.search(s)
    if m and ("timeout" in s.lower() or "timed out" in s.lower() or "Watchdog" in s):
        cur = asm.cur if asm.cur is not None and asm.cur["fmt"] == "flight-recorder" else None
        if cur is None:
            asm.new_process("flight-recorder", n)
            cur = asm.cur
        from repro.readers import rules
        kind = (m.group(1) or "").upper()
        cur["backend"] = {"NCCL": "NCCL", "GLOO": "gloo", "MPI": "MPI", "UCC": "UCC"}.get(kind, cur["backend"])
        cur["group_kind"] = "device" if kind == "NCCL" else ("CPU" if kind == "GLOO" else cur["group_kind"])
        cur["op"] = rules.native_op(m.group(3)) or m.group(3).lower()
        pr = PGRANK_RE.search(s)
        if pr and cur["rank_hint"] is None:
            cur["rank_hint"] = (int(pr.group(1)), "watchdog message 'Rank N'")
        seq = f" #{m.group(2)}" if m.group(2) else ""
        asm.note(f"torch's watchdog: {cur['op']}{seq} ({kind or 'backend not named'}) timed out on this rank")
        if not cur["threads"]:
            # only the message so far (often all a user pastes): one frame named for its op stands for the stack,
            # said in a note; a 'Stack trace of the failed collective' after it replaces it
            asm.new_thread("flight-recorder", n, "", "failed collective (watchdog message)", is_main=True)
            asm.thr["from_message"] = True
            asm.add_frame(Frame(function=cur["op"], module_or_file="?", line=None))  # a bare op name
            asm.close_thread()
            asm.note("no stack in the watchdog's text: the rank is read as blocked in the op its message names")
        return True
    m = MONITORED_RE.search(s)
    if m and asm.cur is not None:
        asm.note(f"torch: {s.strip()[:200]}")
        return True
    return False
