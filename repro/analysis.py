"""Per-rank state from captured stacks, ranks grouped by where they are blocked, and the odd rank(s) out.

Words (docs/pipeline.md): a rank is in a **collective** when the innermost frames of its main thread (or of another
thread holding a collective while the main thread waits) are communication-layer frames; **idle-wait** when they
are a wait for work (zmq poll/recv, select, queue get, condition/event wait, thread join, pipe recv); **busy**
otherwise (on CPU, or sleeping in an injected delay, or anywhere else). Being in a collective is not a hang by
itself: idle SGLang ranks sit in ``broadcast_pyobj`` → ``dist.broadcast`` (sglang 0.5.23
``managers/scheduler_components/request_receiver.py`` ``_broadcast_reqs_across_ranks``). Two ranks in the same op
from the same call site agree; the ranks **diverge** when, with no rank busy, at least one is in a collective and
they are not all blocked at the same place (different op, different call site, or collective vs idle-wait).

Communication layers recognised (innermost outwards): native waits (``c10d::``/``gloo::``/NCCL symbols in
``--native`` dumps), ``torch.distributed`` (``torch/distributed/*``; ``monitored_barrier`` named on its own),
sglang's ``pynccl``/``custom_all_reduce`` device communicators (``distributed/device_communicators/*``),
``GroupCoordinator`` (``distributed/parallel_state.py``, ``distributed/communication_op.py``) and
``broadcast_pyobj`` (``utils/common.py`` in 0.5.23). Injector frames (``sitecustomize.py``, ``usercustomize.py``,
``repro_injector``) are shown as ``[injected]`` and are never the call site. Process groups are not visible in
stacks: ``process_group`` stays None here (the ledger fills it).

Frames are compared by function name (last component, so faulthandler's bare ``co_name`` matches py-spy's
qualified name), file base name and line.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Literal, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field

from repro.diagnosis import COLLECTIVE_OPS, describe_where, md_cell
from repro.evidence import Layout
from repro.stacks import (
    Frame,
    ProcessDump,
    RankCapture,
    ThreadStack,
    load_dump_file,
    pp_from_title,
    rank_from_filename,
    rank_from_title,
    render_pyspy_text,
)

RankStateName = Literal["collective", "idle-wait", "busy", "unknown"]

# the one op list lives in repro.diagnosis (COLLECTIVES); re-exported here for callers
_NATIVE_OP_HINTS = (
    ("allreduce", "all_reduce"), ("all_reduce", "all_reduce"), ("broadcast", "broadcast"),
    ("allgather", "all_gather"), ("all_gather", "all_gather"), ("reducescatter", "reduce_scatter"),
    ("reduce_scatter", "reduce_scatter"), ("barrier", "barrier"), ("alltoall", "all_to_all"),
    ("send", "send"), ("recv", "recv"),
)
_NATIVE_COMM_RE = re.compile(r"c10d::|gloo::|ProcessGroup|nccl|Nccl|NCCL")
_NOISE_FUNCS = frozenset({"wrapper", "decorate_context", "_call_impl", "_wrapped_call_impl", "wrapped", "inner",
                          "decorator", "_fn", "fn"})
_BOOTSTRAP_FUNCS = frozenset({"_bootstrap", "_bootstrap_inner", "run", "spawn_main", "_main", "<module>"})
_BOOTSTRAP_FILES = frozenset({"process.py", "spawn.py", "threading.py", "<string>", "runpy.py"})


def _norm_op(name: str) -> str:
    n = name.rsplit(".", 1)[-1].lstrip("_")
    for suffix in ("_in_place", "_out_place", "_base"):
        if n.endswith(suffix) and n[: -len(suffix)] in COLLECTIVE_OPS:
            return n[: -len(suffix)]
    return n


_LEDGER_FRAME_RE = re.compile(r"repro_(?:ledger|tick)\[")
_INJECTED_SITE_RE = re.compile(r"repro_injected\[([^\]]+)\]")


def is_ledger_frame(f: Frame) -> bool:
    """A recording wrapper of the injector's collective ledger (``repro_ledger[...]``, ``repro_tick[...]``):
    transparent, never a call site and not an injection."""
    return not f.native and bool(_LEDGER_FRAME_RE.search(f.function))


def is_injector_frame(f: Frame) -> bool:
    """A frame of the repro injector (``sitecustomize.py``/``usercustomize.py`` entry files, ``repro_injector``),
    except the ledger's recording wrappers."""
    return not f.native and (
        f.basename in ("sitecustomize.py", "usercustomize.py") or "repro_injector" in f.module_or_file
    ) and not is_ledger_frame(f)


def injected_site(frames: Sequence[Frame]) -> Optional[str]:
    """The patched site named by an injector wrapper frame (``repro_injected[Scheduler.run_batch]`` →
    ``Scheduler.run_batch``), innermost first; None without one."""
    for f in frames:
        if not f.native:
            m = _INJECTED_SITE_RE.search(f.function)
            if m:
                return m.group(1)
    return None


def _frame_rules():
    """The engines' frame rules (every registered adapter's, merged: dumps of any engine are read)."""
    from repro.targets.registry import combined_frame_rules

    return combined_frame_rules()


def _rule_layer(rules, f: Frame, path: str) -> Optional[str]:
    for r in rules:
        if r.matches(path, f.basename, f.function, f.short_function):
            return r.layer
    return None


# torch.distributed modules that are not communication: the launcher and its elastic agent (a launcher's own
# traceback is not a rank blocked in a collective)
_TORCH_NOT_COMM = ("torch/distributed/elastic/", "torch/distributed/launcher/", "torch/distributed/run.py")


def comm_layer(f: Frame) -> Optional[str]:
    """The communication layer a frame belongs to, or None.

    Returns ``native-wait``, ``native`` (other native frames: transparent), ``monitored_barrier``,
    ``torch.distributed``, or a layer of an engine's frame rules (``repro.targets.base.FrameRules``: SGLang's
    ``broadcast_pyobj`` / ``point_to_point_pyobj`` before torch.distributed, ``pynccl``, ``custom_all_reduce``,
    ``device_communicator``, ``GroupCoordinator`` after it).
    """
    if f.native:
        hit = _NATIVE_COMM_RE.search(f.function) or _data_rules().native_backend(f.function)
        return "native-wait" if hit else "native"
    if is_ledger_frame(f):
        return "native"  # transparent like a native frame
    path = f.module_or_file.replace("\\", "/")
    if _data_rules().idle_kind(f.function, path) is not None:
        return None  # a wait for work inside a communication package (vLLM's MessageQueue.dequeue)
    rules = _frame_rules()
    layer = _rule_layer(rules.object_comm, f, path)
    if layer is not None:
        return layer
    short = f.short_function
    if ("torch/distributed/" in path and not any(x in path for x in _TORCH_NOT_COMM)) or \
            path.startswith("distributed/distributed_c10d") or f.basename in ("distributed_c10d.py", "c10d_logger.py"):
        return "monitored_barrier" if short == "monitored_barrier" else "torch.distributed"
    layer = _rule_layer(rules.comm_layers, f, path)
    if layer is None:  # engines without an adapter yet (vLLM, DeepSpeed, accelerate): repro/data/frame_rules.toml
        hit = _data_rules().collective_layer(f.function, path)
        layer = hit.layer if hit is not None else None
    if layer is None and f.module_or_file in ("", "?") and _norm_op(f.function) in COLLECTIVE_OPS - {"wait"}:
        layer = "named op"  # a hand-written frame list gives the bare op name, no file
    return layer


def _data_rules():
    from repro.readers import rules

    return rules


_IDLE_RULES: tuple[tuple[str, Optional[str], str], ...] = (
    # (path substring or basename, function short name or None = any, wait kind)
    ("zmq/", None, "zmq poll/recv"),
    ("selectors.py", None, "select"),
    ("asyncio/base_events.py", "_run_once", "select"),
    ("queue.py", "get", "queue get"),
    ("multiprocessing/queues.py", "get", "queue get"),
    ("multiprocessing/connection.py", None, "pipe wait"),
    ("threading.py", "wait", "condition wait"),
    ("threading.py", "_wait_for_tstate_lock", "thread join"),
    ("threading.py", "join", "thread join"),
    ("threading.py", "acquire", "lock wait"),
    ("concurrent/futures/_base.py", None, "future wait"),
    ("concurrent/futures/thread.py", "_worker", "executor idle"),
)  # engines add theirs in their FrameRules.idle_waits (repro/targets/)


def idle_kind(f: Frame) -> Optional[str]:
    """The kind of idle wait a (Python) frame is, or None: ``zmq poll/recv``, ``select``, ``queue get``, …"""
    if f.native:
        return None
    path = f.module_or_file.replace("\\", "/")
    for where, func, kind in _IDLE_RULES + _frame_rules().idle_waits:
        if (where in path or f.basename == where) and (func is None or f.short_function == func):
            return kind
    return _data_rules().idle_kind(f.function, path)


def _is_noise(f: Frame) -> bool:
    return f.short_function in _NOISE_FUNCS or f.function.endswith(".<locals>.wrapper") or is_ledger_frame(f)


def _is_bootstrap(f: Frame) -> bool:
    return f.basename in _BOOTSTRAP_FILES and (f.short_function in _BOOTSTRAP_FUNCS or f.function.startswith("BaseProcess."))


def _label(f: Frame) -> str:
    return f"[injected] {f.function}" if is_injector_frame(f) else f.function


# lines of inputs / missing ranks `input_lines` lists before one summary line (the rest stay in analysis.json)
MAX_LISTED_LINES = 20

class ThreadReading(BaseModel):
    """What one thread's stack says (internal to the analysis, exposed for tests)."""

    model_config = ConfigDict(frozen=True)

    state: RankStateName
    op: Optional[str] = None
    via: Optional[str] = None
    layers: list[str] = Field(default_factory=list)
    wait: Optional[str] = None
    blocked_frame: Optional[Frame] = None
    innermost: Optional[Frame] = None
    caller_chain: list[str] = Field(default_factory=list)
    injected: bool = False
    injected_site: Optional[str] = None


def read_thread(t: ThreadStack, max_chain: int = 8) -> ThreadReading:
    """Classify one thread: collective (op, via, layers), idle-wait (kind) or busy; find the call site.

    The call site (``blocked_frame``) is the first Python frame outside the communication / waiting layers and the
    injector, skipping decorator wrappers; ``caller_chain`` is it and its callers (function names, decorator and
    bootstrap frames left out, injector frames marked ``[injected]``), at most ``max_chain`` entries.
    """
    frames = t.frames
    if not frames:
        return ThreadReading(state="unknown")
    i = 0
    layers: list[str] = []
    native_ops: list[str] = []
    while i < len(frames) and frames[i].native:
        lay = comm_layer(frames[i])
        if lay == "native-wait":
            if "native-wait" not in layers:
                layers.append("native-wait")
            low = frames[i].function.lower()
            for hint, op in _NATIVE_OP_HINTS:
                if hint in low:
                    native_ops.append(op)
                    break
            else:
                nop = _data_rules().native_op(frames[i].function)
                if nop:
                    native_ops.append(nop)
        i += 1
    if i >= len(frames):
        if not layers and (t.active is False or any(_data_rules().is_native_idle(f.function) for f in frames[:3])):
            return ThreadReading(state="idle-wait", wait="native wait", innermost=frames[0])
        return ThreadReading(state="collective" if layers else "busy", op=native_ops[0] if native_ops else None,
                             via="native-wait" if layers else None, layers=layers, innermost=frames[0])
    # torch's op dispatch (``torch.ops._C.shm_allreduce(...)`` → ``OpOverloadPacket.__call__``) right inside a
    # communication layer is part of that layer (vLLM's CPU shm ops); anywhere else it is the caller's own work
    k = i
    while k < len(frames) and (frames[k].native or is_op_dispatch_frame(frames[k])):
        k += 1
    if k > i and k < len(frames) and comm_layer(frames[k]) not in (None, "native"):
        i = k
    innermost = frames[i]
    # collective: contiguous comm-layer frames from the innermost Python frame outwards
    j = i
    op: Optional[str] = None
    comm_frames: list[Frame] = []
    while j < len(frames):
        f = frames[j]
        lay = comm_layer(f)
        if lay == "native":
            j += 1
            continue
        if lay is None:
            break
        comm_frames.append(f)
        if lay not in layers:
            layers.append(lay)
        if op is None and _norm_op(f.function) in COLLECTIVE_OPS:
            op = _norm_op(f.function)
        elif op is None and _data_rules().op_alias(f.function):
            op = _data_rules().op_alias(f.function)
        j += 1
    if comm_frames or layers:
        if op is None:
            op = native_ops[0] if native_ops else (_norm_op(comm_frames[0].function) if comm_frames else "wait")
        outer_first = list(reversed(layers))
        via = outer_first[0]  # the outermost communication wrapper
        site_idx, chain, injected = _call_site(frames, j, max_chain)
        return ThreadReading(state="collective", op=op, via=via, layers=outer_first, innermost=innermost,
                             blocked_frame=frames[site_idx] if site_idx is not None else None,
                             caller_chain=chain, injected=injected,
                             injected_site=injected_site(frames[j:site_idx]) if injected and site_idx else None)
    kind = idle_kind(innermost)
    if kind is not None:
        j = i
        while j < len(frames) and (frames[j].native or idle_kind(frames[j]) is not None):
            kind = idle_kind(frames[j]) or kind  # the outermost wait names it (Queue.get over Condition.wait)
            j += 1
        site_idx, chain, injected = _call_site(frames, j, max_chain)
        return ThreadReading(state="idle-wait", wait=kind, innermost=innermost,
                             blocked_frame=frames[site_idx] if site_idx is not None else None,
                             caller_chain=chain, injected=injected)
    site_idx, chain, injected = _call_site(frames, i, max_chain, skip_injector=False)
    if t.active is False and not is_injector_frame(innermost):
        return ThreadReading(state="idle-wait", wait="off CPU (py-spy: idle)", innermost=innermost,
                             blocked_frame=innermost, caller_chain=chain, injected=injected)
    return ThreadReading(state="busy", innermost=innermost,
                         blocked_frame=frames[site_idx] if site_idx is not None else innermost,
                         caller_chain=chain, injected=injected or is_injector_frame(innermost))


def _call_site(frames: list[Frame], start: int, max_chain: int, skip_injector: bool = True):
    injected = False
    site: Optional[int] = None
    k = start
    while k < len(frames):
        f = frames[k]
        if f.native or _is_noise(f) or (skip_injector and is_injector_frame(f)):
            # a patched site's wrapper (``repro_injected[...]``) that passed the call through to the engine's own
            # function is not an injection: only an action frame of the injector (``Site.run`` …) issued the op
            injected = injected or (is_injector_frame(f) and not _INJECTED_SITE_RE.search(f.function))
            k += 1
            continue
        site = k
        break
    chain: list[str] = []
    in_injector = False
    for f in frames[start:]:
        if len(chain) >= max_chain:
            break
        if f.native or _is_bootstrap(f):
            continue
        if is_injector_frame(f):
            if not in_injector:  # a run of injector frames is shown once, by its innermost frame
                chain.append(_label(f))
            else:
                m = _INJECTED_SITE_RE.search(f.function)
                if m and chain:  # the run's wrapper names the patched site: show that instead
                    chain[-1] = f"[injected] at {m.group(1)}"
            in_injector = True
            continue
        in_injector = False
        if _is_noise(f):
            continue
        chain.append(f.function)
    return site, chain, injected


# --------------------------------------------------------------------------------------------------------------
# records


class RankState(BaseModel):
    """Where one rank is blocked.

    Attributes:
        rank: global rank; pid: its process.
        state: ``collective`` / ``idle-wait`` / ``busy`` / ``unknown`` (no readable stack: see ``error``).
        op: collective op (``all_reduce``, ``broadcast``…), innermost op-named frame; None unless collective.
        via: outermost communication wrapper: ``broadcast_pyobj``, ``GroupCoordinator``, ``pynccl``,
            ``custom_all_reduce``, ``monitored_barrier``, ``torch.distributed`` or ``native-wait``.
        layers: all communication layers seen, outermost first.
        wait: idle-wait kind (``zmq poll/recv``, ``queue get``…) when idle-wait.
        blocked_frame: ``function (file:line)`` of the call site: the first frame outside communication/wait
            layers and the injector (for busy: the innermost frame's caller outside decorators).
        caller_chain: the call site and its callers (function names), innermost first.
        thread: name (or id) of the thread the state was read from; ``main_thread``: whether it is the main one.
        injected: an injector frame sits between the op and the call site.
        injected_site: the patched site whose injected action issued the collective (from the wrapper frame
            ``repro_injected[<site>]``), when known.
        process_group: always None from stacks (py-spy shows no process groups; the ledger fills it).
        cpu_percent: CPU use during capture (percent of one core), when known.
        error: why the state is unknown (or a note on a busy thread beside a collective).
        notes: what the reading says in words (``the main thread is not in this dump``, successive dumps kept the
            last, Python frames absent, the torch timeout seen).
        other_collectives: threads besides the deciding one that wait in a collective (``thread prefetch: all_gather``).
        backend / group_kind: the backend (gloo / NCCL / MPI) and group kind (CPU / device) the frames or the
            text show, else None.
        fmt / source / rank_source: the format read, the file (and block) it came from, how the rank was known.
        spin_wait: the innermost frames are a known spin-wait (an engine's ``FrameRules.spin_waits``: vLLM's CPU
            shm ops, NCCL's proxy loop): hot on the CPU while it waits for a peer (``repro.verdict.judge_stall``).
    """

    model_config = ConfigDict(frozen=True)

    rank: int
    pid: Optional[int] = None
    state: RankStateName
    op: Optional[str] = None
    via: Optional[str] = None
    layers: list[str] = Field(default_factory=list)
    wait: Optional[str] = None
    blocked_frame: Optional[str] = None
    caller_chain: list[str] = Field(default_factory=list)
    thread: str = ""
    main_thread: bool = True
    injected: bool = False
    injected_site: Optional[str] = None
    process_group: Optional[str] = None
    cpu_percent: Optional[float] = None
    error: str = ""
    location_key: str = ""
    notes: list[str] = Field(default_factory=list)
    other_collectives: list[str] = Field(default_factory=list)
    backend: Optional[str] = None
    group_kind: Optional[str] = None
    fmt: str = ""
    source: str = ""
    rank_source: str = ""
    spin_wait: bool = False

    def where(self) -> str:
        """Short human description: ``all_reduce via GroupCoordinator ← VocabParallelEmbedding.forward ← …``
        (``repro.diagnosis.describe_where``, the one formatter every report uses)."""
        return describe_where(self.state, op=self.op, via=self.via, wait=self.wait, blocked_frame=self.blocked_frame,
                              caller_chain=self.caller_chain, injected_site=self.injected_site, error=self.error)


class RankGroup(BaseModel):
    """Ranks blocked at the same place (same state, op and call site)."""

    model_config = ConfigDict(frozen=True)

    ranks: list[int]
    state: RankStateName
    op: Optional[str] = None
    via: Optional[str] = None
    wait: Optional[str] = None
    call_site: Optional[str] = None
    where: str = ""


class Analysis(BaseModel):
    """The diagnosis of one capture of every rank.

    Attributes:
        ranks: one :class:`RankState` per rank, in rank order.
        groups: ranks grouped by where they are blocked (largest group first; unknown ranks not grouped).
        odd_ranks: ranks outside the unique largest group when the ranks diverge; empty on an even split or
            when not diverged.
        even_split: the two (or more) largest groups have the same size (TP=2 is always 1 against 1).
        diverged: no rank busy, at least one rank in a collective, and the known ranks are not all at one place
            (SGLang's idle tick -- some ranks in the idle sleep, the others in the request broadcast -- excepted).
        reason: ``different collective`` / ``same collective, different call sites`` / ``collective vs idle-wait``
            / ``all in the same collective`` / ``some rank busy`` / … (one phrase).
        busy_ranks / unknown_ranks: ranks in those states.
        summary: one sentence for people.
        warnings: parser/capture warnings worth showing.
        inputs: every process read, kept or skipped: ``{file, block, format, pid, title, kept, rank, reason}``.
        formats: format read → number of processes read in it.
        missing: what the dumps lack, in words (``2 of 8 ranks present (missing: 2-7)``, ``rank 1 has no main
            thread``).
        confidence: ``high`` / ``medium`` / ``low``; ``confidence_reasons``: why not higher.
    """

    model_config = ConfigDict(frozen=True)

    ranks: list[RankState]
    groups: list[RankGroup] = Field(default_factory=list)
    odd_ranks: list[int] = Field(default_factory=list)
    even_split: bool = False
    diverged: bool = False
    reason: str = ""
    busy_ranks: list[int] = Field(default_factory=list)
    unknown_ranks: list[int] = Field(default_factory=list)
    summary: str = ""
    warnings: list[str] = Field(default_factory=list)
    inputs: list[dict] = Field(default_factory=list)
    formats: dict[str, int] = Field(default_factory=dict)
    missing: list[str] = Field(default_factory=list)
    confidence: str = ""
    confidence_reasons: list[str] = Field(default_factory=list)

    def input_lines(self) -> list[str]:
        """What was read and how sure the conclusion is, in words (one line each): formats read, every process
        kept or skipped with its reason, what is missing, the confidence and why."""
        from repro.readers.types import FORMAT_NAMES

        out: list[str] = []
        if self.formats:
            out.append("read as: " + ", ".join(f"{FORMAT_NAMES.get(k, k)} ({n} process{'es' if n != 1 else ''})"
                                               for k, n in self.formats.items()))
        for k, i in enumerate(self.inputs):
            if k == MAX_LISTED_LINES:
                out.append(f"… and {len(self.inputs) - k} more inputs (each one is in {Layout.ANALYSIS.name} / --json)")
                break
            where = i.get("file", "") + (f", block {i['block']}" if i.get("block") else "")
            who = f"pid {i['pid']} " if i.get("pid") is not None else ""
            title = f"{i['title'][:60]!r} " if i.get("title") else ""
            if i.get("kept"):
                out.append(f"kept {where}: {who}{title}as rank {i.get('rank')} ({i.get('reason', '')})")
            else:
                out.append(f"skipped {where}: {who}{title}({i.get('reason', '')})")
        out += [f"missing: {m}" for m in self.missing[:MAX_LISTED_LINES]]
        if len(self.missing) > MAX_LISTED_LINES:
            out.append(f"missing: … and {len(self.missing) - MAX_LISTED_LINES} more (each one is in {Layout.ANALYSIS.name} / --json)")
        if self.confidence:
            out.append(f"confidence: {self.confidence}" + (f" ({'; '.join(self.confidence_reasons)})"
                                                           if self.confidence_reasons else ""))
        return out

    def unreadable(self, where: str) -> Optional[str]:
        """One line for input of which no rank's stack could be read (binary, empty, junk files), naming what was
        found and what is expected; None when at least one rank's stack was read. ``where``: the paths, in words.
        ``repro analyze`` and ``repro reproduce`` refuse such input with this same line (exit 2)."""
        if not self.ranks or len(self.unknown_ranks) != len(self.ranks):
            return None
        reasons = [w for w in self.warnings if "binary file" in w or "no Python stack found" in w
                   or "lines that start a dump were looked for" in w or "the file is empty" in w
                   or "the input is empty" in w]
        return (f"no rank's stack could be read from {where}: "
                + ("; ".join(dict.fromkeys(reasons)) if reasons else
                   "expected py-spy text or --json, faulthandler, pystack, gdb bt or a pasted frame list"))

    def to_json(self) -> str:
        """The analysis as a JSON text (what ``analysis.json`` holds)."""
        return self.model_dump_json(indent=2)

    def to_dict(self) -> dict:
        """The analysis as plain JSON-able data (for writers that encode JSON themselves)."""
        return self.model_dump(mode="json")

    def to_markdown(self, captures: Sequence[RankCapture] = ()) -> str:
        """GitHub-flavoured markdown for an issue comment: summary, per-rank table, raw stacks in ``<details>``."""
        out = [f"**Diagnosis:** {self.summary}", ""]
        out.append("| rank | state | blocked in | via | call site | caller chain |")
        out.append("|---|---|---|---|---|---|")
        for r in self.ranks:
            blocked = r.op or r.wait or ("" if r.state != "unknown" else r.error)
            chain = " ← ".join(f"`{c}`" for c in r.caller_chain[:6])
            site = f"`{r.blocked_frame}`" if r.blocked_frame else ""
            thread = "" if r.main_thread or not r.thread else f" (thread {r.thread})"
            out.append(f"| {r.rank} | {r.state}{thread} | {_md(blocked)} | {_md(r.via or '')} | {site} | {chain} |")
        if self.warnings:
            out += ["", "Warnings:", ""] + [f"- {_md(w)}" for w in self.warnings]
        for c in captures:
            if c.text:
                out += ["", f"<details><summary>rank {c.rank} stacks ({c.method}, pid {c.pid})</summary>", "",
                        "```", c.text.rstrip(), "```", "", "</details>"]
        return "\n".join(out) + "\n"


_md = md_cell  # the one markdown escape (repro.diagnosis)


# --------------------------------------------------------------------------------------------------------------
# analysis


def helper_kind(t: ThreadStack) -> Optional[str]:
    """What helper a thread is (``watchdog``, ``progress bar monitor``, ``signal / heartbeat``, ``I/O or callback
    thread``; rules in ``repro/data/frame_rules.toml``), or None. The main thread is never a helper."""
    if t.is_main:
        return None
    return _data_rules().helper_kind(t.name, [(f.function, f.module_or_file) for f in t.frames if not f.native])


def select_thread(threads: Sequence[ThreadStack]) -> tuple[Optional[ThreadStack], Optional[ThreadReading], str]:
    """Pick the thread that decides a rank's state and read it; every thread is considered.

    Helper threads (:func:`helper_kind`) never stand for the rank. In order: the main thread when it is in a
    collective; else a non-helper thread that is busy (py-spy saw it on CPU, or the main thread with no flag)
    — the rank may still progress — with a note naming any thread held in a collective; else a thread in a
    collective (a background thread's collective counts, and is named); else the main thread's own state. When the
    dump has no main thread, the first non-helper thread stands in, with a note; with only helper threads the
    result is ``(None, None, note)``.
    Returns ``(thread, reading, note)``.
    """
    if not threads:
        return None, None, ""
    readings = [(t, read_thread(t)) for t in threads]
    main = next(((t, r) for t, r in readings if t.is_main), None)
    own = [(t, r) for t, r in readings if helper_kind(t) is None]
    colls = [(t, r) for t, r in own if r.state == "collective"]
    if main is not None and main[1].state == "collective":
        return main[0], main[1], ""
    busy = [(t, r) for t, r in own if r.state == "busy" and (t.active is True or (t.active is None and t.is_main))]
    if busy:
        t, r = main if main is not None and main in busy else busy[0]
        note = ""
        if colls:
            ct, cr = colls[0]
            who = "the main thread" if t.is_main else f"thread {t.name or t.thread_id}"
            note = f"thread {ct.name or ct.thread_id} is in {cr.op}, but {who} is busy"
        return t, r, note
    if colls:
        return colls[0][0], colls[0][1], ""
    if main is not None:
        return main[0], main[1], ""
    rest = [(t, r) for t, r in own if r.state != "unknown"]
    if rest:
        t, r = rest[0]
        return t, r, f"the main thread is not in this dump; read thread {t.name or t.thread_id or '(no id)'}"
    helpers = sorted({helper_kind(t) or "" for t in threads} - {""})
    return None, None, ("the main thread is not in this dump; only helper threads ("
                        + ", ".join(helpers) + ") were captured, and they never stand for the rank")


def _location_key(r: ThreadReading) -> str:
    f = r.blocked_frame
    site = f"{f.short_function}@{f.basename}:{f.line}" if f else "?"
    if r.state == "collective":
        return f"collective|{r.op}|{site}"
    if r.state == "idle-wait":
        return f"idle-wait|{r.wait}|{site}"
    if r.state == "busy":
        inner = r.innermost
        return f"busy|{inner.short_function}@{inner.basename}:{inner.line}" if inner else "busy|?"
    return "unknown"


def native_collective(threads: Sequence[ThreadStack]) -> tuple[Optional[str], Optional[str], Optional[str]]:
    """``(backend, op, group kind)`` named by the native frames of any thread (gdb, ``--native``, pystack
    ``--native``): ``gloo::…::allreduce`` → ``("gloo", "all_reduce", "CPU")``; Nones where nothing says."""
    rules = _data_rules()
    backend = op = kind = None
    for t in threads:
        for f in t.frames:
            if not f.native:
                continue
            hit = rules.native_backend(f.function)
            if hit is None:
                continue
            if hit.backend and backend is None:
                backend, kind = hit.backend, hit.group_kind
            if op is None:
                nop = rules.native_op(f.function)
                if nop and not (nop in ("send", "recv") and "wait" in f.function.lower()):
                    op = nop
    return backend, op, kind


def _python_layer_kind(threads: Sequence[ThreadStack]) -> tuple[Optional[str], Optional[str]]:
    rules = _data_rules()
    for t in threads:
        for f in t.python_frames:
            hit = rules.collective_layer(f.function, f.module_or_file)
            if hit is not None and (hit.group_kind or hit.backend):
                return hit.backend, hit.group_kind
    return None, None


def is_op_dispatch_frame(f: Frame) -> bool:
    """torch's Python op dispatch frame (``OpOverloadPacket.__call__`` / ``OpOverload.__call__`` in torch/_ops.py),
    through which ``torch.ops.<ns>.<op>(...)`` calls a C++ op."""
    return not f.native and f.module_or_file.replace("\\", "/").endswith("torch/_ops.py") \
        and f.function.startswith(("OpOverloadPacket.", "OpOverload."))


def is_spin_wait(t: ThreadStack) -> bool:
    """True when the thread's innermost frames are a known spin-wait (``FrameRules.spin_waits`` of the registered
    engines): native frames up to the innermost Python frame, and that frame (ledger wrappers are transparent)."""
    rules = _frame_rules().spin_waits
    if not rules:
        return False
    for f in t.frames:
        if is_ledger_frame(f) or is_op_dispatch_frame(f):
            continue
        path = f.module_or_file.replace("\\", "/")
        if any(r.matches(path, f.basename, f.function, f.short_function) for r in rules):
            return True
        if not f.native:
            return False
    return False


def rank_state(c: RankCapture) -> RankState:
    """The :class:`RankState` of one capture (``unknown`` with the capture's error when no stack was read)."""
    rank = c.rank if c.rank is not None else -1
    info = dict(fmt=c.fmt, source=c.source, rank_source=c.rank_source, cpu_percent=c.cpu_percent, pid=c.pid)
    notes = list(c.notes)
    if not c.threads:
        err = c.error or ("; ".join(c.warnings[:2]) if c.warnings else "no stack captured")
        return RankState(rank=rank, state="unknown", error=err, location_key="unknown", notes=notes, **info)
    if not any(t.is_main for t in c.threads):
        notes.append("the main thread is not in this dump")
    t, r, note = select_thread(c.threads)
    if t is None or r is None:
        return RankState(rank=rank, state="unknown", error=note, location_key="unknown", notes=notes, **info)
    if note and note.startswith("the main thread is not in this dump"):
        notes = [n for n in notes if n != "the main thread is not in this dump"] + [note]
        note = ""
    backend, nop, kind = native_collective(c.threads)
    pb, pk = _python_layer_kind(c.threads)
    backend, kind = c.backend or backend or pb, c.group_kind or kind or pk
    op = r.op
    if r.state == "collective" and op in (None, "wait") and (c.op or nop):
        op = c.op or nop
    others = []
    for ot in c.threads:
        if ot is t or helper_kind(ot) is not None:
            continue
        orr = read_thread(ot)
        if orr.state == "collective":
            others.append(f"thread {ot.name or ot.thread_id}: {orr.op}")
    if r.state == "unknown":
        return RankState(rank=rank, state="unknown", error="the main thread has no frames",
                         thread=t.name or t.thread_id, location_key="unknown", notes=notes, **info)
    key = _location_key(r)
    if op != r.op and key.startswith("collective|"):
        key = key.replace(f"collective|{r.op}|", f"collective|{op}|", 1)
    return RankState(
        rank=rank, state=r.state, op=op, via=r.via, layers=r.layers, wait=r.wait,
        blocked_frame=r.blocked_frame.render() if r.blocked_frame else None, caller_chain=r.caller_chain,
        thread=t.name or t.thread_id, main_thread=t.is_main, injected=r.injected, injected_site=r.injected_site,
        error=note, location_key=key, notes=notes, other_collectives=others, backend=backend,
        group_kind=kind, spin_wait=r.state == "collective" and is_spin_wait(t), **info,
    )


def _ranks_text(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ",".join(str(r) for r in ranks)


def _is_are(ranks: Sequence[int]) -> str:
    return "is" if len(ranks) == 1 else "are"


def analyze(captures: Sequence[RankCapture]) -> Analysis:
    """Diagnose one capture of every rank.

    Args:
        captures: one :class:`RankCapture` per rank (any order; ``rank`` None entries are ignored).
    Returns:
        An :class:`Analysis`: per-rank states, groups by blocking location, odd rank(s) out, ``diverged`` and a
        one-sentence ``summary``.
    """
    caps = sorted((c for c in captures if c.rank is not None), key=lambda c: c.rank)  # type: ignore[arg-type]
    states = [rank_state(c) for c in caps]
    warnings = [w for c in caps for w in c.warnings]
    warnings += [f"rank {c.rank}: {c.notice}" for c in caps if c.notice]
    by_key: "OrderedDict[str, list[RankState]]" = OrderedDict()
    for s in states:
        if s.state != "unknown":
            by_key.setdefault(s.location_key, []).append(s)
    groups = [
        RankGroup(ranks=[s.rank for s in members], state=members[0].state, op=members[0].op, via=members[0].via,
                  wait=members[0].wait, call_site=members[0].blocked_frame, where=members[0].where())
        for members in by_key.values()
    ]
    groups.sort(key=lambda g: (-len(g.ranks), g.ranks[0]))
    busy = [s.rank for s in states if s.state == "busy"]
    unknown = [s.rank for s in states if s.state == "unknown"]
    judged = [g for g in groups if g.state != "busy"]
    in_coll = any(g.state == "collective" for g in judged)
    handshake = _idle_handshake(states, judged)
    diverged = bool(in_coll and len(judged) > 1 and not busy and not handshake)
    odd: list[int] = []
    even = False
    if diverged:
        top = len(judged[0].ranks)
        if len(judged[1].ranks) == top:
            even = True
        else:
            odd = sorted(r for g in judged[1:] for r in g.ranks)
    if handshake and not busy:
        reason = "idle: waiting for the next request"
        summary = _handshake_summary(states, unknown)
    else:
        reason = _reason(judged, busy, unknown, in_coll)
        summary = _summary(states, judged, busy, unknown, diverged, odd, even, reason)
    inputs, formats, missing, conf, why = _honesty(caps, states)
    return Analysis(ranks=states, groups=groups, odd_ranks=odd, even_split=even, diverged=diverged, reason=reason,
                    busy_ranks=busy, unknown_ranks=unknown, summary=summary, warnings=warnings, inputs=inputs,
                    formats=formats, missing=missing, confidence=conf, confidence_reasons=why)


_HAND_WRITTEN = frozenset({"condensed", "arrow-chain"})


def _honesty(caps: Sequence[RankCapture], states: Sequence[RankState]):
    """What was read, what is missing and how sure the conclusion is (see :class:`Analysis`)."""
    inputs: list[dict] = []
    for c in caps:
        inputs += [dict(i) for i in c.inputs]
    for c in caps:
        if c.source:
            inputs.append({"file": c.source, "block": 0, "format": c.fmt, "pid": c.pid, "title": c.title,
                           "kept": True, "rank": c.rank, "reason": c.rank_source or "rank given"})
    formats: dict[str, int] = {}
    for c in caps:
        if c.fmt:
            formats[c.fmt] = formats.get(c.fmt, 0) + 1
    missing: list[str] = []
    ranks = sorted(s.rank for s in states)
    why: list[str] = []
    if ranks and ranks[-1] + 1 > len(ranks):
        gone = sorted(set(range(ranks[-1] + 1)) - set(ranks))
        shown = ",".join(str(r) for r in gone[:32]) + (f",… ({len(gone)} in all)" if len(gone) > 32 else "")
        missing.append(f"{len(ranks)} of at least {ranks[-1] + 1} ranks present (missing: {shown})")
        why.append("some ranks are missing")
    for s in states:
        if s.state == "unknown":
            missing.append(f"rank {s.rank}: no readable stack ({s.error[:120]})" if s.error else
                           f"rank {s.rank}: no readable stack")
        elif any(n.startswith("the main thread is not in this dump") for n in s.notes):
            missing.append(f"rank {s.rank} has no main thread in its dump")
        if any("Python frames are absent" in n for n in s.notes):
            missing.append(f"rank {s.rank}: Python frames absent (native frames only)")
        if any(n.startswith("no stack in the watchdog's text") for n in s.notes):
            missing.append(f"rank {s.rank}: no stack (read from torch's watchdog message)")
    if len(states) == 1:
        why.append("only one rank: nothing to compare")
    if any(s.state == "unknown" for s in states):
        why.append("some ranks unreadable")
    if any(c.rank_source == "file order" for c in caps):
        why.append("some ranks numbered in file order (no rank in titles, prefixes or file names)")
    if any(c.fmt in _HAND_WRITTEN for c in caps):
        why.append("hand-written frame lists (no thread states, possibly abridged)")
    if any(any("Python frames are absent" in n for n in s.notes) for s in states):
        why.append("native frames only")
    if any(m.endswith("(read from torch's watchdog message)") for m in missing):
        why.append("a rank read from a watchdog message, not from a stack")
    if any(s.state != "unknown" and not s.main_thread for s in states) or \
            any(m.endswith("has no main thread in its dump") for m in missing):
        why.append("a rank's state was read from a thread other than the main one")
    low = len(states) <= 1 or any(s.state == "unknown" for s in states) or (ranks and ranks[-1] + 1 > 2 * len(ranks))
    conf = "low" if low else ("medium" if why else "high")
    return inputs, formats, missing, conf, why


# An engine's idle tick (its FrameRules: request_broadcast_*, idle_loop_callers; SGLang's in repro/targets/sglang/adapter.py):
# the ranks that already passed their idle sleep wait in the request broadcast for the rank still sleeping.


def _chain_has(s: RankState, names: frozenset) -> bool:
    return any(c.rsplit(".", 1)[-1] in names for c in s.caller_chain)


def _idle_handshake(states: list[RankState], judged: list[RankGroup]) -> bool:
    """Some ranks idle-sleep in the scheduler's idle path while the others wait in the request broadcast.

    With ``--sleep-on-idle`` (IdleSleeper: zmq poll with a 1 s timeout) an idle SGLang server is captured like
    this most of the time: it is the idle shape, not a divergence (seen on the CPU testbed, sglang 0.5.23).
    """
    if len(judged) < 2:
        return False
    known = [s for s in states if s.state in ("collective", "idle-wait")]
    coll = [s for s in known if s.state == "collective"]
    idle = [s for s in known if s.state == "idle-wait"]
    if not coll or not idle:
        return False
    rules = _frame_rules()
    return all(s.op == "broadcast" and s.via in rules.request_broadcast_layers
               and _chain_has(s, rules.request_broadcast_callers)
               for s in coll) and all(_chain_has(s, rules.idle_loop_callers) for s in idle)


def _handshake_summary(states: list[RankState], unknown: list[int]) -> str:
    idle = [s.rank for s in states if s.state == "idle-wait"]
    coll = [s.rank for s in states if s.state == "collective"]
    tail = f" (no readable stack from {_ranks_text(unknown)})" if unknown else ""
    callers = _frame_rules().request_broadcast_callers
    first = next((st for st in states if st.state == "collective"), None)
    caller = next((c.rsplit(".", 1)[-1] for c in (first.caller_chain if first else ()) if c.rsplit(".", 1)[-1] in callers), "")
    how = f" ({first.via} ← {caller})" if first is not None and first.via and caller else ""
    return (f"Not diverged: {_ranks_text(idle)} {_is_are(idle)} idle-sleeping in the scheduler's idle path while "
            f"{_ranks_text(coll)} {_is_are(coll)} in the request broadcast{how} "
            f"waiting for the next tick — an idle server, not a hang{tail}.")


def _reason(judged: list[RankGroup], busy: list[int], unknown: list[int], in_coll: bool) -> str:
    if busy:
        return "some rank busy"
    if not judged:
        return "no readable stack"
    if len(judged) == 1:
        g = judged[0]
        return ("all in the same collective from the same call site" if g.state == "collective"
                else "all idle-waiting at the same place")
    if not in_coll:
        return "idle-waiting at different places, no rank in a collective"
    colls = [g for g in judged if g.state == "collective"]
    if len(colls) < len(judged):
        return "collective vs idle-wait"
    if len({g.op for g in colls}) > 1:
        return "different collective"
    return "same collective, different call sites"


def _group_text(g: RankGroup) -> str:
    return f"{_ranks_text(g.ranks)} {_is_are(g.ranks)} " + (
        f"in {g.where}" if g.state == "collective" else g.where if g.state != "idle-wait" else g.where
    )


def _summary(states: list[RankState], judged: list[RankGroup], busy: list[int], unknown: list[int],
             diverged: bool, odd: list[int], even: bool, reason: str) -> str:
    tail = f" (no readable stack from {_ranks_text(unknown)})" if unknown else ""
    if not states:
        return "no rank captured."
    if not judged and busy:
        return f"{_ranks_text(busy)} {_is_are(busy)} busy: no rank is blocked{tail}."
    if not judged:
        return f"no readable stack from any rank{tail}."
    if len(states) == 1:
        s = states[0]
        return (f"Only rank {s.rank} was captured: one rank cannot diverge from itself; capture every rank of the "
                f"TP group to compare (rank {s.rank}: {s.where()}).")
    if busy:
        bs = [s for s in states if s.state == "busy"]
        b = "; ".join(f"rank {s.rank} busy in {s.blocked_frame}" for s in bs[:3])
        return (f"Not diverged yet: {b} (a busy rank may still reach the collective), while "
                + "; ".join(_group_text(g) for g in judged) + tail + ".")
    if len(judged) == 1:
        g = judged[0]
        if g.state == "collective":
            return (f"Not diverged: all {len(g.ranks)} ranks wait in {g.where} — the same collective from the "
                    f"same call site (idle ranks look like this; not a hang by itself){tail}.")
        return f"Not diverged: all {len(g.ranks)} ranks {g.where}{tail}."
    if not diverged:
        return "Not diverged: " + "; ".join(_group_text(g) for g in judged) + f" ({reason}){tail}."
    if even:
        sides = "; ".join(_group_text(g) for g in judged)
        n = " against ".join(str(len(g.ranks)) for g in judged)
        return f"DIVERGED ({reason}, a {n} split): {sides}{tail}."
    major = judged[0]
    minor = [g for g in judged[1:]]
    return (f"DIVERGED ({reason}): " + "; ".join(_group_text(g) for g in minor)
            + f", while {_group_text(major)}; odd {'rank' if len(odd) == 1 else 'ranks'} out: "
            + ",".join(str(r) for r in odd) + f"{tail}.")


def frames_unchanged(first: Sequence[RankCapture], second: Sequence[RankCapture]) -> bool:
    """True when every rank of ``first`` was captured in ``second`` with the same deciding stack.

    Per rank, the thread that decides the state (:func:`select_thread`) must have the same Python frames
    (function, file base name, line) in both captures; background threads are not compared. A rank missing or
    without stacks in either capture makes the answer False.
    """
    return not changed_ranks(first, second)


def changed_ranks(first: Sequence[RankCapture], second: Sequence[RankCapture]) -> list[int]:
    """Ranks whose deciding stack differs between two captures (or that are missing / unreadable in either)."""
    b = {c.rank: c for c in second}
    changed = []
    for a in first:
        if a.rank is None:
            continue
        c = b.get(a.rank)
        if c is None or not a.threads or not c.threads:
            changed.append(a.rank)
            continue
        ta, _, _ = select_thread(a.threads)
        tc, _, _ = select_thread(c.threads)
        if ta is None or tc is None or _sig(ta) != _sig(tc):
            changed.append(a.rank)
    if not first:
        return [-1]
    return changed


def _sig(t: ThreadStack) -> list[tuple[str, str, Optional[int]]]:
    return [(f.short_function, f.basename, f.line) for f in t.python_frames]


# --------------------------------------------------------------------------------------------------------------
# files


class AnalyzeInputError(ValueError):
    """A path given to :func:`analyze_paths` cannot be used; the message says what was expected."""


_DUMP_EXTS = (".txt", ".json", ".log", ".dump", ".out")


def _collect_files(paths: Iterable[Union[str, Path]], tag: Optional[str]) -> list[Path]:
    files: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise AnalyzeInputError(f"{p}: no such file or folder; expected an evidence folder, a stacks/ folder, "
                                    "or dump files (py-spy text/--json or faulthandler), one per rank")
        if p.is_file():
            files.append(p)
            continue
        if not p.is_dir():
            raise AnalyzeInputError(f"{p}: not a regular file or folder (a FIFO, socket or device); save the dump "
                                    "to a file first and pass that file")
        folder = p / Layout.STACKS.name if (p / Layout.STACKS.name).is_dir() else p
        cands = sorted(f for f in folder.iterdir() if f.is_file() and f.suffix in _DUMP_EXTS
                       and not f.name.startswith(("capture", "analysis", "verdict")))
        if (folder / Layout.STACKS.name).exists() or folder.name == Layout.STACKS.name or any(f.name.startswith("rank") for f in cands):
            rank_files = [f for f in cands if re.match(r"rank\d+", f.name)]
            if rank_files:
                tags = sorted({re.sub(r"^rank\d+", "", f.stem) for f in rank_files})
                if tag is not None:
                    want = tag
                elif "" in tags:
                    want = ""
                else:  # several tagged captures (repro run writes -1, -1b, -2, ...): the newest decided
                    newest = max(rank_files, key=lambda f: (f.stat().st_mtime, f.name))
                    want = re.sub(r"^rank\d+", "", newest.stem)
                if want not in tags:
                    raise AnalyzeInputError(f"{folder}: no capture with tag {want!r}; found tags {tags}")
                cands = [f for f in rank_files if re.sub(r"^rank\d+", "", f.stem) == want]
        if not cands:
            raise AnalyzeInputError(f"{folder}: no dump files (*.txt, *.json, *.log) found; expected rank<k>.txt "
                                    "files or an evidence folder with stacks/")
        files.extend(cands)
    return files


def is_engine_title(title: str) -> bool:
    """A process of a known engine that is not a rank (``sglang::detokenizer``): asked of the adapter registry."""
    from repro.targets.registry import is_engine_title as known

    return known(title)


def _title_examples() -> str:
    from repro.targets.registry import all_adapters

    ex = [a.watch_defaults.title_example for a in all_adapters().values()]
    return " or ".join(e for e in ex if e) or "a rank title"


MAX_RANKS = 1024  # ranks one analysis reads (the readers' per-file bound, repro.readers.assemble.MAX_PROCESSES)
MAX_RAW_TEXT_CHARS = 256 * 1024  # raw dump text kept per rank for reports; longer dumps are re-rendered


def _src(f: Path, d: ProcessDump, multi: bool) -> str:
    return f"{f.name}, block {d.block}" if multi and d.block else f.name


def load_captures(paths: Iterable[Union[str, Path]], tag: Optional[str] = None) -> list[RankCapture]:
    """Read dump files/folders (any format :mod:`repro.readers` reads) into one :class:`RankCapture` per rank.

    Every process read is kept as a rank or skipped, with its reason. The rank comes from, in order: the process
    title (every registered adapter's parser, then the data title rules: ``sglang::scheduler_TP1``,
    ``VLLM::Worker_TP0_EP0``; with a PP part ``pp * tp_size + tp``), a rank the text states (``[rank3]:``, an
    mpirun tag, a ``rank 3:`` heading, a watchdog message), the log prefix's name, the file name (``rank<k>``,
    ``tp<k>``) when the file holds one process, else the file order (said so). Skipped: titles that name a
    process that is not a rank (``sglang::detokenizer``, ``VLLM::EngineCore``, ``ray::IDLE``, launchers), a
    process without a title whose frames show a launcher (torchrun's elastic agent), and —
    when other processes carry rank titles — processes whose title names no rank (the HTTP server). When a rank
    has several dumps (``.json`` and ``.txt``) the JSON stacks are used and the text supplies title and raw text.

    Raises:
        AnalyzeInputError: a path does not exist or a folder holds no dump file.
    """
    from repro.readers.rules import not_rank_by_frames
    from repro.readers.titles import identify_title

    files = _collect_files(paths, tag)
    entries: list[tuple[Path, ProcessDump]] = []
    per_file: dict[Path, int] = {}
    for f in files:
        for d in load_dump_file(f):
            entries.append((f, d))
            per_file[f] = per_file.get(f, 0) + 1
    infos = [identify_title(d.title) if d.title else None for _, d in entries]
    ranked = [i for i in infos if i is not None and i.role == "rank" and i.tp is not None]
    pp_any = any(i.pp is not None for i in ranked)
    tp_size = 1 + max((i.tp or 0) for i in ranked) if ranked else 1
    per_rank: "OrderedDict[int, list[tuple[Path, ProcessDump, str]]]" = OrderedDict()
    unranked: list[tuple[Path, ProcessDump]] = []
    skipped: list[str] = []
    skipped_inputs: list[dict] = []

    def skip(f: Path, d: ProcessDump, reason: str) -> None:
        multi = per_file[f] > 1
        skipped.append(f"{_src(f, d, multi)}: skipped pid {d.pid} {d.title[:60]!r} ({reason})")
        skipped_inputs.append({"file": _src(f, d, multi), "block": 0, "format": d.fmt, "pid": d.pid,
                               "title": d.title, "kept": False, "rank": None, "reason": reason})

    for (f, d), info in zip(entries, infos):
        multi = per_file[f] > 1
        if info is not None and info.role == "not-rank":
            skip(f, d, info.reason)
            continue
        if multi and not d.threads and d.fmt == "unknown":
            continue  # a part of a file with nothing readable: its warnings stay in the file's other dumps
        if info is None and d.threads:
            by_frames = not_rank_by_frames([(fr.function, fr.module_or_file) for t in d.threads
                                            for fr in t.python_frames])
            if by_frames:
                skip(f, d, by_frames)
                continue
        r: Optional[int] = None
        how = ""
        if info is not None and info.tp is not None:
            r = (info.pp or 0) * tp_size + info.tp if pp_any else info.tp
            how = info.reason
        if r is None and d.rank_hint is not None:
            r, how = d.rank_hint, d.rank_hint_source
        if r is None and d.label:
            r = rank_from_filename(d.label)
            how = f"log prefix {d.label!r}" if r is not None else ""
        if r is None and not multi:
            r = rank_from_filename(f.name)
            how = f"file name {f.name!r}" if r is not None else ""
        if r is None and ranked and info is None and d.title:
            skip(f, d, f"its title names no rank while other processes' titles do (such as {_title_examples()})")
            continue
        if r is None and info is not None and info.reason and not how:
            how = info.reason
        if r is None:
            unranked.append((f, d, how))
        else:
            per_rank.setdefault(r, []).append((f, d, how))
    next_rank = 0
    if len(per_rank) + len(unranked) > MAX_RANKS:
        # more ranks than one job's dumps plausibly hold (issue 29 item 1): the lowest-numbered ones are analysed,
        # then those numbered in file order; the rest are counted in one warning, never listed one by one
        ranked_keep = sorted(per_rank)[:MAX_RANKS]
        cut = len(per_rank) - len(ranked_keep) + max(0, len(unranked) - (MAX_RANKS - len(ranked_keep)))
        per_rank = OrderedDict((r, per_rank[r]) for r in ranked_keep)
        unranked = unranked[:MAX_RANKS - len(ranked_keep)]
        skipped.append(f"{cut} more ranks beyond the first {MAX_RANKS} not read (more than the world size one job's "
                       "dumps plausibly hold); analyze the ranks you need, or split the input per job")
    for f, d, how in unranked:
        while next_rank in per_rank:
            next_rank += 1
        multi = per_file[f] > 1
        w = (f"{_src(f, d, multi)}: no rank in the process title, prefixes or file name; numbered rank {next_rank} "
             "in file order (name files rank<k>.txt, or keep the [rankN] prefixes, to say)")
        per_rank[next_rank] = [(f, d.model_copy(update={"warnings": d.warnings + [w]}),
                                "file order" + (f"; {how}" if how else ""))]
    caps: list[RankCapture] = []
    for r in sorted(per_rank):
        items = per_rank[r]
        withthreads = [x for x in items if x[1].threads]
        best = next((x for x in withthreads if x[1].fmt == "py-spy-json"), withthreads[0] if withthreads else items[0])
        f, d, how = best
        title = next((x[1].title for x in items if x[1].title), d.title)
        pid = next((x[1].pid for x in items if x[1].pid is not None), None)
        non_json = [x for x in items if x[1].fmt != "py-spy-json"]
        raw = ""
        if non_json and per_file[non_json[0][0]] == 1 and non_json[0][0].stat().st_size <= MAX_RAW_TEXT_CHARS:
            raw = non_json[0][0].read_bytes().decode("utf-8", errors="replace")  # the file as given
        if not raw:
            raw = render_pyspy_text(d.threads, pid, title)
        warnings = [w for x in items for w in x[1].warnings]
        if len(items) > 1:
            warnings.append(f"rank {r}: {len(items)} dumps found ({', '.join(_src(x[0], x[1], per_file[x[0]] > 1) for x in items)}); "
                            f"used {_src(f, d, per_file[f] > 1)}")
        method = "faulthandler" if d.fmt == "faulthandler" else "file"
        how = "file order" if how.startswith("file order") else (how or "rank given")
        caps.append(RankCapture(rank=r, pid=pid, label=Layout.stack_label(r), ok=bool(d.threads), method=method,
                                error="" if d.threads else "; ".join(d.warnings) or "no stack in the dump",
                                text=raw, threads=d.threads, title=title, warnings=warnings, fmt=d.fmt,
                                source=_src(f, d, per_file[f] > 1), rank_source=how, notes=list(d.notes),
                                backend=d.backend, op=d.op, group_kind=d.group_kind))
    if skipped and caps:
        caps[0] = caps[0].model_copy(update={"warnings": skipped + caps[0].warnings, "inputs": skipped_inputs})
    return caps


def analyze_paths(paths: Iterable[Union[str, Path]], tag: Optional[str] = None) -> Analysis:
    """Analyse dumps on disk: an evidence folder (its ``stacks/``), a stacks folder, or loose dump files.

    Args:
        paths: folders and/or files; one file per rank, or files holding several processes' dumps.
        tag: which capture of an evidence folder (file suffix after ``rank<k>``, e.g. ``-1b``); default the
            untagged one if present, else the newest (the confirming capture of ``repro run``).
    Raises:
        AnalyzeInputError: a path does not exist or holds no dump (message says what was expected).
    """
    return analyze(load_captures(paths, tag))
