"""What a frame of a captured stack is: a collective op and its communication layer, a wait for work (idle kinds), an
injector or ledger wrapper, noise or bootstrap (used by :mod:`repro.analysis`, the readers and ``repro reproduce``).

Communication layers recognised (innermost outwards): native waits (``c10d::``/``gloo::``/NCCL symbols in
``--native`` dumps), ``torch.distributed`` (``torch/distributed/*``; ``monitored_barrier`` named on its own), and the
engine's own layers from the adapter's frame rules (sglang 0.5.23: ``pynccl``/``custom_all_reduce``,
``GroupCoordinator``, ``broadcast_pyobj``). Injector frames (``sitecustomize.py``, ``usercustomize.py``,
``repro_injector``) are shown as ``[injected]`` and are never the call site.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

from repro.diagnosis import COLLECTIVE_OPS
from repro.readers.types import Frame, ThreadStack


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


def helper_kind(t: ThreadStack) -> Optional[str]:
    """What helper a thread is (``watchdog``, ``progress bar monitor``, ``signal / heartbeat``, ``I/O or callback
    thread``; rules in ``repro/data/frame_rules.toml``), or None. The main thread is never a helper."""
    if t.is_main:
        return None
    return _data_rules().helper_kind(t.name, [(f.function, f.module_or_file) for f in t.frames if not f.native])


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
