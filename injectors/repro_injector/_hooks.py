"""The post-import hook: a ``sys.meta_path`` entry that runs the runtime's patch callback right after a watched
module executed (so a site is patched before anything calls it)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._runtime import Runtime


class _HookFinder:
    """``sys.meta_path`` entry: after a watched module executes, run the runtime's patch callback on it."""

    def __init__(self, rt: "Runtime") -> None:
        self.rt = rt
        self.busy: set = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname in self.busy or (fullname not in self.rt.watched and not (
                self.rt.watch_prefixes and fullname.startswith(self.rt.watch_prefixes))):
            return None
        self.busy.add(fullname)
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self.busy.discard(fullname)
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        rt = self.rt
        orig_exec = loader.exec_module

        def exec_module(module: Any) -> None:
            try:
                orig_exec(module)
            finally:
                try:
                    del loader.exec_module  # back to the class's method for later imports
                except AttributeError:
                    pass
            rt.on_module(module)

        try:
            loader.exec_module = exec_module
        except Exception:
            return spec
        return spec
