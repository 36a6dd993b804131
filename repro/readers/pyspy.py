"""py-spy: ``dump`` text (current and old layouts, ``--native``, ``--locals``), ``--json``, and ``ray stack`` files.

Text (checked against py-spy 0.4.3; the old layout against py-spy 0.1–0.3 output quoted in public issues):
``Process <pid>: <title>``, ``Python v<ver> (<exe>)``, then per thread ``Thread <tid> (<status>): "<name>"`` —
``<tid>`` decimal or ``0x…`` hex (old), and may be missing (``Thread (idle) "MainThread"``); ``<status>`` is
``idle``, ``active``, ``active+gil``, ``idle+gil`` or ``gil`` — then frames ``<function> (<file>:<line>)``
indented by spaces (4 today) or a TAB (old); ``--native`` frames are ``<symbol> (<library>)`` without a line;
deeper ``--locals`` lines are skipped. ``ray stack`` runs ``py-spy dump`` for every ``ray::`` process after a
``Stack dump for <ps line>`` line: each such line starts a process (pid and command from the ps columns).
Processes start only there and at ``Process <pid>:``: every thread up to the next such line belongs to the open
process whatever lies between (blank lines, a second ``MainThread``, which a warning names), a thread id seen again
in it is the same block repeated (counted in a note, not kept), and text without any header is one process.
``--json``: a list of ``{pid, thread_id, thread_name, os_thread_id, active, owns_gil, frames: [{name, filename,
module, short_filename, line}]}``; a frame with a non-null ``module`` (a shared library) is native.
"""

from __future__ import annotations

import json
import re
from typing import Optional, Union

from repro.readers.common import guess_main, is_native_file, shorten_path
from repro.readers.types import Frame, ProcessDump, ThreadStack

PROC_RE = re.compile(r"^Process (\d+): ?(.*)$")
PYVER_RE = re.compile(r"^Python v(\S+)")
THREAD_RE = re.compile(r"^Thread(?: (0x[0-9A-Fa-f]+|\d+))?(?: \(([a-z+]*)\))?(?::)?(?:\s*\"(.*)\")?:?\s*$")
FRAME_RE = re.compile(r"^( {2,}|\t+)(\S.*?) \(([^()]*)\)\s*$")
FRAME_LINE_RE = re.compile(r"^(.*):(\d+)$")
RAY_RE = re.compile(r"^Stack dump for (.*)$")

# a superset of the lines :func:`handle` can take that are not indented (the reader gate, see readers/__init__.py)
GATE_START = r"Stack dump for |Process \d|Python v|Thread|Error|(?i:error:)"
GATE_SUBSTRINGS: tuple = ()


def _status(status: str) -> tuple[Optional[bool], Optional[bool]]:
    if not status:
        return None, None
    return ("active" in status), ("gil" in status)


def handle(asm, s: str, n: int) -> bool:
    """Consume one py-spy / ray-stack line; False when it is not one."""
    m = RAY_RE.match(s)
    if m:
        cols = m.group(1).split(None, 10)
        pid = int(cols[1]) if len(cols) > 1 and cols[1].isdigit() else None
        title = cols[10] if len(cols) > 10 else m.group(1)
        asm.new_process("ray-stack", n, pid=pid, title=title.strip())
        asm.cur["ray_waiting"] = True
        return True
    m = PROC_RE.match(s)
    if m:
        pid, title = int(m.group(1)), m.group(2).strip()
        cur = asm.cur
        if cur is not None and cur.get("ray_waiting") and not cur["threads"]:
            cur["ray_waiting"] = False
            cur["pid"], cur["title"] = pid, title or cur["title"]
            return True
        asm.new_process("py-spy", n, pid=pid, title=title)
        return True
    m = PYVER_RE.match(s)
    if m:
        asm.process("py-spy", n)["python_version"] = m.group(1)
        return True
    if s.startswith("Thread"):
        m = THREAD_RE.match(s)
        if m and (m.group(1) or m.group(2) is not None or m.group(3) is not None):
            tid, name = m.group(1) or "", m.group(3) or ""
            active, gil = _status(m.group(2) or "")
            cur = asm.cur
            if cur is not None and cur["fmt"] not in ("py-spy", "ray-stack"):
                if cur["threads"] or cur["fmt"] != "unknown":
                    cur = None
            # py-spy's process boundary is its 'Process <pid>:' line (or ray's 'Stack dump for'): every thread up to
            # the next one belongs to the open process, whatever the layout between them (a blank line, a second
            # MainThread, a thread id seen again). A reader never starts a rank on its own (issue 29 item 0: a blank
            # line between two threads of one process read as two ranks, a false divergence); what looks odd is said
            if cur is not None and tid and tid in cur.setdefault("tids", set()):
                # a thread id this process already showed: the same block again (a paste, or a log repeating the
                # dump); its frames are consumed and counted, never kept (issue 29 item 1: 50 MB of one header)
                asm.discard_thread(n, "duplicate_threads")["pyspy"] = True
                return True
            if cur is None:
                asm.new_process("py-spy", n)
                asm.cur["headerless"] = True
            elif cur["fmt"] == "unknown":
                cur["fmt"] = "py-spy"
            cur = asm.cur
            if name == "MainThread":
                cur["main_named"] = cur.get("main_named", 0) + 1
            pid = cur["pid"]
            is_main = None
            if (tid and pid is not None and tid == str(pid)) or (name == "MainThread" and not cur.get("main_named_kept")):
                is_main = True
            asm.new_thread(cur["fmt"], n, tid, name, active=active, gil=gil, status=m.group(2) or "",
                           is_main=is_main)
            if tid and not asm.thr.get("discard"):
                cur.setdefault("tids", set()).add(tid)
            if name == "MainThread" and not asm.thr.get("discard"):
                cur["main_named_kept"] = True
            asm.thr["pyspy"] = True
            return True
    t = asm.thr
    if t is not None and t.get("pyspy"):
        m = FRAME_RE.match(s)
        if m:
            indent = m.group(1)
            if len(indent.expandtabs(4)) >= 8 and not indent.startswith("\t"):
                return True  # a --locals block
            if not asm.wants_frame():
                return True  # a thread not kept, or full: the frame is consumed, not built
            func, loc = m.group(2), m.group(3)
            lm = FRAME_LINE_RE.match(loc)
            file, lineno = (lm.group(1), int(lm.group(2))) if lm else (loc, None)
            native = (lineno is None and (is_native_file(file) or func.startswith("0x"))) or (
                lineno is not None and is_native_file(file) and not file.endswith(".py"))
            asm.add_frame(asm.frame(func, file, lineno, native))
            return True
        if s.startswith(" " * 8):
            return True  # --locals values
    stripped = s.lstrip()
    if stripped.startswith("Error") or stripped.lower().startswith("error:"):
        asm.errors.append(stripped)
        if asm.cur is not None:
            asm.warn(f"py-spy reported: {stripped}")
        return True
    return False


def json_problem(data: Union[str, bytes], err: ValueError) -> str:
    """Why ``data`` is not py-spy ``--json`` output, in one line: ``not complete JSON`` when the text ends inside
    the document (a truncated file or paste), else ``not valid JSON`` with the decoder's message."""
    pos = getattr(err, "pos", None)
    end = len(data.rstrip()) if isinstance(data, str) else len(data.decode("utf-8", errors="replace").rstrip())
    # the text ran out inside the document: inside a string (JSON strings hold no raw newline, so an unterminated
    # one runs to the end) or at the very end (a missing value, delimiter or bracket)
    if isinstance(err, json.JSONDecodeError) and end and (err.msg.startswith("Unterminated string")
                                                          or (pos is not None and pos >= end - 1)):
        return (f"not complete JSON: it ends inside the document at char {end} ({err.msg}: char {err.pos}): "
                "truncated (a copy or paste cut short?); expected the whole py-spy --json output (a list of threads)")
    return f"not valid JSON ({err}); expected py-spy --json output (a list of threads)"


def parse_pyspy_json(data: Union[str, bytes, list, dict], label: str = "") -> list[ProcessDump]:
    """Parse py-spy ``dump --json`` output (a list of thread objects) into one dump per pid.

    Accepts the text or the decoded object. Malformed thread or frame entries are skipped with a warning; invalid
    JSON yields one empty dump whose warning quotes the decoder's message.
    """
    if isinstance(data, (str, bytes)):
        try:
            obj = json.loads(data)
        except ValueError as e:
            return [ProcessDump(fmt="py-spy-json", label=label, warnings=[json_problem(data, e)])]
    else:
        obj = data
    if isinstance(obj, dict):
        obj = obj.get("threads", [obj])
    if not isinstance(obj, list):
        return [ProcessDump(fmt="py-spy-json", label=label,
                            warnings=["expected a JSON list of thread objects (py-spy --json)"])]
    by_pid: dict[Optional[int], list[ThreadStack]] = {}
    warnings: list[str] = []
    for i, t in enumerate(obj):
        if not isinstance(t, dict) or not isinstance(t.get("frames"), list):
            warnings.append(f"thread entry {i} is not an object with a 'frames' list; skipped")
            continue
        frames: list[Frame] = []
        for fr in t["frames"]:
            if not isinstance(fr, dict) or "name" not in fr:
                warnings.append(f"thread entry {i}: a frame without 'name'; skipped")
                continue
            native = bool(fr.get("module"))
            file = fr.get("short_filename") or shorten_path(str(fr.get("filename") or "?"))
            line = fr.get("line")
            line = int(line) if isinstance(line, int) and (line > 0 or not native) else None
            frames.append(Frame(function=str(fr["name"]), module_or_file=str(file), line=line, native=native))
        pid = t.get("pid") if isinstance(t.get("pid"), int) else None
        tid = t.get("os_thread_id") or t.get("thread_id") or i
        name = str(t.get("thread_name") or "")
        is_main = name == "MainThread" or (pid is not None and t.get("os_thread_id") == pid)
        active = t.get("active") if isinstance(t.get("active"), bool) else None
        gil = t.get("owns_gil") if isinstance(t.get("owns_gil"), bool) else None
        status = "" if active is None else ("active" if active else "idle") + ("+gil" if gil else "")
        by_pid.setdefault(pid, []).append(
            ThreadStack(thread_id=str(tid), name=name, is_main=is_main, frames=frames, active=active, gil=gil,
                        status=status))
    if not by_pid:
        return [ProcessDump(fmt="py-spy-json", label=label, warnings=warnings + ["no threads in the JSON dump"])]
    out = []
    for block, (pid, threads) in enumerate(by_pid.items(), 1):
        threads = guess_main(threads, pid)
        threads.sort(key=lambda t: not t.is_main)
        out.append(ProcessDump(pid=pid, fmt="py-spy-json", label=label, threads=threads, warnings=list(warnings),
                               block=block))
    return out
