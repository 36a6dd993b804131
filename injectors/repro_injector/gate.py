"""Stack gate: does the current call come from the right caller frames (and from inside the right loop)?

Frames are named ``module:qualname`` (``f_globals['__name__']`` + ``co_qualname``, Python 3.11+). Without
``co_qualname`` (3.10) the qualname is rebuilt as ``Class.co_name`` where ``Class`` is the class in ``type(self)``'s
MRO whose attribute of that name has this very code object, else plain ``co_name``. Everything that depends only on
the code object (its name, which patterns it matches, whether it is a decorator ``wrapper``, its loop ranges) is
computed once and cached per code object, so a gate costs a few dict lookups per frame.

Line numbers are never part of a pattern (they drift every release); ``inside_loop`` is answered from the bytecode:
the instruction range between a ``FOR_ITER`` whose next store targets the loop variable and that ``FOR_ITER``'s exit
target, widened by out-of-line blocks (exception handlers) whose source lines lie inside the loop body. A call made
after the loop ended is outside that range even though the loop variable is still bound.
"""

from __future__ import annotations

import dis
import fnmatch
import re
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

HAS_QUALNAME = sys.version_info >= (3, 11)

# Names of closures that decorators return (functools-style wrappers, torch's context decorators, sglang's
# ``scheduler_stage_method`` / ``rank_consensus`` wrappers). Such frames are transparent for the gate.
DECORATOR_NAMES = frozenset({"wrapper", "wrapped", "inner", "_inner", "_wrapper", "decorate_context", "wrapper_func", "_fn", "wrapped_fn"})

_PLAIN = (False, (), False)
_TRANSPARENT = (True, (), False)

# Code objects of the injector's own wrappers: always transparent.
OWN_CODES: set = set()


def _compile_pattern(pattern: str) -> Tuple[bool, "re.Pattern[str]"]:
    """``module:qual`` globs match the full frame name; a pattern without ``:`` matches the qualname only."""
    return (":" in pattern, re.compile(fnmatch.translate(pattern)))


def _qualname_fallback(frame: Any) -> str:
    code = frame.f_code
    name = code.co_name
    if code.co_varnames[:1] in (("self",), ("cls",)) and code.co_argcount >= 1:
        try:
            first = frame.f_locals.get(code.co_varnames[0])
        except Exception:
            first = None
        if first is not None:
            klass = first if isinstance(first, type) else type(first)
            for c in getattr(klass, "__mro__", ()):
                fn = c.__dict__.get(name)
                fn = getattr(fn, "__func__", fn)
                while fn is not None and getattr(fn, "__code__", None) is not code and getattr(fn, "__wrapped__", None) is not None:
                    fn = fn.__wrapped__
                if getattr(fn, "__code__", None) is code:
                    return f"{c.__qualname__}.{name}"
    return name


def frame_name(frame: Any, use_qualname: bool = HAS_QUALNAME) -> str:
    """``module:qualname`` of a frame (qualname fallback described in the module docstring)."""
    module = frame.f_globals.get("__name__", "?")
    qual = frame.f_code.co_qualname if use_qualname else _qualname_fallback(frame)
    return f"{module}:{qual}"


def is_decorator_frame(frame: Any, use_qualname: bool = HAS_QUALNAME) -> bool:
    """True for a decorator's wrapper closure (name in DECORATOR_NAMES and a closure) or an injector wrapper."""
    code = frame.f_code
    if code in OWN_CODES:
        return True
    if code.co_name not in DECORATOR_NAMES:
        return False
    if use_qualname:
        return "<locals>" in code.co_qualname
    return bool(code.co_freevars)


def loop_ranges(code: Any, target: str) -> Tuple[Tuple[int, int], ...]:
    """Half-open bytecode offset ranges (bytes, comparable with ``frame.f_lasti``) inside ``for <target> in`` loops.

    Tuple targets (``for i, req in ...``) count when one of the stored names is ``target``. Each instruction's range
    runs to the next instruction, so inline cache entries (where ``f_lasti`` points during a call on 3.11+) are
    covered. Empty when the code has no such loop.
    """
    instrs = list(dis.get_instructions(code))
    n = len(instrs)
    size = len(code.co_code)
    ends = [instrs[k + 1].offset if k + 1 < n else size for k in range(n)]

    lines: List[Optional[int]] = []
    cur = None
    for ins in instrs:
        pos = getattr(ins, "positions", None)
        if pos is not None:
            lines.append(pos.lineno)
        else:  # 3.10: carry the last starts_line forward
            if ins.starts_line is not None:
                cur = ins.starts_line
            lines.append(cur)

    spans: List[Tuple[int, int]] = []
    for i, ins in enumerate(instrs):
        if ins.opname != "FOR_ITER":
            continue
        j = i + 1
        names = []
        while j < n and instrs[j].opname in ("EXTENDED_ARG", "NOP", "CACHE"):
            j += 1
        if j < n and instrs[j].opname in ("UNPACK_SEQUENCE", "UNPACK_EX"):
            j += 1
            while j < n and instrs[j].opname.startswith("STORE_"):
                names.append(instrs[j].argval)
                j += 1
        elif j < n and instrs[j].opname.startswith("STORE_"):
            names.append(instrs[j].argval)
        if target not in names:
            continue
        start, end = ins.offset, ins.argval
        if not isinstance(end, int) or end <= start:
            continue
        spans.append((start, end))
        for_line = lines[i]
        body = [lines[k] for k in range(n) if start <= instrs[k].offset < end and lines[k] is not None]
        max_line = max(body) if body else for_line
        if for_line is None:
            continue
        for k in range(n):
            if not (start <= instrs[k].offset < end) and lines[k] is not None and for_line < lines[k] <= max_line:
                spans.append((instrs[k].offset, ends[k]))  # out-of-line block (e.g. an except handler) of the body
    spans.sort()
    merged: List[Tuple[int, int]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return tuple(merged)


def loop_targets(code: Any) -> Tuple[str, ...]:
    """Names stored by each ``for`` loop of ``code`` (first stored name per ``FOR_ITER``), in bytecode order."""
    instrs = list(dis.get_instructions(code))
    out: List[str] = []
    for i, ins in enumerate(instrs):
        if ins.opname != "FOR_ITER":
            continue
        j = i + 1
        while j < len(instrs) and instrs[j].opname in ("EXTENDED_ARG", "NOP", "CACHE", "UNPACK_SEQUENCE", "UNPACK_EX"):
            j += 1
        if j < len(instrs) and instrs[j].opname.startswith("STORE_") and instrs[j].argval not in out:
            out.append(instrs[j].argval)
    return tuple(out)


def enclosing_loops(code: Any, lasti: int) -> List[str]:
    """Targets of the ``for`` loops of ``code`` whose range (``loop_ranges``) holds offset ``lasti``, outermost first."""
    hits = []
    for t in loop_targets(code):
        spans = loop_ranges(code, t)
        inside = [(a, b) for a, b in spans if a <= lasti < b]
        if inside:
            hits.append((min(a for a, _ in inside), t))
    return [t for _, t in sorted(hits)]


class Gate:
    """Compiled stack gate of one injection (the plan's ``gate`` object, caller-frame part).

    Args:
        called_from: ``module:qualname`` globs; each must match some frame within ``max_depth`` frames.
        not_called_from: globs; none may match within ``max_depth`` frames.
        max_depth: number of non-decorator frames above the site that are looked at (1 = the direct caller).
        inside_loop: loop variable name; the frame matched by ``called_from[0]`` must be inside that loop.
    """

    def __init__(self, called_from: Sequence[str] = (), not_called_from: Sequence[str] = (), max_depth: int = 16,
                 inside_loop: Optional[str] = None, use_qualname: bool = HAS_QUALNAME) -> None:
        self.called_from = [_compile_pattern(p) for p in called_from]
        self.not_called_from = [_compile_pattern(p) for p in not_called_from]
        self.max_depth = int(max_depth)
        self.inside_loop = inside_loop or None
        self.use_qualname = use_qualname
        self.trivial = not self.called_from and not self.not_called_from
        # id(code) -> (transparent, tuple of called_from hits, any not_called_from hit)
        self._cache: Dict[int, Tuple[bool, Tuple[int, ...], bool]] = {}
        self._keep: List[Any] = []
        self._loops: Dict[int, Tuple[Any, Tuple[Tuple[int, int], ...]]] = {}
        self.last_caller: Optional[str] = None

    def _info(self, frame: Any) -> Tuple[bool, Tuple[int, ...], bool]:
        """(transparent, called_from hits, not_called_from hit) for a frame; cached by ``id(code)``.

        Cached code objects are kept alive in ``_keep`` so an id is never reused while it is a key.
        """
        code = frame.f_code
        if is_decorator_frame(frame, self.use_qualname):
            info = _TRANSPARENT
        else:
            name = frame_name(frame, self.use_qualname)
            qual = name.split(":", 1)[1]
            hits = tuple(i for i, (full, rx) in enumerate(self.called_from) if rx.match(name if full else qual))
            block = any(rx.match(name if full else qual) for full, rx in self.not_called_from)
            info = (False, hits, block) if (hits or block) else _PLAIN
        if self.use_qualname:  # the fallback name can depend on self's class; cache only the exact path
            self._keep.append(code)
            self._cache[id(code)] = info
        return info

    def in_loop(self, frame: Any) -> bool:
        """Is ``frame`` currently executing inside its ``for <inside_loop>`` loop (by ``f_lasti``)?"""
        code = frame.f_code
        got = self._loops.get(id(code))
        if got is None or got[0] is not code:
            got = (code, loop_ranges(code, self.inside_loop or ""))
            self._loops[id(code)] = got
        spans = got[1]
        lasti = frame.f_lasti
        for a, b in spans:
            if a <= lasti < b:
                return True
        return False

    def check(self, frame: Any) -> bool:
        """Does the stack starting at ``frame`` (the site's caller) pass the gate? Sets ``last_caller`` on a match."""
        if self.trivial:
            self.last_caller = None
            return True
        cache = self._cache
        need = len(self.called_from)
        full = (1 << need) - 1
        found_mask = 0
        first = None
        stop_early = not self.not_called_from
        depth = 0
        max_depth = self.max_depth
        f = frame
        while f is not None and depth < max_depth:
            info = cache.get(id(f.f_code))  # keyed by id: hashing a code object hashes its whole bytecode
            if info is None:
                info = self._info(f)
            if info is _PLAIN:  # the common case: a frame that is neither a match nor a decorator
                depth += 1
                f = f.f_back
                continue
            if info[0]:
                f = f.f_back
                continue
            depth += 1
            if info[2]:
                return False
            hits = info[1]
            if hits:
                for i in hits:
                    if i == 0 and first is None:
                        first = f
                    found_mask |= 1 << i
                if stop_early and found_mask == full:
                    break
            f = f.f_back
        if found_mask != full:
            return False
        if self.inside_loop and (first is None or not self.in_loop(first)):
            return False
        self.last_caller = frame_name(first, self.use_qualname) if first is not None else None
        return True


def gate_from_plan(g: Dict[str, Any]) -> Gate:
    """Build a Gate from the plan's ``gate`` dict (keys as in ``repro.scenario.Gate``)."""
    return Gate(g.get("called_from") or (), g.get("not_called_from") or (), g.get("max_depth") or 16, g.get("inside_loop"))


def caller_chain(frame: Any, limit: int = 8) -> List[str]:
    """Names of up to ``limit`` non-transparent frames from ``frame`` outward (for fire records)."""
    out: List[str] = []
    f = frame
    while f is not None and len(out) < limit:
        if not is_decorator_frame(f):
            out.append(frame_name(f))
        f = f.f_back
    return out


__all__ = ["Gate", "gate_from_plan", "frame_name", "is_decorator_frame", "loop_ranges", "caller_chain",
           "loop_targets", "enclosing_loops", "OWN_CODES",
           "DECORATOR_NAMES", "HAS_QUALNAME"]
