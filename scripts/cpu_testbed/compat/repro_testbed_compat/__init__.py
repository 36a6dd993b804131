"""HiCache CPU compatibility layer for the CPU testbed (sglang 0.5.23, torch 2.14). Written for this project.

Why it exists: sglang's hierarchical cache (HiCache) assumes a GPU. On the CPU testbed three things break (measured,
issue 6 / DESIGN §8), and this layer mends exactly those, nothing else:

(a) ``sglang/srt/mem_cache/pool_host/common.py``: the host KV pool for device "cpu" is allocated by
    ``ALLOC_MEMORY_FUNCS["cpu"]`` = ``alloc_with_host_register``, which pins it with ``cudaHostRegister``
    (``torch.cuda.cudart()``). Here the "cpu" entry allocates plainly (same allocator, no registration).
(b) ``sglang/srt/mem_cache/pool_host/mha.py`` imports its KV copy ops only on CUDA/HIP (``sgl_kernel.kvcacheio``)
    or XPU, so on CPU the names are undefined. Pure-torch versions of the three ops the ``direct`` io backend uses
    (:mod:`repro_testbed_compat.kvcacheio`) are bound into that module when it lacks them.
(c) ``torch.cpu.Stream`` has no ``synchronize`` (the cache controller calls it): a no-op is added (CPU work is
    synchronous).

It is a property of the testbed, not a fault: it is loaded from ``repro_testbed_compat.pth`` in the testbed venv
only when ``REPRO_TESTBED_COMPAT=1`` (the adapter's testbed profile sets it with ``--enable-hierarchical-cache``),
never via PYTHONPATH, and it is independent of the injector. Patches are applied lazily by a post-import hook, when
the target module is first imported; nothing is imported at interpreter start.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from typing import Callable

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


HOOKS: dict[str, Callable] = {
    "sglang.srt.mem_cache.pool_host.common": _patch_pool_host_common,
    "sglang.srt.mem_cache.pool_host.mha": _patch_pool_host_mha,
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
