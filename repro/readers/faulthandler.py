"""CPython ``faulthandler`` dumps (``dump_traceback(all_threads=True)``, ``register``; checked on CPython 3.11).

``Current thread 0x… (most recent call first):`` / ``Thread 0x… (most recent call first):`` (3.12+ may add a
name in brackets or quotes), ``Stack (most recent call first):`` for a single-thread dump, then frames
``  File "<path>", line <n> in <co_name>``. Frames without any header (a pasted excerpt) form a thread of their
own process. A thread id seen again, a second ``Current thread``, or a header straight after a frame once the dump
has had its ``Current thread`` and the source has shown a blank line between two threads (CPython puts a blank line
between the threads of one dump, none between dumps; without that layout no blank line is read as a boundary)
starts another dump: the assembler keeps the last of successive dumps with the same set of thread ids (one process
signalled twice, as ``faulthandler-<pid>.txt`` holds) and treats a dump with a different set as another process.
"""

from __future__ import annotations

import re

from repro.readers.common import shorten_path
from repro.readers.types import Frame

THREAD_RE = re.compile(
    r"^(Current thread|Thread) (0x[0-9A-Fa-f]+)(?: \[([^\]]*)\]| \"([^\"]*)\")? \(most recent call first\):\s*$")
STACK_RE = re.compile(r"^Stack \(most recent call first\):\s*$")
FRAME_RE = re.compile(r"^\s+File \"(.*)\", line (\d+|\?\?\?) in (.+?)\s*$")

# a superset of the lines :func:`handle` can take that are not indented (the reader gate, see readers/__init__.py)
GATE_START = r"Current thread|Thread 0x|Stack \(most|\.\.\.\s*$|<"
GATE_SUBSTRINGS: tuple = ()


def handle(asm, s: str, n: int) -> bool:
    """Consume one faulthandler line; False when it is not one."""
    m = THREAD_RE.match(s)
    if m or STACK_RE.match(s):
        tid = m.group(2) if m else "0x0"
        cur = asm.cur
        # CPython writes a blank line between the threads of one dump, none between dumps, and one 'Current
        # thread' per dump: in a dump that already has its 'Current thread', a second one starts the next dump, and
        # so does a header right after a frame once this source has shown its blank lines between threads (a paste
        # that lost its blank lines is one dump, never a rank per thread: issue 29 item 0)
        if cur is not None and cur["fmt"] == "faulthandler" and cur["threads"] and asm.after_blank:
            asm.fh_blank_between = True
        next_dump = cur is not None and cur.get("current") is not None and (
            (m is not None and m.group(1) == "Current thread")
            or (not asm.after_blank and asm.fh_blank_between))
        if cur is not None and (cur["fmt"] not in ("faulthandler", "py-spy") or tid in asm.thread_ids()
                                or (cur["fmt"] == "py-spy" and cur["threads"]) or cur["headerless"] or next_dump):
            cur = None
        if cur is None:
            asm.new_process("faulthandler", n)
        elif cur["fmt"] == "py-spy":
            cur["fmt"] = "faulthandler"  # a 'Process <pid>: <title>' line written by repro.capture above it
        asm.new_thread("faulthandler", n, tid, (m.group(3) or m.group(4) or "") if m else "")
        asm.thr["fh"] = True
        if m and m.group(1) == "Current thread":
            asm.cur["current"] = tid
        return True
    m = FRAME_RE.match(s)
    if m:
        t = asm.thr
        if t is None or not t.get("fh"):
            asm.new_process("faulthandler", n, note="frames without a 'Thread 0x…' header: read as one thread "
                                                    "of a process of its own")
            asm.cur["headerless"] = True
            asm.new_thread("faulthandler", n, "", "")
            asm.thr["fh"] = True
        lineno = None if m.group(2) == "???" else int(m.group(2))
        asm.add_frame(Frame(function=m.group(3), module_or_file=shorten_path(m.group(1)), line=lineno))
        return True
    t = asm.thr
    if t is not None and t.get("fh"):
        st = s.strip()
        if st == "...":
            asm.note("faulthandler truncated a stack ('...'): outer frames are missing")
            asm.warn("faulthandler truncated a stack ('...'): outer frames are missing")
            return True
        if st in ("<no Python frame>", "<tstate is freed>"):
            return True
        if s.startswith("Current thread's C stack"):
            asm.close_thread()  # 3.14 C stack section: not read
            asm.mode = "fh-c"
            return True
    if asm.mode == "fh-c" and s.startswith("  "):
        return True
    return False
