"""Stack-dump records and parsers: py-spy text (incl. ``--native``), py-spy ``--json``, Python faulthandler dumps.

Plain records only (the *types* of PyTorch flight_recorder's split): :class:`Frame`, :class:`ThreadStack`,
:class:`ProcessDump` (one parsed dump of one process) and :class:`RankCapture` (one capture of one rank, as
written by :mod:`repro.capture` and read back by :func:`load_dump_file`). Analysis lives in :mod:`repro.analysis`.

Parsing never raises on bad content: garbage lines, truncated dumps and non-Python dumps yield whatever threads
could be read plus ``warnings`` that say what was wrong and what was expected. Frames are innermost first.

Formats read (checked against py-spy 0.4.3 and CPython 3.11 ``faulthandler``):

- py-spy text: ``Process <pid>: <title>``, ``Python v<ver> (<exe>)``, ``Thread <tid> (<idle|active|gil…>):
  "<name>"``, then 4-space-indented ``<function> (<file>:<line>)`` frames; ``--native`` frames are
  ``<symbol> (<library>)`` without a line; deeper-indented ``--locals`` lines are skipped. Log prefixes such as
  docker compose's ``name  | `` or ``[pod/name] `` are stripped; several prefixed services in one log are split.
- py-spy ``--json``: a list of ``{pid, thread_id, thread_name, os_thread_id, active, owns_gil, frames: [{name,
  filename, module, short_filename, line, ...}]}``; a frame with a non-null ``module`` (a shared library) is native.
- faulthandler: ``Current thread 0x… (most recent call first):`` / ``Thread 0x… (most recent call first):`` then
  ``  File "<path>", line <n> in <co_name>``; if a file holds several dumps, the last one is used.

Process titles: engines name their rank processes (SGLang ``sglang::scheduler_TP{k}``, with ``DP{d}_``/``PP{p}_``
prefixes when used); :func:`rank_from_title` and :func:`pp_from_title` ask every registered engine adapter's title
parser (``repro.targets.registry.rank_title_any``), so dumps of any engine are read.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable, Literal, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field

DumpFormat = Literal["py-spy", "py-spy-json", "faulthandler", "unknown"]
CaptureMethod = Literal["py-spy", "faulthandler", "file"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True)


class Frame(_Frozen):
    """One stack frame.

    ``function`` is the qualified name where the dump has it (py-spy, 3.11+: ``Scheduler.event_loop_normal``) or
    the bare ``co_name`` (faulthandler: ``event_loop_normal``). ``module_or_file`` is the shortened source path
    (``torch/distributed/distributed_c10d.py``; site-packages prefix removed) or, for a native frame, the shared
    library (``libtorch_cpu.so``). ``line`` is None when unknown (native frames, faulthandler ``???``).
    """

    function: str
    module_or_file: str
    line: Optional[int] = None
    native: bool = False

    @property
    def basename(self) -> str:
        """File name without directories (``scheduler.py``)."""
        return self.module_or_file.rsplit("/", 1)[-1]

    @property
    def short_function(self) -> str:
        """Last component of the qualified name (``event_loop_normal`` for ``Scheduler.event_loop_normal``)."""
        return self.function.rsplit(".", 1)[-1]

    def render(self) -> str:
        """``function (file:line)`` as py-spy prints it."""
        loc = self.module_or_file if self.line is None else f"{self.module_or_file}:{self.line}"
        return f"{self.function} ({loc})"


class ThreadStack(_Frozen):
    """One thread's stack, innermost frame first.

    ``thread_id``: as the dump shows it (py-spy: OS thread id in decimal, or ``0x…``; faulthandler: ``0x…``).
    ``is_main``: the process's main thread (py-spy: thread id == pid or name ``MainThread``; faulthandler: the
    thread whose outermost frame is not ``threading``'s bootstrap). ``active``: py-spy's on-CPU flag, None if
    unknown.
    """

    thread_id: str
    name: str = ""
    is_main: bool = False
    frames: list[Frame] = Field(default_factory=list)
    active: Optional[bool] = None

    @property
    def python_frames(self) -> list[Frame]:
        """The frames that are not native."""
        return [f for f in self.frames if not f.native]


class ProcessDump(_Frozen):
    """One parsed dump of one process.

    ``label``: the log prefix the dump came under (compose service name) or ``""``. ``warnings``: what could not
    be read (each names what was expected). ``fmt``: which format was recognised.
    """

    pid: Optional[int] = None
    title: str = ""
    python_version: str = ""
    fmt: DumpFormat = "unknown"
    label: str = ""
    threads: list[ThreadStack] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)

    @property
    def main_thread(self) -> Optional[ThreadStack]:
        """The main thread, or None when no thread was read."""
        for t in self.threads:
            if t.is_main:
                return t
        return self.threads[0] if self.threads else None


class RankCapture(_Frozen):
    """One capture of one process of the job (normally a TP rank).

    Attributes:
        rank: global rank (TP rank for SGLang), None for non-rank processes (detokenizer, HTTP server).
        pid: process id (None when read from a file that does not say).
        label: file stem used in the evidence folder (``rank0``, ``detokenizer``).
        ok: True when stacks were read (``threads`` non-empty).
        method: ``py-spy``, ``faulthandler`` (in-process dump after a signal) or ``file`` (read from disk).
        error: why the capture failed or is partial (names the fix), else ``""``.
        notice: one-line remark for the user even on success (e.g. "py-spy refused by ptrace ... fell back to
            faulthandler"), else ``""``.
        text: the raw dump text as written to ``<label><tag>.txt``.
        threads: parsed stacks, innermost frame first.
        cpu_percent: CPU use of the process over the capture window, percent of one core (None if unknown).
        title: process title / command line.
        tool_version: ``py-spy 0.4.3``, ``faulthandler (CPython)``, or ``""``.
        native: True if native frames were captured.
        duration_s: seconds the capture of this process took.
        warnings: parser warnings.
    """

    rank: Optional[int]
    pid: Optional[int] = None
    label: str = ""
    ok: bool = False
    method: CaptureMethod = "py-spy"
    error: str = ""
    notice: str = ""
    text: str = ""
    threads: list[ThreadStack] = Field(default_factory=list)
    cpu_percent: Optional[float] = None
    title: str = ""
    tool_version: str = ""
    native: bool = False
    duration_s: Optional[float] = None
    warnings: list[str] = Field(default_factory=list)

    def to_json(self) -> str:
        """This capture as JSON."""
        return self.model_dump_json(indent=2)


# --------------------------------------------------------------------------------------------------------------
# helpers

_NAME_RANK_RE = re.compile(r"(?:rank|tp)[_\-]?(\d+)", re.IGNORECASE)
_NATIVE_FILE_RE = re.compile(r"(\.so(\.[\w.]+)?|\.dylib|\.dll|\.c|\.cc|\.cpp|\.cxx|\.h|\.hpp|\.cu)$")


def rank_from_title(title: str) -> Optional[int]:
    """TP rank from a rank process's title (``sglang::scheduler_TP1`` → 1, ``sglang::scheduler_DP0_TP1`` → 1, plain
    ``sglang::scheduler`` of a TP=1 server → 0), read by the registered engine adapters; None for other processes."""
    from repro.targets.registry import rank_title_any

    t = rank_title_any(title or "")
    return None if t is None else t.tp


def pp_from_title(title: str) -> Optional[int]:
    """Pipeline stage from a rank title with a PP part (``sglang::scheduler_PP1_TP0`` → 1), else None."""
    from repro.targets.registry import rank_title_any

    t = rank_title_any(title or "")
    return None if t is None else t.pp


def rank_from_filename(name: str) -> Optional[int]:
    """Rank from a dump file name: ``rank3.txt``, ``rank_3.json``, ``tp3.log`` → 3; else None."""
    m = _NAME_RANK_RE.search(Path(name).name)
    return int(m.group(1)) if m else None


def shorten_path(path: str) -> str:
    """Shorten a source path the way py-spy does for display.

    ``…/site-packages/torch/distributed/x.py`` → ``torch/distributed/x.py``; ``…/lib/python3.11/threading.py`` →
    ``threading.py``; other absolute paths keep their last two components.
    """
    p = path.replace("\\", "/")
    for marker in ("site-packages/", "dist-packages/"):
        if marker in p:
            return p.rsplit(marker, 1)[1]
    m = re.search(r"/lib/python\d+\.\d+t?/(.*)$", p)
    if m:
        return m.group(1)
    if p.startswith("/"):
        parts = [x for x in p.split("/") if x]
        return "/".join(parts[-2:]) if len(parts) >= 2 else p.lstrip("/")
    return p


def _is_native_file(file: str) -> bool:
    return bool(_NATIVE_FILE_RE.search(file))


def _guess_main(threads: list[ThreadStack], pid: Optional[int], current: Optional[str] = None) -> list[ThreadStack]:
    """Mark the main thread when the dump did not say which one it is."""
    if any(t.is_main for t in threads) or not threads:
        return threads
    idx: Optional[int] = None
    if pid is not None:
        for i, t in enumerate(threads):
            if t.thread_id == str(pid):
                idx = i
                break
    if idx is None:
        for i, t in enumerate(threads):
            if t.name == "MainThread":
                idx = i
                break
    if idx is None:
        candidates = []
        for i, t in enumerate(threads):
            py = t.python_frames
            if py and not (py[-1].basename == "threading.py" and py[-1].short_function.startswith("_bootstrap")):
                candidates.append(i)
        if len(candidates) == 1:
            idx = candidates[0]
        elif candidates:
            idx = next((i for i in candidates if threads[i].thread_id == current), candidates[0])
    if idx is None:
        return threads
    out = list(threads)
    out[idx] = out[idx].model_copy(update={"is_main": True})
    return out


# --------------------------------------------------------------------------------------------------------------
# log prefixes

_PREFIX_RE = re.compile(
    r"^(?:(?P<svc>[A-Za-z0-9_.\-]+)\s*\|\s?|\[(?P<br>[^\]\n]{1,120})\]\s?)"
    r"(?:\d{4}-\d\d-\d\d[T ][\d:.,]+(?:Z|[+-]\d\d:?\d\d)?\s)?"
)
_TS_RE = re.compile(r"\d{4}-\d\d-\d\d[T ][\d:.,]+(?:Z|[+-]\d\d:?\d\d)?\s*")


def split_log_prefixes(text: str) -> list[tuple[str, str]]:
    """Split a log into per-source texts by line prefix.

    Returns ``[(label, text)]``: one entry per distinct prefix (docker compose ``svc  | ``, kubectl ``[pod/x] ``,
    each optionally followed by an ISO timestamp), in order of first appearance; ``("", text)`` when no line has
    a prefix. Lines without a prefix in a prefixed log are kept with the previous line's source.
    """
    lines = text.splitlines()
    prefixed = 0
    for ln in lines:
        if ln.strip() and _PREFIX_RE.match(ln) and not ln.startswith(" "):
            prefixed += 1
    nonblank = sum(1 for ln in lines if ln.strip())
    # a py-spy dump has no prefixed lines at all; require most lines to be prefixed before stripping
    if nonblank == 0 or prefixed < max(1, nonblank // 2):
        return [("", text)]
    groups: dict[str, list[str]] = {}
    current = ""
    for ln in lines:
        m = _PREFIX_RE.match(ln) if not ln.startswith(" ") else None
        if m:
            label = m.group("svc") if m.group("svc") is not None else _TS_RE.sub("", m.group("br") or "").strip()
            current = label
            groups.setdefault(label, []).append(ln[m.end():])
        else:
            groups.setdefault(current, []).append(ln)
    return [(k, "\n".join(v)) for k, v in groups.items()]


# --------------------------------------------------------------------------------------------------------------
# py-spy text

_PROC_RE = re.compile(r"^Process (\d+): ?(.*)$")
_PYVER_RE = re.compile(r"^Python v(\S+)")
_THREAD_RE = re.compile(r"^Thread (0x[0-9A-Fa-f]+|\d+) \(([^)]*)\)(?::\s*\"(.*)\")?:?\s*$")
_FRAME_RE = re.compile(r"^( {2,})(\S.*?) \(([^()]*)\)\s*$")
_FRAME_LINE_RE = re.compile(r"^(.*):(\d+)$")


def _summarise_ignored(ignored: list[tuple[int, str]], what: str) -> list[str]:
    if not ignored:
        return []
    n, first = ignored[0]
    return [f"ignored {len(ignored)} line(s) that are not {what} (first, line {n}: {first[:100]!r})"]


def parse_pyspy_text(text: str, label: str = "") -> list[ProcessDump]:
    """Parse py-spy ``dump`` text (with or without ``--native`` / ``--locals``) into one dump per ``Process`` block.

    Returns at least one :class:`ProcessDump`; threads without frames and unreadable lines are reported in its
    ``warnings``. A text without any ``Thread`` line yields one dump with no threads and a warning saying what was
    expected (py-spy's own ``Error:`` lines are quoted).
    """
    dumps: list[dict[str, Any]] = []
    cur: Optional[dict[str, Any]] = None
    thread: Optional[dict[str, Any]] = None
    ignored: list[tuple[int, str]] = []
    errors: list[str] = []

    def new_proc(pid: Optional[int], title: str) -> dict[str, Any]:
        d = {"pid": pid, "title": title, "python_version": "", "threads": [], "warnings": []}
        dumps.append(d)
        return d

    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip("\r")
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _PROC_RE.match(line)
        if m:
            cur = new_proc(int(m.group(1)), m.group(2).strip())
            thread = None
            continue
        m = _PYVER_RE.match(line)
        if m:
            if cur is None:
                cur = new_proc(None, "")
            cur["python_version"] = m.group(1)
            continue
        m = _THREAD_RE.match(line)
        if m:
            if cur is None:
                cur = new_proc(None, "")
            status = m.group(2)
            thread = {
                "thread_id": m.group(1),
                "name": m.group(3) or "",
                "active": None if not status else ("active" in status),
                "frames": [],
            }
            cur["threads"].append(thread)
            continue
        m = _FRAME_RE.match(line)
        if m and thread is not None:
            indent = len(m.group(1))
            if indent >= 8:  # --locals block
                continue
            func, loc = m.group(2), m.group(3)
            lm = _FRAME_LINE_RE.match(loc)
            file, lineno = (lm.group(1), int(lm.group(2))) if lm else (loc, None)
            native = lineno is None and (_is_native_file(file) or func.startswith("0x")) or (
                lineno is not None and _is_native_file(file) and not file.endswith(".py")
            )
            thread["frames"].append(Frame(function=func, module_or_file=file, line=lineno, native=native))
            continue
        if line.startswith(" " * 8) and thread is not None:  # locals values
            continue
        if line.lstrip().startswith("Error") or line.lstrip().lower().startswith("error:"):
            errors.append(line.strip())
            continue
        ignored.append((n, line))

    out: list[ProcessDump] = []
    for d in dumps:
        threads = [ThreadStack(**t) for t in d["threads"]]
        warnings = list(d["warnings"])
        for t in threads:
            if not t.frames:
                warnings.append(f"thread {t.thread_id} ({t.name or 'unnamed'}) has no frames (truncated dump?)")
        if not threads:
            warnings.append("process block without any 'Thread <id> (<state>): \"<name>\"' line (truncated dump?)")
        threads = _guess_main(threads, d["pid"])
        out.append(
            ProcessDump(
                pid=d["pid"], title=d["title"], python_version=d["python_version"], fmt="py-spy", label=label,
                threads=threads, warnings=warnings,
            )
        )
    common = _summarise_ignored(ignored, "py-spy dump lines") + [f"py-spy reported: {e}" for e in errors]
    if not out:
        out.append(ProcessDump(fmt="unknown", label=label, warnings=common + [_NO_STACK_HINT]))
        return out
    if common:
        out[0] = out[0].model_copy(update={"warnings": common + out[0].warnings})
    return out


_NO_STACK_HINT = (
    "no Python stack found: expected py-spy text ('Thread <id> (idle): \"MainThread\"' followed by "
    "'    function (file.py:line)' lines), py-spy --json output, or a faulthandler dump "
    "('Thread 0x... (most recent call first):' followed by '  File \"...\", line N in f'); "
    "is this a dump of a Python process?"
)


# --------------------------------------------------------------------------------------------------------------
# py-spy --json


def parse_pyspy_json(data: Union[str, bytes, list, dict], label: str = "") -> list[ProcessDump]:
    """Parse py-spy ``dump --json`` output (a list of thread objects) into one dump per pid.

    Accepts the text or the decoded object. Malformed thread or frame entries are skipped with a warning; invalid
    JSON yields one empty dump whose warning quotes the decoder's message.
    """
    if isinstance(data, (str, bytes)):
        try:
            obj = json.loads(data)
        except ValueError as e:
            return [ProcessDump(fmt="py-spy-json", label=label,
                                warnings=[f"not valid JSON ({e}); expected py-spy --json output (a list of threads)"])]
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
        by_pid.setdefault(pid, []).append(
            ThreadStack(thread_id=str(tid), name=name, is_main=is_main, frames=frames,
                        active=t.get("active") if isinstance(t.get("active"), bool) else None)
        )
    if not by_pid:
        return [ProcessDump(fmt="py-spy-json", label=label, warnings=warnings + ["no threads in the JSON dump"])]
    out = []
    for pid, threads in by_pid.items():
        # py-spy lists threads in no fixed order: put the main thread first
        threads = _guess_main(threads, pid)
        threads.sort(key=lambda t: not t.is_main)
        out.append(ProcessDump(pid=pid, fmt="py-spy-json", label=label, threads=threads, warnings=list(warnings)))
    return out


# --------------------------------------------------------------------------------------------------------------
# faulthandler

_FH_THREAD_RE = re.compile(
    r"^(Current thread|Thread) (0x[0-9A-Fa-f]+)(?: \[([^\]]*)\]| \"([^\"]*)\")? \(most recent call first\):\s*$"
)
_FH_STACK_RE = re.compile(r"^Stack \(most recent call first\):\s*$")
_FH_FRAME_RE = re.compile(r"^\s+File \"(.*)\", line (\d+|\?\?\?) in (.+?)\s*$")


def parse_faulthandler(text: str, label: str = "", pid: Optional[int] = None, title: str = "") -> list[ProcessDump]:
    """Parse a CPython ``faulthandler`` dump (``dump_traceback(all_threads=True)`` / ``register``).

    Function names are bare ``co_name`` (no class); paths are shortened like py-spy's. When the text holds
    several dumps (the signal was sent more than once), the last one is used and a warning says so. A leading
    ``Process <pid>: <title>`` line (written by :mod:`repro.capture`) supplies pid and title.
    """
    dumps: list[list[dict[str, Any]]] = [[]]
    seen: set[str] = set()
    thread: Optional[dict[str, Any]] = None
    current: Optional[str] = None
    ignored: list[tuple[int, str]] = []
    truncated = False
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip("\r")
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _PROC_RE.match(line)
        if m:
            pid, title = int(m.group(1)), m.group(2).strip()
            continue
        m = _FH_THREAD_RE.match(line)
        if m or _FH_STACK_RE.match(line):
            tid = m.group(2) if m else "0x0"
            if tid in seen:  # a second dump starts
                dumps.append([])
                seen = set()
            seen.add(tid)
            thread = {"thread_id": tid, "name": (m.group(3) or m.group(4) or "") if m else "", "frames": []}
            if m and m.group(1) == "Current thread":
                current = tid
            dumps[-1].append(thread)
            continue
        m = _FH_FRAME_RE.match(line)
        if m and thread is not None:
            lineno = None if m.group(2) == "???" else int(m.group(2))
            thread["frames"].append(Frame(function=m.group(3), module_or_file=shorten_path(m.group(1)), line=lineno))
            continue
        if line.strip() == "..." and thread is not None:
            truncated = True
            continue
        if line.strip() in ("<no Python frame>", "<tstate is freed>"):
            continue
        if thread is not None and line.startswith("Current thread's C stack"):
            thread = None  # 3.14 C stack section: not parsed
            continue
        if thread is None and line.startswith("  "):
            continue
        ignored.append((n, line))
    warnings = _summarise_ignored(ignored, "faulthandler dump lines")
    if len(dumps) > 1:
        warnings.append(f"the file holds {len(dumps)} faulthandler dumps; used the last one")
    if truncated:
        warnings.append("faulthandler truncated a stack ('...'): outer frames are missing")
    last = dumps[-1]
    threads = [ThreadStack(thread_id=t["thread_id"], name=t["name"], frames=t["frames"]) for t in last]
    for t in threads:
        if not t.frames:
            warnings.append(f"thread {t.thread_id} has no Python frames")
    if not threads:
        warnings.append(_NO_STACK_HINT)
    threads = _guess_main(threads, None, current)
    threads.sort(key=lambda t: not t.is_main)
    return [ProcessDump(pid=pid, title=title, fmt="faulthandler", label=label, threads=threads, warnings=warnings)]


# --------------------------------------------------------------------------------------------------------------
# auto-detection


def detect_format(text: str) -> DumpFormat:
    """Which dump format ``text`` is: ``py-spy-json``, ``faulthandler``, ``py-spy`` or ``unknown``."""
    s = text.lstrip()
    if s.startswith("[") or s.startswith("{"):
        try:
            json.loads(s)
            return "py-spy-json"
        except ValueError:
            if s.startswith("[\n") or s.startswith("[{") or s.startswith("{\""):
                return "py-spy-json"
    if re.search(r"^(Current thread|Thread) 0x[0-9A-Fa-f]+.*\(most recent call first\):", text, re.M) or \
            re.search(r"^Stack \(most recent call first\):", text, re.M):
        return "faulthandler"
    if re.search(r"^Thread (0x[0-9A-Fa-f]+|\d+) \(", text, re.M) or re.search(r"^Process \d+:", text, re.M):
        return "py-spy"
    return "unknown"


def parse_dump(text: str, source: str = "") -> list[ProcessDump]:
    """Parse any supported dump text; returns one :class:`ProcessDump` per process found (at least one).

    Log prefixes are stripped first (each prefixed source parsed on its own). ``source`` (a file name) is only
    used in warnings. Never raises on bad content: see each dump's ``warnings``.
    """
    out: list[ProcessDump] = []
    for label, part in split_log_prefixes(text):
        fmt = detect_format(part)
        if fmt == "py-spy-json":
            dumps = parse_pyspy_json(part, label=label)
        elif fmt == "faulthandler":
            dumps = parse_faulthandler(part, label=label)
        elif fmt == "py-spy":
            dumps = parse_pyspy_text(part, label=label)
        else:
            errs = [ln.strip() for ln in part.splitlines() if ln.strip().lower().startswith("error")]
            w = [f"py-spy reported: {e}" for e in errs[:3]]
            first = next((ln for ln in part.splitlines() if ln.strip()), "")
            if first and not errs:
                w.append(f"first line: {first[:100]!r}")
            dumps = [ProcessDump(fmt="unknown", label=label, warnings=w + [_NO_STACK_HINT])]
        out.extend(dumps)
    if source:
        out = [d.model_copy(update={"warnings": [f"{source}: {w}" for w in d.warnings]}) for d in out]
    return out


def load_dump_file(path: Union[str, Path]) -> list[ProcessDump]:
    """Read and parse one dump file (any supported format). Unreadable bytes are replaced, never raised on.

    Raises:
        FileNotFoundError / IsADirectoryError: ``path`` is not a readable file.
    """
    p = Path(path)
    text = p.read_bytes().decode("utf-8", errors="replace")
    return parse_dump(text, source=p.name)


def render_pyspy_text(threads: Iterable[ThreadStack], pid: Optional[int] = None, title: str = "") -> str:
    """Render stacks in py-spy's text layout (for reports and for dumps that arrived as JSON only)."""
    lines = []
    if pid is not None:
        lines.append(f"Process {pid}: {title}".rstrip())
        lines.append("")
    for t in threads:
        state = "" if t.active is None else (" (active)" if t.active else " (idle)")
        name = f': "{t.name}"' if t.name else ""
        lines.append(f"Thread {t.thread_id}{state}{name}")
        lines.extend("    " + f.render() for f in t.frames)
    return "\n".join(lines) + "\n"
