"""Python tracebacks, as torch prints them when a collective times out (``[rank0]: Traceback (most recent call
last):`` … ``RuntimeError: [.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 4000ms for recv
operation to complete``; checked with torch 2.14 gloo and ``monitored_barrier``).

``Traceback (most recent call last):`` then ``  File "<path>", line <n>, in <function>`` (outermost first), source
lines and ``^^^^`` markers (skipped), and the exception line, kept as a note. Several tracebacks of one source
(chained exceptions) are one process: the last one is kept and the note says so. The exception text names the
backend when it can (a gloo transport path → gloo, NCCL → NCCL).
"""

from __future__ import annotations

import re

from repro.readers.common import shorten_path
from repro.readers.types import Frame

# also at the end of a log message (SGLang: "Scheduler hit an exception: Traceback (most recent call last):") or
# after a terminal's "^C"
HEAD_RE = re.compile(r"(?:^\s*|\^C|: )Traceback \(most recent call last\):\s*$")
FRAME_RE = re.compile(r"^\s+File \"(.*)\", line (\d+), in (.+?)\s*$")
EXC_RE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Timeout\w*|Interrupt|Exit|Warning)):?\s?(.*)$")
# gloo's monitored_barrier: "... waiting for send/recv from rank 0. Please check rank 0 logs for faulty rank." or
# "Ranks 0, 2 failed to pass monitoredBarrier in 4000 ms" (torch 2.14 ProcessGroupGloo.cpp)
_FAULTY_RE = re.compile(r"send/recv from rank (\d+)|Ranks? ([\d, ]+) failed to pass monitoredBarrier")
_CHAIN = ("During handling of the above exception", "The above exception was the direct cause")

# a superset of the lines :func:`handle` can take that are not indented outside a traceback (the reader gate, see
# readers/__init__.py; inside one, ``asm.mode`` is set and every line reaches the handlers)
GATE_START = r"Traceback \(most"
GATE_SUBSTRINGS: tuple = ("Traceback (most recent call last):",)


def handle(asm, s: str, n: int) -> bool:
    """Consume one traceback line; False when it is not one."""
    if asm.mode == "gdb-py":
        return False  # gdb's py-bt frames (innermost first) belong to the gdb thread
    if HEAD_RE.search(s):
        cur = asm.cur
        if cur is not None and cur["fmt"] == "traceback" and asm.mode in ("tb", "tb-exc", "tb-chain"):
            cur["threads"].clear()
            cur["tracebacks"] = cur.get("tracebacks", 1) + 1
            asm.note(f"{cur['tracebacks']} chained tracebacks: read the last one")
        else:
            asm.new_process("traceback", n)
        asm.new_thread("traceback", n, "", "", order="outer", is_main=True)
        asm.thr["tb"] = True
        asm.mode = "tb"
        return True
    m = FRAME_RE.match(s)
    if m:
        if asm.thr is None or not asm.thr.get("tb"):
            asm.new_process("traceback", n, note="traceback frames without a 'Traceback' header")
            asm.new_thread("traceback", n, "", "", order="outer", is_main=True)
            asm.thr["tb"] = True
        asm.mode = "tb"
        asm.add_frame(Frame(function=m.group(3), module_or_file=shorten_path(m.group(1)), line=int(m.group(2))))
        asm.thr["code"] = True
        return True
    if asm.mode == "tb":
        if asm.thr is not None and asm.thr.get("code") and s.startswith("    "):
            return True  # the source line / ^^^^ markers under a frame
        m = EXC_RE.match(s)
        if m:
            _exception(asm, s)
            asm.mode = "tb-exc"
            return True
    if asm.mode in ("tb-exc", "tb-chain"):
        if any(s.startswith(c) for c in _CHAIN):
            asm.mode = "tb-chain"
            return True
        if asm.mode == "tb-exc" and (s.startswith(" ") or "Timed out" in s or "exception" in s.lower()):
            _exception(asm, s.strip(), cont=True)
            return True
    return False


def _exception(asm, text: str, cont: bool = False) -> None:
    cur = asm.cur
    if cur is None:
        return
    if not cont:
        cur["exception"] = text[:300]
        asm.note(f"the traceback ends with: {text[:200]}")
    low = text.lower()
    if "gloo" in low and cur["backend"] is None:
        cur["backend"], cur["group_kind"] = "gloo", "CPU"
    elif "nccl" in low and cur["backend"] is None:
        cur["backend"], cur["group_kind"] = "NCCL", "device"
    if "timed out" in low or "timeout" in low:
        asm.note("torch timed out waiting in this collective: the rank was blocked there")
    m = _FAULTY_RE.search(text) if "monitoredbarrier" in low else None
    if m:
        who = (m.group(1) or m.group(2)).strip().rstrip(",")
        asm.note(f"torch's monitored_barrier names rank(s) {who} as faulty: they did not reach the barrier")
