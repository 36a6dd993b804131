"""Helpers shared by the readers: path shortening, native-file test, main-thread guess, warning wording."""

from __future__ import annotations

import re
from typing import Optional

from repro.readers.types import ThreadStack

_NATIVE_FILE_RE = re.compile(r"(\.so(\.[\w.]+)?|\.dylib|\.dll|\.c|\.cc|\.cpp|\.cxx|\.h|\.hpp|\.cu|\.pyx)$")

NO_STACK_HINT = (
    "no Python stack found: expected py-spy text ('Thread <id> (idle): \"MainThread\"' followed by "
    "'    function (file.py:line)' lines), py-spy --json output, a faulthandler dump "
    "('Thread 0x... (most recent call first):' followed by '  File \"...\", line N in f'), pystack, gdb 'bt', "
    "a Python traceback, torch's 'Stack trace of the failed collective:', or a frame list (innermost first); "
    "is this a dump of a Python process?"
)


def summarise_ignored(count: int, first: Optional[tuple[int, str]], what: str) -> list[str]:
    """One warning for ``count`` unreadable lines, quoting the first (escaped, at most 100 characters)."""
    if not count or first is None:
        return []
    n, line = first
    return [f"ignored {count} line(s) that are not {what} (first, line {n}: {line[:100]!r})"]


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


def is_native_file(file: str) -> bool:
    return bool(_NATIVE_FILE_RE.search(file))


def guess_main(threads: list[ThreadStack], pid: Optional[int], current: Optional[str] = None) -> list[ThreadStack]:
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


