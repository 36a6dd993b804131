"""HiCache CPU compatibility layer for the CPU testbed (sglang 0.5.23, torch 2.14). Written for this project.

Why it exists: sglang's hierarchical cache (HiCache) assumes a GPU. On the CPU testbed three things break (measured,
docs/sglang.md), and this layer mends exactly those, nothing else:

(a) ``sglang/srt/mem_cache/pool_host/common.py``: the host KV pool for device "cpu" is allocated by
    ``ALLOC_MEMORY_FUNCS["cpu"]`` = ``alloc_with_host_register``, which pins it with ``cudaHostRegister``
    (``torch.cuda.cudart()``). Here the "cpu" entry allocates plainly (same allocator, no registration).
    The pool is then not pinned, so its ``pin_memory`` (``pool_host/base.py`` ``HostKVCache``) reads False on a box
    without CUDA: the storage read path builds its bounce pages with ``torch.zeros(..., pin_memory=self.pin_memory)``
    (``MHATokenToKVPoolHost.get_dummy_flat_data_page``), which raised "Found no NVIDIA driver" in the io-aux thread
    for every prefetch that had storage hits, on every rank, before the backend's ``batch_get`` was called
    (measured 2026-12-06: no L3 read had ever completed on the testbed).
(b) ``sglang/srt/mem_cache/pool_host/mha.py`` imports its KV copy ops only on CUDA/HIP (``sgl_kernel.kvcacheio``)
    or XPU, so on CPU the names are undefined. Pure-torch versions of the three ops the ``direct`` io backend uses
    (:mod:`repro_testbed_compat.kvcacheio`) are bound into that module when it lacks them.
(c) ``torch.cpu.Stream`` has no ``synchronize`` (the cache controller calls it): a no-op is added (CPU work is
    synchronous).

(e) PD disaggregation over Mooncake's transfer engine: ``MooncakeKVSender.supports_host_tensor_indices`` is
    switched off, so the prefill send path does not pin memory and record a ``torch.cuda.Event`` (every prefill rank
    died at its first request without it; measured with sglang 0.5.23 and mooncake-transfer-engine-non-cuda
    0.3.13.post1 on TCP).

And it fixes one interleaving that the testbed would otherwise leave to the OS scheduler:

(d) A storage prefetch query answers only after the scheduler's batch decision of the tick that submitted it. On a
    GPU box the storage tier (Mooncake, 3FS, NFS, ...) answers in milliseconds, far later than the scheduler reaches
    its admission loop, so a new request's prefetch is still live when ``_get_new_batch_prefill_raw`` checks it. On
    the testbed the ``file`` backend over an empty temp folder answers in microseconds, so whether the prefetch
    thread (query + its MIN all_reduce + the hit queue) finishes before the scheduler drains the hit queue in the
    same tick is a race the OS decides. When the thread wins, the prefetch is revoked before the admission loop,
    the loop issues no prefetch all_reduce, and a perturbation meant to hit sglang#30760 desynchronises the model
    forward instead (seen under load; the other cause of that, ranks armed a tick apart, is fixed in
    ``repro.runner.wait_armed``). Here each ``PrefetchOperation`` records how many
    ``Scheduler.get_next_batch_to_run`` calls had returned in its process when it was created, and the controller's
    ``_storage_hit_query`` waits (``threading.Condition``, no polling) until one more has returned, at most
    ``STORAGE_QUERY_MAX_WAIT_S``. That is a legal interleaving of real sglang (a query may take any time), chosen
    on purpose: ordering, not a sleep. ``REPRO_TESTBED_STORAGE_QUERY_AFTER_PASS=0`` turns it off.

It is a property of the testbed, not a fault: it is loaded from ``repro_testbed_compat.pth`` in the testbed venv
only when ``REPRO_TESTBED_COMPAT=1`` (the adapter's testbed profile sets it with ``--enable-hierarchical-cache`` and
for a PD role, ``--disaggregation-mode prefill|decode``),
never via PYTHONPATH, and it is independent of the injector. Patches are applied lazily by a post-import hook, when
the target module is first imported; nothing is imported at interpreter start.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time
from typing import Any, Callable

SGLANG_VERSION = "0.5.23"
_INSTALLED = False
_LOCK = threading.Lock()
# What was applied in this process (module -> list of patch names), for tests and diagnosis.
APPLIED: dict[str, list[str]] = {}


def _note(module: str, what: str) -> None:
    """Record a patch and say so once on stderr (lands in the server log: evidence that the layer was active)."""
    APPLIED.setdefault(module, []).append(what)
    sys.stderr.write(f"repro testbed compat: {module}: {what}\n")


# ---- (a) plain allocation of the "cpu" host pool -------------------------------------------------------------------
def _patch_pool_host_common(mod) -> None:
    funcs = getattr(mod, "ALLOC_MEMORY_FUNCS", None)
    if funcs is None:
        return

    def alloc_plain_cpu(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
        """``alloc_with_host_register`` without the CUDA host registration (CPU testbed)."""
        return allocator.allocate(dims, dtype=dtype, device=device)

    funcs["cpu"] = alloc_plain_cpu
    _note(mod.__name__, "ALLOC_MEMORY_FUNCS['cpu']=plain")


def _patch_pool_host_base(mod) -> None:
    cls = getattr(mod, "HostKVCache", None)
    if cls is None or isinstance(cls.__dict__.get("pin_memory"), property):
        return

    def get_pin(self) -> bool:
        """What the pool was asked for, and only where pinning can work (CUDA present; CPU testbed: False)."""
        import torch

        return bool(self.__dict__.get("_repro_pin_memory", False)) and torch.cuda.is_available()

    def set_pin(self, value: Any) -> None:
        self.__dict__["_repro_pin_memory"] = bool(value)

    cls.pin_memory = property(get_pin, set_pin)
    _note(mod.__name__, "HostKVCache.pin_memory=False without CUDA")


# ---- (b) pure-torch KV copy ops for the direct io backend -------------------------------------------------------
def _patch_pool_host_mha(mod) -> None:
    from repro_testbed_compat import kvcacheio

    for name in kvcacheio.__all__:
        if name not in vars(mod):
            setattr(mod, name, getattr(kvcacheio, name))
            _note(mod.__name__, name)


# ---- (c) torch.cpu.Stream.synchronize ----------------------------------------------------------------------------
def _patch_torch(mod) -> None:
    stream = getattr(getattr(mod, "cpu", None), "Stream", None)
    if stream is not None and not hasattr(stream, "synchronize"):
        def synchronize(self) -> None:
            """No-op: CPU work is synchronous (CPU testbed)."""

        stream.synchronize = synchronize
        _note(mod.__name__, "cpu.Stream.synchronize=no-op")


# ---- (d) a storage query answers after the scheduler's batch decision of its tick --------------------------------
QUERY_AFTER_PASS_ENV = "REPRO_TESTBED_STORAGE_QUERY_AFTER_PASS"
STORAGE_QUERY_MAX_WAIT_S = 5.0  # seconds; bounds the wait when the scheduler is stuck (e.g. deadlocked)
PASS_ATTR = "_repro_created_after_pass"
_PASSES = threading.Condition()
_passes_done = 0  # Scheduler.get_next_batch_to_run calls returned (or raised) in this process


def passes_done() -> int:
    """How many ``Scheduler.get_next_batch_to_run`` calls have returned in this process (for tests)."""
    with _PASSES:
        return _passes_done


def _pass_done() -> None:
    global _passes_done
    with _PASSES:
        _passes_done += 1
        _PASSES.notify_all()


def wait_for_pass_after(created_after: int, max_wait_s: float = STORAGE_QUERY_MAX_WAIT_S) -> bool:
    """Block until more than ``created_after`` batch decisions have returned, or ``max_wait_s`` seconds passed.

    Returns:
        True when the pass happened, False on timeout.
    """
    deadline = time.monotonic() + max_wait_s
    with _PASSES:
        while _passes_done <= created_after:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            _PASSES.wait(left)
        return True


def _query_after_pass_enabled() -> bool:
    return os.environ.get(QUERY_AFTER_PASS_ENV, "1") != "0"


def _patch_scheduler(mod) -> None:
    cls = getattr(mod, "Scheduler", None)
    orig = getattr(cls, "get_next_batch_to_run", None) if cls is not None else None
    if orig is None or not _query_after_pass_enabled() or getattr(orig, "__repro_compat__", False):
        return

    def wrapper(self, *args: Any, **kwargs: Any) -> Any:  # named like a decorator: stack gates see through it
        try:
            return orig(self, *args, **kwargs)
        finally:
            _pass_done()

    wrapper.__repro_compat__ = True  # type: ignore[attr-defined]
    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    wrapper.__qualname__ = orig.__qualname__
    wrapper.__name__ = orig.__name__
    cls.get_next_batch_to_run = wrapper
    _note(mod.__name__, "Scheduler.get_next_batch_to_run counts batch decisions")


def _patch_prefetch_classes(mod) -> None:
    """Tag each PrefetchOperation with the pass count at creation; make ``_storage_hit_query`` wait for the next."""
    if not _query_after_pass_enabled():
        return
    op_cls = getattr(mod, "PrefetchOperation", None)
    init = getattr(op_cls, "__init__", None) if op_cls is not None else None
    if init is not None and not getattr(init, "__repro_compat__", False):
        def tagged_init(self, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            setattr(self, PASS_ATTR, passes_done())

        tagged_init.__repro_compat__ = True  # type: ignore[attr-defined]
        op_cls.__init__ = tagged_init
        _note(mod.__name__, "PrefetchOperation records its batch-decision count")
    for cls in list(vars(mod).values()):
        if not isinstance(cls, type) or cls.__module__ != mod.__name__:
            continue
        query = cls.__dict__.get("_storage_hit_query")
        if query is None or getattr(query, "__repro_compat__", False):
            continue

        def make(query=query):
            def wrapper(self, operation: Any, *args: Any, **kwargs: Any) -> Any:
                created = getattr(operation, PASS_ATTR, None)
                if created is not None:
                    wait_for_pass_after(created)
                return query(self, operation, *args, **kwargs)

            wrapper.__repro_compat__ = True  # type: ignore[attr-defined]
            wrapper.__wrapped__ = query  # type: ignore[attr-defined]
            return wrapper

        cls._storage_hit_query = make()
        _note(mod.__name__, f"{cls.__name__}._storage_hit_query answers after the next batch decision")


# ---- (e) Mooncake's prefill send path without CUDA host tensors (PD disaggregation) --------------------------------
def _patch_mooncake_conn(mod) -> None:
    """``MooncakeKVSender.supports_host_tensor_indices`` = False (sglang 0.5.23 ``disaggregation/mooncake/conn.py``).

    When True, the prefill server's ``_send_kv_chunk`` (``disaggregation/prefill.py``) pins the page indices in host
    memory and records a ``torch.cuda.Event``: on CPU every prefill rank dies at its first request ("Found no
    NVIDIA driver"). With False it sends the indices as plain numpy arrays, the path sglang takes for every other
    transfer backend.
    """
    cls = getattr(mod, "MooncakeKVSender", None)
    if cls is None or not getattr(cls, "supports_host_tensor_indices", False):
        return
    cls.supports_host_tensor_indices = False
    _note(mod.__name__, "MooncakeKVSender.supports_host_tensor_indices=False")


# The items of this layer by name: what a release's data file lists under ``[cpu] compat``
# (``repro/targets/sglang/releases/<V>.toml``; tests/test_release_data.py checks the names) -> the hooked module(s).
ITEMS: dict[str, tuple[str, ...]] = {
    "host_pool_plain_alloc": ("sglang.srt.mem_cache.pool_host.common", "sglang.srt.mem_cache.pool_host.base"),  # (a)
    "kvcacheio_direct_ops": ("sglang.srt.mem_cache.pool_host.mha",),                          # (b)
    "cpu_stream_synchronize": ("torch",),                                                     # (c)
    "storage_query_after_pass": ("sglang.srt.managers.scheduler", "sglang.srt.managers.cache_controller",
                                 "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller"),  # (d)
    "mooncake_no_host_tensor_indices": ("sglang.srt.disaggregation.mooncake.conn",),          # (e)
}

HOOKS: dict[str, Callable] = {
    "sglang.srt.disaggregation.mooncake.conn": _patch_mooncake_conn,
    "sglang.srt.mem_cache.pool_host.common": _patch_pool_host_common,
    "sglang.srt.mem_cache.pool_host.base": _patch_pool_host_base,
    "sglang.srt.mem_cache.pool_host.mha": _patch_pool_host_mha,
    "sglang.srt.managers.scheduler": _patch_scheduler,
    "sglang.srt.managers.cache_controller": _patch_prefetch_classes,
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller": _patch_prefetch_classes,
    "torch": _patch_torch,
}


class _PostImportLoader(importlib.abc.Loader):
    def __init__(self, loader, hook: Callable) -> None:
        self._loader = loader
        self._hook = hook

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        try:
            self._hook(module)
        except Exception as e:  # a failed patch must not break the import; say so once
            sys.stderr.write(f"repro testbed compat: patching {module.__name__} failed: {type(e).__name__}: {e}\n")

    def __getattr__(self, name):  # get_code, get_source, is_package, ... (used by tracebacks, py-spy, inspect)
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds target modules through the other finders, then wraps their loader to run the hook after exec."""

    def __init__(self) -> None:
        self._busy = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        hook = HOOKS.get(fullname)
        if hook is None or getattr(self._busy, "active", False):
            return None
        self._busy.active = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.active = False
        if spec.loader is not None:
            spec.loader = _PostImportLoader(spec.loader, hook)
        return spec


def install() -> None:
    """Register the lazy patches (idempotent). Modules already imported are patched at once."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        _INSTALLED = True
        sys.meta_path.insert(0, _PostImportFinder())
        for name, hook in HOOKS.items():
            mod = sys.modules.get(name)
            if mod is not None:
                hook(mod)
