"""Plain records of parsed stack dumps (the *types* of PyTorch flight_recorder's types / builder / utils split).

:class:`Frame`, :class:`ThreadStack`, :class:`ProcessDump` (one parsed dump of one process, with the reader that
read it) and :class:`RankCapture` (one capture of one rank, as written by :mod:`repro.capture` and read back by
:func:`repro.readers.load_dump_file`). Frames are innermost first. Nothing here parses or judges.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

DumpFormat = Literal[
    "py-spy", "py-spy-json", "faulthandler", "pystack", "gdb", "traceback", "flight-recorder", "condensed",
    "arrow-chain", "ray-stack", "unknown",
]
CaptureMethod = Literal["py-spy", "faulthandler", "file"]

#: What each format name means, for messages (``read as py-spy text``).
FORMAT_NAMES: dict[str, str] = {
    "py-spy": "py-spy text",
    "py-spy-json": "py-spy --json",
    "faulthandler": "faulthandler dump",
    "pystack": "pystack",
    "gdb": "gdb backtrace",
    "traceback": "Python traceback (torch timeout error)",
    "flight-recorder": "torch watchdog / Flight Recorder text",
    "condensed": "condensed frame list",
    "arrow-chain": "arrow chain",
    "ray-stack": "ray stack (py-spy per process)",
    "unknown": "unknown",
}


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

    ``thread_id``: as the dump shows it (py-spy: OS thread id in decimal, or ``0x…``; faulthandler: ``0x…``;
    ``""`` when the dump shows none, e.g. ``Thread (idle) "MainThread"`` or a pasted frame list).
    ``is_main``: the process's main thread (py-spy: thread id == pid or name ``MainThread``; faulthandler: the
    thread whose outermost frame is not ``threading``'s bootstrap). ``active``: py-spy's on-CPU flag, None if
    unknown. ``gil``: py-spy's ``+gil`` flag (holds the GIL), None if unknown. ``status``: the raw status text
    (``active+gil``, ``idle``). ``dropped_frames``: outer frames beyond the reader's per-thread bound (not kept).
    """

    thread_id: str
    name: str = ""
    is_main: bool = False
    frames: list[Frame] = Field(default_factory=list)
    active: Optional[bool] = None
    gil: Optional[bool] = None
    status: str = ""
    dropped_frames: int = 0

    @property
    def python_frames(self) -> list[Frame]:
        """The frames that are not native."""
        return [f for f in self.frames if not f.native]


class ProcessDump(_Frozen):
    """One parsed dump of one process.

    ``label``: the log prefix the dump came under (compose service name, ``rank3`` for a ``[rank3]:`` prefix) or
    ``""``. ``warnings``: what could not be read (each names what was expected). ``fmt``: which format was
    recognised. ``notes``: facts about the reading worth saying (``kept the last of 2 successive dumps``, ``Python
    frames absent``). ``rank_hint`` / ``rank_hint_source``: a rank the text itself states (``[rank3]:`` prefix,
    ``[1,3]<stderr>:`` mpirun tag, a ``rank 3:`` heading, ``Rank 3`` in a watchdog message), else None / ``""``.
    ``block``: 1-based position of this dump among the dumps of its file (file order). ``backend`` / ``op`` /
    ``group_kind``: what a native or watchdog text names (``gloo``/``NCCL``/``MPI``; ``all_reduce``; ``CPU`` or
    ``device``) when the stacks alone cannot, else None. ``first_line``: line number where the dump starts.
    """

    pid: Optional[int] = None
    title: str = ""
    python_version: str = ""
    fmt: DumpFormat = "unknown"
    label: str = ""
    threads: list[ThreadStack] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    rank_hint: Optional[int] = None
    rank_hint_source: str = ""
    block: int = 0
    first_line: int = 0
    backend: Optional[str] = None
    op: Optional[str] = None
    group_kind: Optional[str] = None

    @property
    def has_main_thread(self) -> bool:
        """Whether the dump shows the process's main thread (not a guess from the first thread)."""
        return any(t.is_main for t in self.threads)

    @property
    def main_thread(self) -> Optional[ThreadStack]:
        """The main thread; the first thread when none is known to be main (see :attr:`has_main_thread`); None
        when no thread was read."""
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
        fmt: the format the dump was read as (``py-spy``, ``gdb``…; ``""`` for a live capture).
        source: where it was read from (``rank0.txt``, ``all.txt, block 3``), ``""`` for a live capture.
        rank_source: how the rank was known (``title 'sglang::scheduler_TP1'``, ``file name``, ``file order``).
        notes: facts about the reading (successive dumps collapsed, Python frames absent, …).
        backend / op / group_kind: what a native or watchdog text names beyond the stacks (see ProcessDump).
        inputs: processes read from the same files but not kept as a rank, each ``{file, block, format, pid,
            title, kept: False, reason}`` (set on the first capture by ``repro.analysis.load_captures``).
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
    fmt: str = ""
    source: str = ""
    rank_source: str = ""
    notes: list[str] = Field(default_factory=list)
    backend: Optional[str] = None
    op: Optional[str] = None
    group_kind: Optional[str] = None
    inputs: list[dict] = Field(default_factory=list)

    def to_json(self) -> str:
        """This capture as JSON."""
        return self.model_dump_json(indent=2)


