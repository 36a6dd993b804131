"""gdb backtraces (``bt``, ``thread apply all bt``; checked with GNU gdb 13 on Debian, a hung torch gloo job).

``Thread <n> (Thread 0x… (LWP <tid>) "<name>"):`` then ``#<k>  0x… in <symbol> (<args>) from <library>`` or
``#<k>  <symbol> (<args>) at <file>:<line>``, innermost first; a plain ``bt`` has no thread line. Every frame is
native: without CPython's gdb extension there are no Python function names, only interpreter frames
(``_PyEval_EvalFrameDefault``), and the reader says so. ``Attaching to process <pid>`` / ``[Inferior 1 (process
<pid>) detached]`` give the pid; gdb's own chatter (``[New LWP …]``, libthread_db lines) is skipped. With CPython's
gdb extension (``thread apply all py-bt``; checked with the libpython.py Cython ships, gdb 13) a thread holds
``Traceback (most recent call first):`` then ``  File "<path>", line <n>, in <function>`` and
``  <built-in method <name> of …>`` lines, innermost first; frames it could not read are said in a note. Open MPI's
``mpirun --timeout N --get-stack-traces`` prints ``STACK TRACE FOR PROC [[<job>,1],<rank>] (<host>, PID <pid>)`` and
then gdb's output for that process with a TAB before each line (no MPI here: its fixture is written by hand).
"""

from __future__ import annotations

import re

from repro.readers.common import shorten_path
from repro.readers.types import Frame

THREAD_RE = re.compile(r"^Thread (\d+) \(Thread (0x[0-9a-fA-F]+) \(LWP (\d+)\)(?: \"([^\"]*)\")?\):\s*$")
THREAD2_RE = re.compile(r"^Thread (\d+) \((?:LWP|process) (\d+)\)(?: \"([^\"]*)\")?:\s*$")
FRAME_RE = re.compile(r"^#(\d+)\s+(?:(0x[0-9a-fA-F]+) in )?(.+?)\s*$")
TAIL_RE = re.compile(r"^(.*?)(?: (from|at) (\S+))?$")
PID_RE = re.compile(r"^(?:Attaching to (?:process|program: \S+, process) (\d+)|\[Inferior \d+ \(process (\d+)\) detached\])")
NOISE_RE = re.compile(r"^(\[New (LWP|Thread) |\[Thread debugging using|Using host libthread_db|Reading symbols from|"
                      r"\[Inferior \d+|warning: |Downloading |0x[0-9a-f]+ in \S+ \(\) from )")
PYBT_HEAD = "Traceback (most recent call first):"
PYBT_FRAME_RE = re.compile(r"^\s+File \"(.*)\", line (\d+), in (.+?)\s*$")
PYBT_BUILTIN_RE = re.compile(r"^\s+<built-in (?:method|function) (\w+)")
PYBT_NOISE = ("(unable to read python frame information)", "Unable to locate python frame",
              "(frame information optimized out)")
_PY_EVAL = ("_PyEval_EvalFrameDefault", "PyEval_EvalCode", "_PyEval_Vector", "_PyFunction_Vectorcall")

# a superset of the lines :func:`handle` can take that are not indented (the reader gate, see readers/__init__.py)
GATE_START = (r"STACK TRACE FOR PROC |Traceback \(most recent call first|Unable to locate|\(unable|\(frame information|Python Exception <|"
              r"Attaching to |\[Inferior |Thread \d|#|\[New |\[Thread debugging|Using host|Reading symbols|"
              r"warning: |Downloading |0x[0-9a-f]+ in ")
GATE_SUBSTRINGS: tuple = ()


def _frame(rest: str) -> Frame:
    m = TAIL_RE.match(rest)
    body, kind, where = m.group(1), m.group(2), m.group(3)
    func = body.split(" (", 1)[0].strip() or "??"
    line = None
    file = where or "?"
    if kind == "at" and where and ":" in where:
        file, _, ln = where.rpartition(":")
        line = int(ln) if ln.isdigit() else None
    return Frame(function=func, module_or_file=file.rsplit("/", 1)[-1] if kind == "from" else file, line=line,
                 native=True)


OMPI_RE = re.compile(r"^STACK TRACE FOR PROC \[\[(\d+),(\d+)\],(\d+)\] \(([^,]*), PID (\d+)\)")


def handle(asm, s: str, n: int) -> bool:
    """Consume one gdb line; False when it is not one."""
    m = OMPI_RE.match(s)
    if m:  # Open MPI's mpirun --timeout --get-stack-traces: gdb's output for one process, each line after a TAB
        asm.pending_rank = (int(m.group(3)), f"mpirun stack trace header [[{m.group(1)},{m.group(2)}],{m.group(3)}]")
        asm.new_process("gdb", n, pid=int(m.group(5)), title=f"MPI rank {m.group(3)} on {m.group(4)}")
        asm.cur["ompi"] = True
        return True
    if s.startswith("\t") and asm.cur is not None and asm.cur.get("ompi"):
        s = s[1:]
    m = PID_RE.match(s)
    if m:
        pid = int(m.group(1) or m.group(2))
        cur = asm.cur
        if cur is not None and cur["fmt"] == "gdb" and cur["pid"] in (None, pid):
            cur["pid"] = pid
        elif m.group(1):
            asm.new_process("gdb", n, pid=pid)
        return True
    m = THREAD_RE.match(s) or THREAD2_RE.match(s)
    if m:
        num = m.group(1)
        tid = m.group(3) if m.re is THREAD_RE else m.group(2)
        name = (m.group(4) if m.re is THREAD_RE else m.group(3)) or ""
        cur = asm.cur
        if cur is None or cur["fmt"] != "gdb" or num in {t.get("gdb_num") for t in cur["threads"]}:
            asm.new_process("gdb", n)
        asm.new_thread("gdb", n, tid, name, is_main=num == "1" or None)
        asm.thr["gdb_num"] = num
        asm.mode = ""
        return True
    t = asm.thr
    if t is not None and (t.get("gdb_num") or t.get("gdb_plain")):
        st = s.strip()
        if st == PYBT_HEAD:  # CPython's gdb extension: 'py-bt', innermost first
            asm.mode = "gdb-py"
            return True
        if st in PYBT_NOISE or st.startswith("Python Exception <"):
            if st.startswith("(unable") and asm.mode == "gdb-py":
                asm.note("gdb's py-bt could not read some Python frames (no debug information for this Python?)")
                if all(f.module_or_file == "<built-in>" for f in t["frames"]):
                    t["frames"].clear()  # a lone built-in ('wait') without its Python caller says nothing
                    t["pybt_unreadable"] = True
            return True
        if asm.mode == "gdb-py":
            m = PYBT_FRAME_RE.match(s)
            if m:
                asm.add_frame(Frame(function=m.group(3), module_or_file=shorten_path(m.group(1)),
                                    line=int(m.group(2))))
                return True
            m = PYBT_BUILTIN_RE.match(s)
            if m and t.get("pybt_unreadable"):
                return True
            if m:
                asm.add_frame(Frame(function=m.group(1), module_or_file="<built-in>", line=None, native=True))
                return True
            if s.startswith("    "):
                return True  # the source line under a frame
    if s.startswith("#"):
        m = FRAME_RE.match(s)
        if m and (m.group(2) or " at " in s or " from " in s or "()" in s):
            if " from " in s and re.search(r" from \S+:\d+\s*$", s) and not m.group(2):
                return False  # '#0 f from file.py:12' is a Flight Recorder frame
            k = int(m.group(1))
            t = asm.thr
            if t is None or not t.get("gdb_num") and t.get("gdb_plain") is None or (k == 0 and t["frames"]):
                cur = asm.cur
                if cur is None or cur["fmt"] != "gdb":
                    asm.new_process("gdb", n)
                asm.new_thread("gdb", n, "", "", is_main=None)
                asm.thr["gdb_plain"] = True
            f = _frame(m.group(3))
            if f.function in _PY_EVAL:
                asm.note("gdb shows only native frames: the Python frames are absent (the interpreter's "
                         "_PyEval_EvalFrameDefault is there; use py-spy or pystack for Python function names)")
            asm.add_frame(f)
            return True
    if asm.cur is not None and asm.cur["fmt"] == "gdb" and NOISE_RE.match(s):
        return True
    return False
