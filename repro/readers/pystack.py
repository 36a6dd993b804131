"""pystack (``pystack remote PID`` / ``pystack core``; checked with pystack 1.7.2 on CPython 3.11).

``Traceback for thread <tid> (<name>) [<flags>] (most recent call last):`` then, outermost first,
``    (Python) File "<path>", line <n>, in <function>`` with the source line under it, and with ``--native``
``    (C) File "<file>", line <n>, in <symbol> (<library>)``. Flags ``Has the GIL`` → holds the GIL; the thread whose
id is the pid is the main one. A thread id seen again starts another process.
"""

from __future__ import annotations

import re

from repro.readers.common import shorten_path
from repro.readers.types import Frame

HEAD_RE = re.compile(r"^Traceback for thread (\d+)(?: \(([^)]*)\))?(?: \[([^\]]*)\])? \(most recent call last\):\s*$")
PY_RE = re.compile(r"^\s+\(Python\) File \"(.*)\", line (\d+), in (.+?)\s*$")
C_RE = re.compile(r"^\s+\(C\) File \"(.*)\", line (\d+|\?+), in (.+?)(?: \(([^()]*)\))?\s*$")
PID_RE = re.compile(r"^(?:Process|Analyzing process|Core file)\D*(\d+)")

# a superset of the lines :func:`handle` can take that are not indented (the reader gate, see readers/__init__.py)
GATE_START = r"Traceback for thread|\((?:Python|C)\)"
GATE_SUBSTRINGS: tuple = ()


def handle(asm, s: str, n: int) -> bool:
    """Consume one pystack line; False when it is not one."""
    m = HEAD_RE.match(s)
    if m:
        tid = m.group(1)
        cur = asm.cur
        if cur is None or cur["fmt"] != "pystack" or tid in asm.thread_ids():
            asm.new_process("pystack", n)
        flags = (m.group(3) or "").lower()
        asm.new_thread("pystack", n, tid, m.group(2) or "", order="outer",
                       gil=True if "has the gil" in flags else None, status=m.group(3) or "")
        asm.thr["pystack"] = True
        return True
    t = asm.thr
    if t is None or not t.get("pystack"):
        return False
    m = PY_RE.match(s)
    if m:
        asm.add_frame(Frame(function=m.group(3), module_or_file=shorten_path(m.group(1)), line=int(m.group(2))))
        return True
    m = C_RE.match(s)
    if m:
        line = int(m.group(2)) if m.group(2).isdigit() else None
        asm.add_frame(Frame(function=m.group(3), module_or_file=m.group(4) or shorten_path(m.group(1)), line=line,
                            native=True))
        return True
    if s.startswith("        ") or s.strip().startswith(("(Python)", "(C)")):
        return True  # the source line under a frame
    return False
