"""Readers of stack dumps as people paste them, all feeding one process model (:mod:`repro.readers.types`).

Formats (one module each): py-spy text, old and new, ``ray stack`` files and ``--json`` (:mod:`.pyspy`),
faulthandler with or without headers and several dumps per file (:mod:`.faulthandler`), Python tracebacks such
as torch's timeout errors (:mod:`.traceback`), pystack (:mod:`.pystack`), gdb ``bt`` (:mod:`.gdb`), torch's
watchdog / Flight Recorder text (:mod:`.flight_recorder`), and hand-written frame lists, arrow chains and ``rank
N:`` headings (:mod:`.condensed`). Quoting and log prefixes are removed first (:mod:`.prefixes`); each prefixed
source is read on its own. Lines are read one at a time, so a 50 MB file is read in bounded memory (at most
``MAX_FRAMES`` frames per thread, ``MAX_THREADS`` threads per process, and per file ``MAX_PROCESSES`` processes,
``MAX_KEPT_THREADS`` threads, ``MAX_DISTINCT_FRAMES`` distinct frames and ``MAX_SOURCES`` line prefixes are kept,
the rest counted in one warning each; see :mod:`.assemble`). Each
line first meets one cheap gate (each reader's ``GATE_START``/``GATE_SUBSTRINGS``: a superset of what it can take),
so junk costs one regex per line; after ``GIVE_UP_CHARS`` with no stack, only lines that start a dump are sought
(numbers in benchmarks/RESULTS.md; the gate changes nothing that is read: tests/test_readers_gate.py).

Reading never raises on bad content: what could not be read is in each dump's ``warnings`` (unknown lines counted
and the first one quoted, escaped), what was concluded about the reading in its ``notes``, and every dump says
which format it was read as (``fmt``).
"""

from __future__ import annotations

import io
import itertools
import json
import re
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence, Union

from repro.readers import condensed, faulthandler, flight_recorder, gdb, pyspy, pystack, traceback
from repro.readers.assemble import (MAX_FRAMES, MAX_PROCESSES, MAX_THREADS, Assembler, dropped_frames_warning,
                                    dropped_processes_warning, new_shared)
from repro.readers.common import NO_STACK_HINT, guess_main, is_native_file, shorten_path, summarise_ignored
from repro.readers.prefixes import _ANY_FIXED_RE, clean_line, sniff_label_prefixes
from repro.readers.pyspy import parse_pyspy_json
from repro.readers.types import (
    FORMAT_NAMES,
    CaptureMethod,
    DumpFormat,
    Frame,
    ProcessDump,
    RankCapture,
    ThreadStack,
)

__all__ = [
    "CaptureMethod", "DumpFormat", "FORMAT_NAMES", "Frame", "MAX_FRAMES", "MAX_THREADS", "ProcessDump",
    "RankCapture", "ThreadStack", "detect_format", "is_binary", "load_dump_file", "parse_dump", "parse_faulthandler",
    "parse_lines", "parse_pyspy_json", "parse_pyspy_text", "pp_from_title", "rank_from_filename", "rank_from_title",
    "render_pyspy_text", "shorten_path", "split_log_prefixes", "guess_main", "is_native_file",
]

_READERS = (pyspy, faulthandler, pystack, traceback, gdb, flight_recorder, condensed)
_HANDLERS = tuple(m.handle for m in _READERS)
# The reader gate: one cheap test per line before the handlers. Each reader module states a superset of the lines
# its handler can take when they are not indented (GATE_START, matched at the line's start; GATE_SUBSTRINGS, found
# anywhere). A line that is not indented, matches neither, and comes while no reader is in a sub-state
# (``asm.mode``) would be refused by every handler, so it is counted as ignored without running them: junk costs
# one regex per line, and what is read is the same as without the gate (tests/test_readers_gate.py).
_GATE_START = re.compile("|".join(f"(?:{m.GATE_START})" for m in _READERS))
_GATE_SUBSTRINGS = tuple(dict.fromkeys(x for m in _READERS for x in m.GATE_SUBSTRINGS))
_GATE_SUB_RE = re.compile("|".join(re.escape(x) for x in _GATE_SUBSTRINGS))
# one test each for the line nothing can take: what the line cleaner strips (a prefix, quote, fence, colour code)
# or a reader's gate would let through
_JUNK_START = re.compile(f"(?:{_ANY_FIXED_RE.pattern})|(?:{_GATE_START.pattern})")
_JUNK_SUB = re.compile("|".join(re.escape(x) for x in _GATE_SUBSTRINGS + ("```", "~~~", "\x1b", "\xa0")))
# per reader: (start gate, substring gate or None, handler), in the handlers' order; a line that is not indented,
# outside a sub-state, can only be taken by a reader whose own gate it passes
_GATED = tuple((re.compile(m.GATE_START).match,
                re.compile("|".join(re.escape(x) for x in m.GATE_SUBSTRINGS)).search if m.GATE_SUBSTRINGS else None,
                m.handle) for m in _READERS)


def _handle(asm: Assembler, s: str, n: int, gate: bool) -> bool:
    """Offer line ``s`` to the readers in order; True when one took it."""
    if gate and not (s[0].isspace() or asm.mode):
        for start, sub, h in _GATED:
            if (start(s) or (sub is not None and sub(s))) and h(asm, s, n):
                return True
        return False
    for h in _HANDLERS:
        if h(asm, s, n):
            return True
    return False
MAX_SOURCES = MAX_PROCESSES  # line prefixes (ranks, pods, hosts) read per file; lines of further ones are counted
MAX_COUNTED_SOURCES = 100_000  # distinct further prefixes counted by name (memory stays bounded), then "N+"
MAX_LINE_CHARS = 4096  # longer lines are cut before reading (a 50 MB one-line file stays cheap)
SNIFF_LINES = 2000
GIVE_UP_CHARS = 16 << 20  # characters with no line of a stack in them before only dump-starting lines are sought
_COMMENT_RE = re.compile(r"^#(?!\d)")


# what the first line of a dump holds, in every format but the hand-written ones (scanning a huge file that had no
# stack in its first GIVE_UP_CHARS): py-spy/ray, faulthandler, tracebacks, pystack, gdb, torch's watchdog, fr_trace
_DUMP_START = re.compile(r"Process \d+:|Thread |Traceback \(most recent|Current thread 0x|Stack \(most recent|"
                         r"File \"|Traceback for thread|Stack trace of the failed|OpType=|sequence number: |#\d+ +0x|"
                         r"Stack dump for |Attaching to |STACK TRACE FOR PROC ")


def _has_stack(asm: Assembler) -> bool:
    """Whether a source has read anything a stack is made of: a kept process, or an open one with a thread (a lone
    hand-written-looking word, a condensed block of one frame, does not count)."""
    if asm.done or asm.errors:
        return True
    cur = asm.cur
    if cur is None:
        return False
    if cur["fmt"] == "condensed":
        th = cur["threads"]
        return bool(th) and (len(th[0]["frames"]) > 1 or bool(th[0].get("located")))
    return bool(cur["threads"]) or cur["pid"] is not None


def parse_lines(lines: Iterable[str], source: str = "", gate: bool = True,
                give_up_chars: int = GIVE_UP_CHARS) -> list[ProcessDump]:
    """Read dump lines (any supported format, quoted or prefixed) into one :class:`ProcessDump` per process.

    Returns at least one dump; when no stack was found, one dump of format ``unknown`` whose warnings say what
    was seen and what was expected. ``source`` (a file name) prefixes every warning. ``gate=False`` runs every
    handler on every line (the reading is the same; tests compare the two). When ``give_up_chars`` characters
    (16 Mi by default) have held no line of a stack in any source, only lines that start a dump (not a hand-written
    list) are looked for after that, one cheap search each, and full reading resumes at the first one; the first
    warning says so (a 50 MB junk file answers in seconds, a dump at the end of a big log is still read).
    """
    it = iter(lines)
    head = list(itertools.islice(it, SNIFF_LINES))
    sniffed = sniff_label_prefixes(head)
    labelled = sniffed.compose or sniffed.bracket or sniffed.host  # every line carries its source's prefix
    asms: dict[str, Assembler] = {}
    current = ""
    sticky = False  # the current label is a log record's (SGLang's [time TP1]): unprefixed lines continue it
    plain = not labelled
    start_match, sub_search, fixed_match = _GATE_START.match, _GATE_SUB_RE.search, _ANY_FIXED_RE.match
    junk_start, junk_sub = _JUNK_START.match, _JUNK_SUB.search
    chars = n_found = 0
    shared = new_shared()  # what this reading's sources share (processes, threads, frames kept: see Assembler)
    dropped_lines, dropped_labels = 0, set()
    scan_from = 0  # line number where scanning for a dump's first line began (0: reading every line)
    for n, raw in enumerate(itertools.chain(head, it), 1):
        if len(raw) > MAX_LINE_CHARS:
            raw = raw[:MAX_LINE_CHARS]
        if scan_from > 0:
            if not _DUMP_START.search(raw):
                continue
            scan_from, n_found = -scan_from, n  # found one: read every line from here on
        elif scan_from == 0:
            chars += len(raw)
            if chars > give_up_chars and not n & 4095 and not any(_has_stack(a) for a in asms.values()):
                scan_from = n
                continue
        if gate and plain and not sticky and raw and not raw[0].isspace() and not junk_start(raw) \
                and not junk_sub(raw):
            # the commonest line of a junk file: no prefix, fence or colour code, and no reader's gate passed
            asm = asms.get("")
            if asm is None:
                asm = asms[""] = Assembler("", shared)
            if not asm.mode:
                s = raw.rstrip("\r\n")
                if not _COMMENT_RE.match(s):
                    asm.ignore(n, s)
                asm.after_blank = False
                continue
        if gate and plain and not sticky and not fixed_match(raw) and "```" not in raw and "~~~" not in raw \
                and "\x1b" not in raw and "\xa0" not in raw:
            # no prefix, quote or fence on this line (clean_line would return it as it is)
            s = raw.rstrip("\r\n")
            asm = asms.get("")
            if asm is None:
                asm = asms[""] = Assembler("", shared)
            if not s or s.isspace():
                asm.after_blank = True
                continue
            if not (s[0].isspace() or asm.mode or start_match(s) or sub_search(s)):
                if not _COMMENT_RE.match(s):
                    asm.ignore(n, s)
                asm.after_blank = False
                continue
            if not _handle(asm, s, n, True) and not _COMMENT_RE.match(s.lstrip()):
                asm.ignore(n, s)
            asm.after_blank = False
            continue
        cl = clean_line(raw, *sniffed)
        label = cl.label if cl.label else (current if (labelled or sticky) else "")
        if cl.label:
            current, sticky = cl.label, cl.sticky
        asm = asms.get(label)
        if asm is None:
            if len(asms) >= MAX_SOURCES:  # more sources (rank prefixes, pods, hosts) than one job plausibly has
                dropped_lines += 1
                if len(dropped_labels) < MAX_COUNTED_SOURCES:
                    dropped_labels.add(label)
                continue
            asm = asms[label] = Assembler(label, shared)
        if cl.rank_hint is not None:
            asm.prefix_rank = (cl.rank_hint, cl.hint_source)
        if cl.fence:
            asm.close_process()
            asm.after_blank = True
            continue
        s = cl.text
        if not s.strip():
            asm.after_blank = True
            continue
        if gate and not (s[0].isspace() or asm.mode or start_match(s) or sub_search(s)):
            if not _COMMENT_RE.match(s):
                asm.ignore(n, s)
            asm.after_blank = False
            continue
        if not _handle(asm, s, n, gate) and not _COMMENT_RE.match(s.lstrip()):
            asm.ignore(n, s)
        asm.after_blank = False
    out: list[ProcessDump] = []
    for asm in asms.values():
        dumps = asm.finish()
        common = summarise_ignored(asm.ignored, asm.first_ignored, "lines of a stack dump")
        if not dumps:
            if asm.ignored == 0 and not asm.errors:
                continue
            w = [f"py-spy reported: {e}" for e in asm.errors[:3]] + common
            if common and not asm.errors:
                w = [f"first line: {asm.first_ignored[1][:100]!r}"] + w
            dumps = [ProcessDump(fmt="unknown", label=asm.label, warnings=w + [NO_STACK_HINT])]
        elif common:
            dumps[0] = dumps[0].model_copy(update={"warnings": common + dumps[0].warnings})
        out.extend(dumps)
    if not out:
        out = [ProcessDump(fmt="unknown", warnings=["the input is empty: no line to read", NO_STACK_HINT])]
    dropped = sum(a.dropped_processes for a in asms.values())
    if dropped:
        out[-1] = out[-1].model_copy(update={"warnings": out[-1].warnings + [dropped_processes_warning(dropped)]})
    if shared["frames_dropped"]:
        out[-1] = out[-1].model_copy(update={"warnings": out[-1].warnings
                                             + [dropped_frames_warning(shared["frames_dropped"])]})
    if dropped_lines:
        many = f"{len(dropped_labels)}" + ("+" if len(dropped_labels) >= MAX_COUNTED_SOURCES else "")
        w = (f"{dropped_lines} line(s) of {many} more sources (line prefixes) beyond the first {MAX_SOURCES} not read "
             "(more ranks than a dump of one job plausibly holds); split the log per rank, or analyze the ranks you need")
        out[-1] = out[-1].model_copy(update={"warnings": out[-1].warnings + [w]})
    if scan_from:
        w = (f"no line of a stack dump in the first {chars >> 20} MB ({abs(scan_from) - 1} lines): from there on only "
             "lines that start a dump were looked for (py-spy, faulthandler, tracebacks, pystack, gdb, torch's "
             "watchdog" + (f"; one found at line {n_found}" if scan_from < 0 else "; none found") + ")")
        out = [d.model_copy(update={"warnings": [w] + d.warnings}) for d in out]
    if source:
        out = [d.model_copy(update={"warnings": [f"{source}: {w}" for w in d.warnings]}) for d in out]
    return out


def _looks_json(text: str) -> bool:
    s = text.lstrip()
    return s.startswith(("[{", "[\n", "[]", "{\"", "[\r\n")) or (s.startswith("[") and s[1:2].isspace())


def parse_dump(text: str, source: str = "") -> list[ProcessDump]:
    """Parse any supported dump text; one :class:`ProcessDump` per process found (at least one).

    Never raises on bad content: see each dump's ``warnings``.
    """
    if _looks_json(text):
        dumps = parse_pyspy_json(text)
        if source:
            dumps = [d.model_copy(update={"warnings": [f"{source}: {w}" for w in d.warnings]}) for d in dumps]
        return dumps
    return parse_lines(text.splitlines(), source=source)


def parse_pyspy_text(text: str, label: str = "") -> list[ProcessDump]:
    """Parse py-spy ``dump`` text (any layout); same reading as :func:`parse_dump`, ``label`` set on each dump."""
    dumps = parse_lines(text.splitlines())
    return [d.model_copy(update={"label": d.label or label}) for d in dumps]


def parse_faulthandler(text: str, label: str = "", pid: Optional[int] = None, title: str = "") -> list[ProcessDump]:
    """Parse a CPython ``faulthandler`` dump; ``pid``/``title`` fill what the text does not say. Successive dumps
    of one process (same thread ids) give the last one, with a warning; dumps of other processes come after it."""
    dumps = parse_lines(text.splitlines())
    out = []
    for d in dumps:
        upd = {"label": d.label or label}
        if d.pid is None and pid is not None and len(dumps) == 1:
            upd["pid"] = pid
        if not d.title and title and len(dumps) == 1:
            upd["title"] = title
        out.append(d.model_copy(update=upd))
    return out


def is_binary(head: bytes) -> bool:
    """Whether the first bytes of a file are binary (NUL bytes, or over 30 % non-text bytes)."""
    if not head:
        return False
    if b"\x00" in head:
        return True
    text = sum(1 for b in head if b >= 32 or b in (9, 10, 13, 27))
    if text / len(head) < 0.7:
        return True
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start < len(head) - 4 and sum(1 for b in head if b >= 0x80) / len(head) > 0.3
    return False


def _iter_text_lines(f: io.BufferedReader) -> Iterator[str]:
    wrapper = io.TextIOWrapper(f, encoding="utf-8", errors="replace", newline=None)
    while True:
        line = wrapper.readline(MAX_LINE_CHARS * 4)
        if not line:
            return
        if not line.endswith("\n"):  # an overlong line: keep its start, skip the rest of it
            rest = line
            while rest and not rest.endswith("\n"):
                rest = wrapper.readline(1 << 20)
        yield line.rstrip("\n")


def load_dump_file(path: Union[str, Path]) -> list[ProcessDump]:
    """Read and parse one dump file (any supported format), streaming it line by line.

    A binary file gives one dump with a warning and no content echoed; an empty file, one saying it is empty.

    Raises:
        FileNotFoundError / IsADirectoryError: ``path`` is not a readable file.
    """
    p = Path(path)
    with open(p, "rb") as f:
        head = f.read(65536)
        if is_binary(head):
            size = p.stat().st_size
            return [ProcessDump(fmt="unknown", warnings=[
                f"{p.name}: a binary file ({size} bytes), not a text stack dump; nothing was read from it (for a core "
                "file run 'pystack core' or gdb 'thread apply all bt' and pass their text)"])]
        if not head.strip():
            return [ProcessDump(fmt="unknown", warnings=[f"{p.name}: the file is empty; expected a stack dump"])]
        if _looks_json(head.decode("utf-8", errors="replace")):
            data = head + f.read()
            return parse_dump(data.decode("utf-8", errors="replace"), source=p.name)
        f.seek(0)
        return parse_lines(_iter_text_lines(f), source=p.name)


def detect_format(text: str) -> DumpFormat:
    """Which format ``text`` is read as: the format of its first dump with a thread, else ``unknown``."""
    for d in parse_dump(text):
        if d.threads:
            return d.fmt
    return "unknown"


def split_log_prefixes(text: str) -> list[tuple[str, str]]:
    """Split a log into per-source texts by line prefix (compose ``svc  | ``, kubectl ``[pod/x] ``, pdsh ``host: ``,
    ``[rankN]:``, torchrun's ``[default0]:``, SGLang's ``[time TP1]``, mpirun tags, ray worker prefixes), prefixes
    removed; ``[("", text)]`` when no line has one."""
    lines = text.splitlines()
    sniffed = sniff_label_prefixes(lines[:SNIFF_LINES])
    labelled = sniffed.compose or sniffed.bracket or sniffed.host
    groups: dict[str, list[str]] = {}
    current = ""
    sticky = False
    for ln in lines:
        cl = clean_line(ln, *sniffed)
        label = cl.label if cl.label else (current if (labelled or sticky) else "")
        if cl.label:
            current, sticky = cl.label, cl.sticky
        groups.setdefault(label, []).append(cl.text)
    if list(groups) == [""]:
        return [("", text)]
    return [(k, "\n".join(v)) for k, v in groups.items()]


def render_pyspy_text(threads: Iterable[ThreadStack], pid: Optional[int] = None, title: str = "") -> str:
    """Render stacks in py-spy's text layout (for reports and for dumps that arrived in another format)."""
    lines = []
    if pid is not None:
        lines.append(f"Process {pid}: {title}".rstrip())
        lines.append("")
    for t in threads:
        state = f" ({t.status})" if t.status and t.status.replace("+", "").isalpha() and " " not in t.status else (
            "" if t.active is None else (" (active)" if t.active else " (idle)"))
        name = f': "{t.name}"' if t.name else ""
        tid = f" {t.thread_id}" if t.thread_id else ""
        lines.append(f"Thread{tid}{state}{name}")
        lines.extend("    " + f.render() for f in t.frames)
    return "\n".join(lines) + "\n"


# ---- rank identity from titles and names ------------------------------------------------------------------------
_NAME_RANK_RE = re.compile(r"(?:rank|tp)[_\-]?(\d+)", re.IGNORECASE)


def rank_from_title(title: str) -> Optional[int]:
    """TP rank from a rank process's title, asking every registered engine adapter (``sglang::scheduler_TP1`` →
    1), then the data title rules (``VLLM::Worker_TP0`` → 0); None when the title names no rank."""
    from repro.readers.titles import identify_title

    info = identify_title(title)
    return info.tp if info is not None and info.role == "rank" else None


def pp_from_title(title: str) -> Optional[int]:
    """Pipeline stage from a rank title with a PP part (``sglang::scheduler_PP1_TP0`` → 1), else None."""
    from repro.readers.titles import identify_title

    info = identify_title(title)
    return info.pp if info is not None and info.role == "rank" else None


def rank_from_filename(name: str) -> Optional[int]:
    """Rank from a dump file name: ``rank3.txt``, ``rank_3.json``, ``tp3.log`` → 3; else None."""
    m = _NAME_RANK_RE.search(Path(name).name)
    return int(m.group(1)) if m else None
