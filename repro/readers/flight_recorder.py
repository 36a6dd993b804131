"""torch's watchdog / Flight Recorder text (ProcessGroupNCCL's timeout report; torch 2.4–2.14 wording).

``Stack trace of the failed collective:`` then frames ``#<k> <function> from <file>:<line>`` innermost first,
mixing C++ (``c10d::ProcessGroupNCCL::…``, ``from ??:0``) and Python frames. The watchdog's message names the op,
sequence number and rank: ``[PG ID 0 PG GUID 0(default_pg) Rank 3] Watchdog caught collective operation timeout:
WorkNCCL(SeqNum=1234, OpType=ALLREDUCE, …)``; gloo's ``monitoredBarrier`` messages name the rank that failed.
The Flight Recorder analyser (``python -m torch.distributed.flight_recorder.fr_trace``; wording from torch 2.14's
``flight_recorder/components/types.py`` ``EntryState.log``) prints per faulty collective ``Not all ranks joining
collective, sequence number: 41`` (or ``Collective sequence number: 41 has errors``), ``collective: nccl:all_reduce``,
``missing ranks: {1, 2}``, ``expected ranks: {0, 1, 2}``, ``error msg: Culprit rank 2; …`` and ``collective stack
trace:`` with ``<function> at <file>:<line>`` frames, innermost first: one process for the rank(s) in that
collective (the one rank when only one joined), the missing ranks in a note. Without a stack (only the watchdog
lines pasted), the op the message names stands for the rank's stack, as a
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

FR_HEAD_RE = re.compile(r"^(?:Not all ranks joining collective, sequence number: (\d+)|Collective sequence number: "
                        r"(\d+) has errors|Input/output mismatch in the collective sequence number: (\d+))")
FR_FIELD_RE = re.compile(r"^(internal record id|group info|collective|missing ranks|expected ranks|collective state|"
                         r"error msg|input sizes|output sizes|world size|total input numel|total output numel): ?(.*)$")
FR_AT_RE = re.compile(r"^\s*(\S.*?) at (\S+?):(\d+)\s*$")
_RANKS_RE = re.compile(r"\d+")

# a superset of the lines :func:`handle` can take outside its ``fr`` mode (the reader gate, see readers/__init__.py):
# all of them are found anywhere in the line
GATE_START = r"(?!)"
GATE_SUBSTRINGS: tuple = ("Stack trace of the failed collective:", "Work(", "WorkNCCL(", "WorkGloo(", "WorkMPI(",
                          "WorkUCC(", "monitoredBarrier", "sequence number: ")


def _fr_record(asm, s: str, n: int) -> bool:
    """One line of the Flight Recorder analyser's report (see the module docstring); False when not one."""
    m = FR_HEAD_RE.match(s)
    if m:
        seq = next(g for g in m.groups() if g)
        asm.new_process("flight-recorder", n)
        asm.cur["fr_seq"] = seq
        asm.mode = "fr-rec"
        asm.note(f"Flight Recorder analysis: {s.strip()[:160]}")
        return True
    if asm.mode not in ("fr-rec", "fr-at") or asm.cur is None:
        return False
    cur = asm.cur
    m = FR_FIELD_RE.match(s.strip())
    if m:
        key, val = m.group(1), m.group(2).strip()
        if key == "collective":
            kind, _, name = val.rpartition(":")
            from repro.readers import rules
            cur["op"] = rules.native_op(name) or name.lower()
            kind = kind.lower()
            if kind in ("nccl", "gloo", "mpi", "ucc"):
                cur["backend"] = {"nccl": "NCCL", "gloo": "gloo", "mpi": "MPI", "ucc": "UCC"}[kind]
                cur["group_kind"] = "device" if kind == "nccl" else ("CPU" if kind == "gloo" else cur["group_kind"])
        elif key == "missing ranks":
            cur["fr_missing"] = [int(x) for x in _RANKS_RE.findall(val)]
            asm.note(f"Flight Recorder: rank(s) {', '.join(map(str, cur['fr_missing']))} never joined "
                     f"{cur['op'] or 'this collective'} #{cur['fr_seq']}")
        elif key == "expected ranks":
            joined = [int(x) for x in _RANKS_RE.findall(val) if int(x) not in cur.get("fr_missing", [])]
            if len(joined) == 1 and cur["rank_hint"] is None:
                cur["rank_hint"] = (joined[0], "Flight Recorder record (the one rank that joined)")
            elif joined:
                asm.note(f"Flight Recorder: ranks {', '.join(map(str, joined))} joined it (one stack for all)")
        elif key == "error msg":
            asm.note(f"Flight Recorder: {val[:200]}")
        elif key == "collective state":
            asm.note(f"Flight Recorder: the collective's state is {val}")
        return True
    if s.strip().startswith("collective stack trace:"):
        asm.new_thread("flight-recorder", n, "", "collective (Flight Recorder)", is_main=True)
        asm.mode = "fr-at"
        rest = s.strip()[len("collective stack trace:"):]
        if rest.strip():
            return _fr_record(asm, rest, n) or True
        return True
    if asm.mode == "fr-at":
        m = FR_AT_RE.match(s)
        if m and asm.thr is not None:
            file = m.group(2)
            py = file.endswith(".py")
            asm.add_frame(Frame(function=m.group(1), module_or_file=shorten_path(file) if py else file.rsplit("/", 1)[-1],
                                line=int(m.group(3)) or None, native=not py))
            return True
    return False


def handle(asm, s: str, n: int) -> bool:
    """Consume one watchdog / Flight Recorder line; False when it is not one."""
    if _fr_record(asm, s, n):
        return True
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
