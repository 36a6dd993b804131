"""What reporters write by hand: condensed frame lists, arrow chains, and ``rank N:`` headings.

- Condensed list: the innermost frame flush left, its callers indented (two spaces, or more), no ``Thread`` line::

      all_reduce (torch/distributed/distributed_c10d.py:2501)
        _sync_counts (scheduler.py:880)
        step (scheduler.py:901)

  A frame is ``function``, ``function (file:line)``, ``function at file:line`` or ``file:line in function``. A
  block is kept when one of its frames names a source location, or when its innermost frame is a collective op or
  a wait (a bare list of other words is prose, not a stack).
- Arrow chain, one line per rank: ``rank 0: all_reduce → _sync_counts → step → event_loop …`` (also ``<-``, ``←``,
  ``->``). ``←``/``<-`` read "called from" (innermost first). For ``→``/``->`` the order is taken from the ends:
  when the last item is a collective op or a wait and the first is not, the chain is outermost first and reversed;
  otherwise innermost first. The note says which order was assumed.
- Heading: a short line ``rank 3:``, ``## TP1``, ``**Rank 2 (GPU 2)**``, ``<details><summary>rank 1</summary>``,
  ``=== rank 0 ===`` names the rank of the block under it.

No tool writes these: fixtures of these formats are written by hand (in the shape of public bug reports).
"""

from __future__ import annotations

import re
from typing import Optional

from repro.readers.types import Frame

_FUNC = r"[A-Za-z_<][\w.<>\[\]~:-]*(?:\(\))?"
_FRAME_RES = (
    re.compile(rf"^(?P<func>{_FUNC})\s+\((?P<file>[^()\s]+?)(?::(?P<line>\d+))?\)$"),
    re.compile(rf"^(?P<func>{_FUNC})\s+(?:at|in)\s+(?P<file>[^\s()]+?)(?::(?P<line>\d+))?$"),
    re.compile(rf"^(?P<file>[^\s()]+\.py):(?P<line>\d+)(?:\s+in)?\s+(?P<func>{_FUNC})$"),
    re.compile(rf"^(?P<func>{_FUNC})$"),
)
HEADING_RE = re.compile(r"^\s*(?:<[a-z]+>\s*)*(?:[=\-~]{2,}\s*)?(?:#+\s*|\*\*|__)?\s*"
                        r"(?:rank|tp|worker|gpu|process)\s*[_#-]?\s*(\d+)\b[^:]{0,40}?:?"
                        r"\s*(?:\*\*|__)?\s*:?\s*$", re.I)
_ARROW_SPLIT = re.compile(r"\s*(?:→|⟶|->|-->|<-|<--|←|⟵)\s*")
_LABEL_RE = re.compile(r"^(?P<label>[^:→←<>]{1,40}?):\s+(?P<chain>.+)$")
_LABEL_RANK_RE = re.compile(r"(?:rank|tp|worker|gpu)\s*[_#-]?\s*(\d+)", re.I)
_LETTER_RE = re.compile(r"[A-Za-z_]")
_LOCATED_RE = re.compile(r"[\w.]\.py\b|:\d+\)?\s*$")
_KEYWORDS = frozenset({"and", "or", "the", "then", "to", "from", "is", "in", "at", "of", "a"})

# a superset of the lines :func:`handle` can take that are not indented (the reader gate, see readers/__init__.py):
# a heading, a frame of one of the four forms of ``_FRAME_RES`` (with trailing ',;' or '…'), or an arrow anywhere
GATE_START = (r"(?i:\s*(?:<[a-z]+>\s*)*(?:[=\-~]{2,}\s*)?(?:#+\s*|\*\*|__)?\s*"
              r"(?:rank|tp|worker|gpu|process)\s*[_#-]?\s*\d)|"
              rf"{_FUNC}(?:[\s,;.…]*$|\s+\(|\s+(?:at|in)\s)|[^\s()]+\.py:\d")
GATE_SUBSTRINGS: tuple = ("→", "⟶", "->", "<-", "←", "⟵")


def parse_frame(text: str) -> Optional[Frame]:
    """One hand-written frame (see the module docstring), or None when ``text`` does not look like one."""
    t = text.strip().rstrip(",;").strip()
    for token in ("…", "..."):
        t = t[: -len(token)].strip() if t.endswith(token) else t
    if not t or t.lower() in _KEYWORDS:
        return None
    for rx in _FRAME_RES:
        m = rx.match(t)
        if m:
            func = m.group("func").removesuffix("()")
            if not _LETTER_RE.search(func):
                return None
            file = m.groupdict().get("file") or ""
            line = m.groupdict().get("line")
            return Frame(function=func, module_or_file=file or "?", line=int(line) if line else None)
    return None


def _looks_located(text: str) -> bool:
    return bool(_LOCATED_RE.search(text))


def _op_like(f: Frame) -> bool:
    from repro.diagnosis import COLLECTIVE_OPS
    from repro.frames import _norm_op, comm_layer, idle_kind
    return _norm_op(f.function) in COLLECTIVE_OPS or comm_layer(f) is not None or idle_kind(f) is not None


def handle(asm, s: str, n: int) -> bool:
    """Consume one hand-written line (heading, arrow chain, condensed frame); False when it is not one."""
    if len(s) < 80 and HEADING_RE.match(s) and not _ARROW_SPLIT.search(s):
        asm.close_process()
        m = HEADING_RE.match(s)
        asm.pending_rank = (int(m.group(1)), f"heading {s.strip()[:40]!r}")
        return True
    if _ARROW_SPLIT.search(s):
        return _arrow(asm, s, n)
    indented = s[:1] in (" ", "\t")
    t = asm.thr
    if indented:
        if t is not None and t.get("condensed"):
            f = parse_frame(s)
            if f is not None:
                asm.add_frame(f)
                t["located"] = t.get("located") or _looks_located(s)
                return True
        return False
    f = parse_frame(s)
    if f is None:
        return False
    asm.new_process("condensed", n)
    asm.cur["first_text"] = s
    asm.new_thread("condensed", n, "", "", is_main=True)
    asm.thr["condensed"] = True
    asm.thr["located"] = _looks_located(s)
    asm.add_frame(f)
    return True


def _arrow(asm, s: str, n: int) -> bool:
    label = ""
    body = s.strip()
    m = _LABEL_RE.match(body)
    if m and not _ARROW_SPLIT.search(m.group("label")):
        label, body = m.group("label").strip(), m.group("chain")
    parts = [p for p in _ARROW_SPLIT.split(body) if p.strip() and p.strip() not in ("…", "...")]
    frames = [parse_frame(p) for p in parts]
    if len(parts) < 2 or any(f is None for f in frames):
        return False
    back = bool(re.search(r"<-|←|⟵", body))
    note = "arrow chain read innermost first ('←' = called from)"
    if not back and _op_like(frames[-1]) and not _op_like(frames[0]):
        frames.reverse()
        note = "arrow chain read outermost first ('→' = calls): the collective/wait is its last item"
    elif not back:
        note = "arrow chain read innermost first (its first item is the innermost frame)"
    lm = _LABEL_RANK_RE.search(label) if label else None
    if lm:
        asm.pending_rank = (int(lm.group(1)), f"label {label!r}")
    asm.new_process("arrow-chain", n, note=note)
    if label and not lm:
        asm.cur["title"] = label
    asm.new_thread("arrow-chain", n, "", "", is_main=True)
    for f in frames:
        asm.add_frame(f)
    asm.close_process()
    return True


def finish_thread_check(proc: dict) -> bool:
    """Whether a condensed block is a stack (kept) or a stray word (dropped): at least two frames, or one frame
    with a location."""
    th = proc["threads"]
    if proc["fmt"] != "condensed" or not th:
        return True
    t = th[0]
    frames = list(t["frames"])
    # kept when it names a source location, or when its innermost frame is a collective or a wait (a bare list of
    # words that are neither is prose or junk, not a stack)
    return bool(t.get("located")) or (len(frames) >= 2 and _op_like(frames[0]))
