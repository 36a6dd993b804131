"""The one rank/process model every reader feeds: open processes and threads, boundaries, bounds, collapsing.

A reader module (``pyspy``, ``faulthandler``, ``traceback``, ``pystack``, ``gdb``, ``flight_recorder``,
``condensed``) recognises its own lines and calls the :class:`Assembler`: ``new_process``, ``new_thread``,
``add_frame``, ``note``. The rule every reader keeps: a process starts only where the text says one does (a process
header such as py-spy's ``Process <pid>:``, a file, a rank prefix or heading, or, in a format that writes no header,
the next dump as that format's writer delimits it); never at a blank line or any other layout (issue 29 item 0). The
assembler owns what is common: a block without a process header becomes a process of its own (never merged into the
previous one), successive dumps of one process (same pid, or for a format without a header the same set of thread
ids) collapse to the last one with a note, at most ``MAX_FRAMES`` frames per thread, ``MAX_THREADS`` threads per
process and ``MAX_PROCESSES`` processes per source are kept (memory stays bounded on 50 MB inputs; the rest is
counted and said), and unreadable lines are counted and the first one quoted.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Optional

from repro.readers.common import guess_main
from repro.readers.types import FORMAT_NAMES, Frame, ProcessDump, ThreadStack

MAX_FRAMES = 256  # frames kept per thread (innermost ones); the rest are counted
MAX_THREADS = 512  # threads kept per process
MAX_KEPT_THREADS = 32768  # threads kept per reading (one file), every process of it together
# distinct frames (function, file, line) kept per reading: equal frames are one object, so a real dump's repeats cost
# a list slot each; a file of ever-new frames stops being kept here (about 100 MB), said in one warning
MAX_DISTINCT_FRAMES = 131072
# processes kept per source: more ranks than a dump of one job plausibly holds (a 64-way TP × 16-way PP group is
# 1024); the rest are counted, never kept (issue 29 item 1: 50 MB read as 100,438 ranks)
MAX_PROCESSES = 1024  # per reading (one file), every source of it together
# formats that write no process header: a dump of theirs is known by its set of thread ids, so successive dumps of one
# process (a thread id seen again starts the next dump) are one process, never a rank each
ID_SET_FORMATS = frozenset({"faulthandler", "pystack", "gdb"})


def new_shared() -> dict:
    """What the sources of one reading share: processes and threads kept, the distinct frames (one object each) and
    how many new frames the bound on them left out."""
    return {"kept": 0, "threads": 0, "frames": {}, "frames_dropped": 0}


class Assembler:
    """Collects the processes of one source (one file, or one log prefix of it). Not thread-safe."""

    def __init__(self, label: str = "", shared: Optional[dict] = None) -> None:
        self.label = label
        # what the sources of one reading (one file) share: the processes kept by all of them ("kept"), so the bound
        # on processes holds for a file of 20,000 rank prefixes too
        self.shared = shared if shared is not None else new_shared()
        self.done: list[dict[str, Any]] = []
        self.cur: Optional[dict[str, Any]] = None
        self.thr: Optional[dict[str, Any]] = None
        self.after_blank = False  # the line before this one was blank (only faulthandler's layout rule reads it)
        self.fh_blank_between = False  # this source showed a blank line between two faulthandler threads
        self.mode = ""  # reader sub-state ("fr" after a Flight Recorder header, "tb" in a traceback, …)
        self.pending_rank: Optional[tuple[int, str]] = None
        self.prefix_rank: Optional[tuple[int, str]] = None
        self.ignored = 0
        self.first_ignored: Optional[tuple[int, str]] = None
        self.errors: list[str] = []
        self.blocks = 0
        self.dropped_processes = 0
        self._index: dict = {}

    # ---- processes -------------------------------------------------------------------------------------------
    def new_process(self, fmt: str, n: int, pid: Optional[int] = None, title: str = "", note: str = "") -> dict:
        """Close the open process and start another of format ``fmt`` at line ``n``."""
        self.close_process()
        self.blocks += 1
        rank = self.pending_rank or self.prefix_rank
        self.pending_rank = None
        self.cur = {"fmt": fmt, "pid": pid, "title": title, "python_version": "", "threads": [], "notes": [],
                    "warnings": [], "rank_hint": rank, "first_line": n, "block": self.blocks, "backend": None,
                    "op": None, "group_kind": None, "headerless": False, "successive": 1}
        if note:
            self.cur["notes"].append(note)
        return self.cur

    def process(self, fmt: str, n: int) -> dict:
        """The open process, or a new headerless one of format ``fmt``."""
        if self.cur is None:
            self.new_process(fmt, n)
            self.cur["headerless"] = True
        return self.cur

    def close_process(self) -> None:
        self.close_thread()
        if self.cur is None:
            return
        cur, self.cur = self.cur, None
        self.mode = ""
        if not cur["threads"] and not cur["warnings"] and cur["pid"] is None and not cur["title"]:
            return  # an empty block (e.g. a heading with nothing under it)
        if cur["fmt"] == "condensed":
            from repro.readers.condensed import finish_thread_check
            if not finish_thread_check(cur):  # a stray word, not a frame list
                self.ignore(cur["first_line"], cur.get("first_text", ""))
                self.blocks -= 1
                self.shared["threads"] -= len(cur["threads"])
                return
        idx = self._index.get(self._key(cur))
        if idx is None and self.done and self._same_process(self.done[-1], cur):
            idx = len(self.done) - 1
        if idx is not None:
            prev = self.done[idx]
            self.shared["threads"] -= len(prev["threads"])  # the earlier dump is replaced: its threads are freed
            cur["successive"] = prev["successive"] + 1
            cur["pid"] = cur["pid"] if cur["pid"] is not None else prev["pid"]
            cur["title"] = cur["title"] or prev["title"]
            cur["rank_hint"] = cur["rank_hint"] or prev["rank_hint"]
            cur["block"] = prev["block"]
            self.done[idx] = cur
            self.blocks -= 1
            self._index[self._key(cur)] = idx
            return
        if self.shared["kept"] >= MAX_PROCESSES:
            self.dropped_processes += 1
            self.shared["threads"] -= len(cur["threads"])
            return
        self.shared["kept"] += 1
        self.done.append(cur)
        key = self._key(cur)
        if key is not None:
            self._index[key] = len(self.done) - 1

    @staticmethod
    def _key(d: dict):
        """Identity of a process across the file: its pid, or for a format without a process header (faulthandler,
        pystack, gdb) its set of thread ids: successive dumps of one process show the same threads."""
        if not d["threads"]:
            return None
        if d["pid"] is not None:
            return ("pid", d["fmt"], d["pid"])
        if d["fmt"] in ID_SET_FORMATS:
            ids = frozenset(t["thread_id"] for t in d["threads"])
            return ("ids", d["fmt"], ids) if "" not in ids else None
        return None

    @staticmethod
    def _same_process(a: dict, b: dict) -> bool:
        if a["fmt"] != b["fmt"] or not b["threads"]:
            return False
        if a["pid"] is not None and b["pid"] is not None:
            return a["pid"] == b["pid"]
        if a["fmt"] in ID_SET_FORMATS and (b["pid"] is None or a["pid"] is None):
            ids_a = {t["thread_id"] for t in a["threads"]}
            ids_b = {t["thread_id"] for t in b["threads"]}
            return bool(ids_a) and "" not in ids_a and ids_a == ids_b
        return False

    # ---- threads ---------------------------------------------------------------------------------------------
    def new_thread(self, fmt: str, n: int, thread_id: str = "", name: str = "", *, order: str = "inner",
                   active: Optional[bool] = None, gil: Optional[bool] = None, status: str = "",
                   is_main: Optional[bool] = None) -> dict:
        """Start a thread in the open process (``order``: ``inner`` = frames arrive innermost first)."""
        self.close_thread()
        cur = self.process(fmt, n)
        if len(cur["threads"]) >= MAX_THREADS or self.shared["threads"] >= MAX_KEPT_THREADS:
            cur["dropped_threads"] = cur.get("dropped_threads", 0) + 1
            self.thr = {"discard": True, "frames": [], "order": order, "dropped": 0}
            return self.thr
        self.shared["threads"] += 1
        frames: Any = [] if order == "inner" else deque(maxlen=MAX_FRAMES)
        self.thr = {"thread_id": thread_id, "name": name, "active": active, "gil": gil, "status": status,
                    "is_main": is_main, "frames": frames, "order": order, "dropped": 0}
        cur["threads"].append(self.thr)
        self.after_blank = False
        return self.thr

    def discard_thread(self, n: int, counter: str) -> dict:
        """Consume a thread block without keeping it, counting it under ``counter`` in the open process (a note says
        how many were not kept)."""
        self.close_thread()
        cur = self.process("py-spy", n)
        cur[counter] = cur.get(counter, 0) + 1
        self.thr = {"discard": True, "frames": [], "order": "inner", "dropped": 0}
        return self.thr

    def thread_ids(self) -> set:
        return {t["thread_id"] for t in self.cur["threads"]} if self.cur else set()

    def wants_frame(self) -> bool:
        """Whether a frame added now would be kept (an open thread that is kept and not yet full, innermost-first):
        a reader checks it before it builds the frame. A frame it skips is counted as the bound's."""
        t = self.thr
        if t is None or t.get("discard"):
            return False
        if t["order"] == "inner" and len(t["frames"]) >= MAX_FRAMES:
            t["dropped"] += 1
            return False
        return True

    def frame(self, function: str, file: str, line: Optional[int], native: bool = False) -> Optional[Frame]:
        """The one :class:`Frame` object for these fields in this reading, or None once :data:`MAX_DISTINCT_FRAMES`
        distinct frames are kept and this one is new (counted)."""
        cache = self.shared["frames"]
        key = (function, file, line, native)
        f = cache.get(key)
        if f is None:
            if len(cache) >= MAX_DISTINCT_FRAMES:
                self.shared["frames_dropped"] += 1
                return None
            f = cache[key] = Frame(function=function, module_or_file=file, line=line, native=native)
        return f

    def add_frame(self, f: Optional[Frame]) -> None:
        """Add a frame to the open thread (equal frames of one reading become one object; None: left out by the bound
        on distinct frames)."""
        t = self.thr
        if t is None or t.get("discard"):
            return
        if f is not None:
            f = self.frame(f.function, f.module_or_file, f.line, f.native)
        if f is None:
            return
        if t["order"] == "inner":
            if len(t["frames"]) >= MAX_FRAMES:
                t["dropped"] += 1
                return
            t["frames"].append(f)
        else:
            if len(t["frames"]) == MAX_FRAMES:
                t["dropped"] += 1
            t["frames"].append(f)

    def close_thread(self) -> None:
        self.thr = None

    # ---- other -----------------------------------------------------------------------------------------------
    def note(self, text: str) -> None:
        if self.cur is not None and text not in self.cur["notes"]:
            self.cur["notes"].append(text)

    def warn(self, text: str) -> None:
        if self.cur is not None and text not in self.cur["warnings"]:
            self.cur["warnings"].append(text)

    def ignore(self, n: int, line: str) -> None:
        self.ignored += 1
        if self.first_ignored is None:
            self.first_ignored = (n, line)

    def finish(self) -> list[ProcessDump]:
        """Close everything and return the processes, in file order."""
        self.close_process()
        out = []
        for d in self.done:
            out.append(_to_dump(d, self.label))
        return out  # self.dropped_processes: said once per reading, by the reader (repro.readers.parse_lines)


def dropped_frames_warning(count: int) -> str:
    """The one warning for ``count`` frames left out by :data:`MAX_DISTINCT_FRAMES` in one reading."""
    return (f"{count} frame(s) not kept beyond the first {MAX_DISTINCT_FRAMES} distinct frames of this file (the "
            "readers' bound on memory): some threads lack their outer frames; split the file per rank")


def dropped_processes_warning(count: int) -> str:
    """The one warning for ``count`` process blocks beyond :data:`MAX_PROCESSES` of one reading."""
    return (f"{count} more process block(s) beyond the first {MAX_PROCESSES} not read (more ranks than a dump of one "
            "job plausibly holds); split the file per rank, or analyze the ranks you need")


def _to_dump(d: dict, label: str) -> ProcessDump:
    threads = []
    warnings = list(d["warnings"])
    notes = list(d["notes"])
    for t in d["threads"]:
        frames = list(t["frames"])
        if t["order"] == "outer":
            frames.reverse()
        threads.append(ThreadStack(thread_id=t["thread_id"], name=t["name"], is_main=bool(t["is_main"]),
                                   frames=frames, active=t["active"], gil=t["gil"], status=t["status"],
                                   dropped_frames=t["dropped"]))
    for t in threads:
        if not t.frames:
            warnings.append(f"thread {t.thread_id or '(no id)'} ({t.name or 'unnamed'}) has no frames (truncated dump?)")
        if t.dropped_frames:
            notes.append(f"thread {t.thread_id or t.name or '(no id)'}: {t.dropped_frames} outer frame(s) beyond the "
                         f"first {MAX_FRAMES} not kept")
    if d.get("main_named", 0) > 1:
        # one header, several threads named MainThread: kept as one process (a reader never starts a rank without a
        # process header, issue 29 item 0), and said, with how to have them read as processes
        warnings.append(f"{d['main_named']} threads named 'MainThread' in one process"
                        + (f" (pid {d['pid']})" if d["pid"] is not None else " (no 'Process <pid>:' header)")
                        + ": read as one process with one main thread; if the text joins several processes' dumps, "
                          "keep py-spy's 'Process <pid>:' line above each, or give each its own file")
    if d.get("duplicate_threads"):
        notes.append(f"{d['duplicate_threads']} repeated thread block(s) (a thread id this process already showed) not kept")
    if d.get("dropped_threads"):  # a bound cut real content: said where analyze prints it, not only in --json
        warnings.append(f"{d['dropped_threads']} thread(s) of this process not kept beyond the readers' bound "
                        f"({MAX_THREADS} per process, {MAX_KEPT_THREADS} per file)")
    if d["successive"] > 1:
        what = "same pid" if d["pid"] is not None and d["fmt"] != "faulthandler" else "same set of thread ids"
        notes.append(f"{d['successive']} successive dumps of one process ({what}): kept the last one")
        if d["fmt"] == "faulthandler":
            warnings.append(f"the file holds {d['successive']} faulthandler dumps of one process; used the last one")
    if d["headerless"] and d["fmt"] in ("py-spy", "ray-stack") and d["threads"]:
        notes.append("a block without a 'Process <pid>:' header: read as a process of its own")
    mains = [i for i, t in enumerate(threads) if t.is_main]
    if len(mains) > 1:  # one main thread per process: the one whose id is the pid, else the first
        keep = next((i for i in mains if d["pid"] is not None and threads[i].thread_id == str(d["pid"])), mains[0])
        threads = [t.model_copy(update={"is_main": False}) if t.is_main and i != keep else t
                   for i, t in enumerate(threads)]
    threads = guess_main(threads, d["pid"], d.get("current"))
    if d["fmt"] in ("py-spy-json", "faulthandler", "pystack", "gdb"):
        threads.sort(key=lambda t: not t.is_main)
    if not threads and not warnings:
        warnings.append(f"a {FORMAT_NAMES.get(d['fmt'], d['fmt'])} block without any thread (truncated dump?)")
    rank, src = d["rank_hint"] if d["rank_hint"] else (None, "")
    return ProcessDump(pid=d["pid"], title=d["title"], python_version=d["python_version"], fmt=d["fmt"],
                       label=label, threads=threads, warnings=warnings, notes=notes, rank_hint=rank,
                       rank_hint_source=src, block=d["block"], first_line=d["first_line"], backend=d["backend"],
                       op=d["op"], group_kind=d["group_kind"])
