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
