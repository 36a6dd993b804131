"""What the collective ledger (``_ledger.py``) reads from a collective call's arguments: the process group's
position, the reduce op's, a broadcast's source rank, the tensors' shapes and dtypes, and — for a small CPU tensor
that a reduction or broadcast carries — its values.

Values (``in`` on the enter record, ``out`` on the exit record): only for ``all_reduce`` and ``broadcast`` (both
in place on their first argument), only when that tensor is on the CPU (a gloo group's ``torch.tensor(n)``), of an
integer or bool dtype (counts and flags, never activations) and holds at most :data:`VALUE_MAX_NUMEL` elements.
These are the per-rank answers an engine reconciles: sglang 0.5.23's ``_reduce_prefetch_ack`` (one int, MIN),
``HybridCacheController._sync_prefetch_hit_query`` (the hit count and one verdict per pool: 24 ints, MIN),
``UnifiedRadixCache._sync_hicache_ready_counts`` (the ready-ack and queue counts, MIN), the PD polls'
``poll_and_all_reduce`` (one uint8 per request, MIN), ``broadcast_pyobj``'s size. A device tensor is never read
(``tolist`` would synchronise the stream); a float one is the model's (the CPU testbed's activations). ``out`` is read when the
call returned, and not at all for ``async_op=True`` (the work may not be complete). For a broadcast, ``in`` on a
receiving rank is the buffer's old contents. Stdlib only; never imports ``repro``.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

SRC_OPS = ("broadcast", "broadcast_object_list")  # ops whose records carry ``src`` (global rank of the source)
VALUE_OPS = ("all_reduce", "broadcast")  # ops whose first (in-place) tensor's values are recorded when small on CPU
VALUE_MAX_NUMEL = 64  # elements: sglang 0.5.23's largest reconciled vector seen is the hit query's 24 (1 + 23 pools)


def _src(op: str, args: tuple, kwargs: dict, si: int) -> Optional[int]:
    """The global source rank of a broadcast call (``src=`` or positional), None when not given or not an int."""
    if op not in SRC_OPS:
        return None
    v = kwargs.get("src") if "src" in kwargs else (args[si] if 0 <= si < len(args) else None)
    return v if isinstance(v, int) else None


def _meta(objs: tuple) -> tuple:
    """``(shape, dtype)`` of each tensor among a call's first arguments (a list of tensors: ``((n, *shape), dtype)``),
    taken at the call: a queued record must not keep the tensors alive until it is written (on a GPU that would hold
    every layer's all-reduce input of a long forward in the caching allocator until the next tick)."""
    out = []
    for o in objs:
        shape = getattr(o, "shape", None)
        if shape is not None and hasattr(o, "dtype"):
            out.append((shape, o.dtype))
        elif isinstance(o, (list, tuple)) and o and hasattr(o[0], "shape") and hasattr(o[0], "dtype"):
            out.append(((len(o),) + tuple(o[0].shape), o[0].dtype))
    return tuple(out)


def _arg_index(fn: Callable, name: str) -> int:
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return -1
    return params.index(name) if name in params else -1


def _values(args: tuple, kwargs: dict) -> Optional[list]:
    """The values (``tolist()``) of the call's first tensor when it is on the CPU, of an integer or bool dtype, with at
    most :data:`VALUE_MAX_NUMEL` elements; None otherwise (a device tensor, a float or large one, not a tensor).
    Never raises."""
    t = args[0] if args else kwargs.get("tensor")
    try:
        if not t.is_cpu or t.dtype.is_floating_point or t.dtype.is_complex or t.numel() > VALUE_MAX_NUMEL:
            return None
        return t.tolist()
    except Exception:
        return None


def _is_async(args: tuple, kwargs: dict, ai: int) -> bool:
    """True when the call passed ``async_op=True`` (keyword or at position ``ai``)."""
    return bool(kwargs.get("async_op") if "async_op" in kwargs else (args[ai] if 0 <= ai < len(args) else False))
