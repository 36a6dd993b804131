"""This process, as the injector sees it: its own clocks (saved before any scenario can patch ``time``), its start
time and title, ``torch.distributed`` once initialized, and the attribute paths a plan names (``self.pool``,
``module:attr.path``, ``module:getter()``). Stdlib only; used on every patched call (keep it cheap)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Dict

# The injector's own clock and sleep: saved before any scenario can patch ``time`` functions.
_monotonic = time.monotonic
_wall = time.time
_sleep = time.sleep


def _proc_start() -> Dict[str, Any]:
    """``start_ticks`` from /proc/self/stat and ``create_time`` as psutil computes it (boot time + ticks/CLK_TCK)."""
    out: Dict[str, Any] = {"start_ticks": None, "create_time": None}
    try:
        with open("/proc/self/stat", "rb") as fh:
            stat = fh.read().decode("ascii", "replace")
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        out["start_ticks"] = ticks
        btime = None
        with open("/proc/stat", "rb") as fh:
            for line in fh:
                if line.startswith(b"btime"):
                    btime = float(line.split()[1])
                    break
        if btime is not None:
            out["create_time"] = btime + ticks / os.sysconf("SC_CLK_TCK")
    except Exception:
        pass
    if out["create_time"] is None:
        out["create_time"] = _wall()
    return out


def _proctitle() -> str:
    try:
        with open("/proc/self/cmdline", "rb") as fh:
            raw = fh.read()
        return raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except Exception:
        return " ".join(sys.argv)


def _attr_path(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _module_group(spec: str) -> Any:
    """The group a ``module:attr.path`` (a module global, e.g. vLLM's ``parallel_state:_TP``) or
    ``module:getter()`` (called with no arguments, e.g. ``parallel_state:get_tp_group()``) names; the module is
    imported if this process has not yet."""
    import importlib

    mod_name, _, path = spec.partition(":")
    obj: Any = sys.modules.get(mod_name) or importlib.import_module(mod_name)
    call = path.endswith("()")
    obj = _attr_path(obj, path[:-2] if call else path)
    return obj() if call else obj


def _dist() -> Any:
    """``torch.distributed`` if this process already imported it and it is initialized, else None."""
    d = sys.modules.get("torch.distributed")
    try:
        if d is not None and d.is_available() and d.is_initialized():
            return d
    except Exception:
        return None
    return None


def record_mp_names(rt: Any) -> None:
    """Write every name this process registers with multiprocessing's resource tracker to
    ``<out_dir>/mpnames-<pid>.txt`` (``<rtype> <name>``: ``semaphore /mp-…`` for a spawn-context lock or event).

    The tracker unlinks such names when it shuts down; sglang 0.5.23's launcher answers SIGTERM with
    ``kill_process_tree`` (SIGKILL to its children, the tracker among them), so every server stop left its
    ``/dev/shm/sem.mp-*`` files (2 per launch on the CPU testbed, closed and mapped by no process: no snapshot of the
    tree can see them). The harness reads these lines at stop (``repro.launcher.registered_shm_files``). Wraps
    ``multiprocessing.resource_tracker.register`` (``multiprocessing.synchronize.SemLock`` imports it at each call);
    never raises into the caller.
    """
    from . import files as _files

    def patch(mod: Any) -> None:
        orig = getattr(mod, "register", None)
        if orig is None or getattr(orig, "__repro_names__", False):
            return

        def register(name: Any, rtype: Any) -> Any:
            try:
                with open(os.path.join(rt.out_dir, _files.mp_names_file(os.getpid())), "a", encoding="utf-8") as fh:
                    fh.write(f"{rtype} {name}\n")
            except Exception:
                pass
            return orig(name, rtype)

        register.__repro_names__ = True  # type: ignore[attr-defined]
        mod.register = register

    rt._watch("multiprocessing.resource_tracker", patch)
