"""Quoting and log prefixes around pasted dumps: what is stripped from each line, and the source it names.

Always stripped (unambiguous): markdown quote markers (``> ``, ``>> ``), markdown fences (a fence line is a block
boundary), torch's ``[rank3]:`` prefix (names rank 3), mpirun's ``[1,3]<stderr>:`` tag (job 1, rank 3), ray's
``(RayWorkerWrapper pid=123, ip=…)`` and vLLM's ``(VllmWorker rank=1 pid=123)`` / ``(Worker_TP1 pid=123)``
worker prefixes, leading timestamps (ISO ``2026-12-01T09:59:27.944Z``, ``2026-12-01 09:59:27,944``, bracketed
``[2026-12-01 09:59:27]``), glog headers (``[E1201 09:59:27.94 x.cpp:68]``) and vLLM's log headers
(``ERROR 12-01 09:59:27 [multiproc_executor.py:527]``).
torchrun's ``--tee`` prefix ``[default0]:`` (role and local rank; names that rank), SGLang's log prefix
``[2026-12-01 09:59:27 TP1] `` (names TP rank 1; the unprefixed lines after it, the rest of that log record such as
a traceback, belong to it), and terminal colour codes (``ESC[33m``, as py-spy writes on a terminal) are stripped too;
no-break spaces (copied from a rendered page) are read as spaces.
Stripped only when most lines carry them (they could be content otherwise): docker compose ``name  | ``, kubectl
``[pod/name/container] `` and pdsh ``host: `` (DeepSpeed's multi-node launcher) prefixes. Each distinct source
(rank, service, pod, host, ray worker) is read on its own, so interleaved logs are split.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Optional

_QUOTE_RE = re.compile(r"^[ \t]{0,3}(?:>[ \t]?)+")
_FENCE_RE = re.compile(r"^\s*(```|~~~)")
_RANK_RE = re.compile(r"^\[(?:rank|RANK|Rank)\s?(\d+)\]:?\s?")
_TORCHRUN_RE = re.compile(r"^\[(?P<role>[A-Za-z_]\w*?)?(?P<n>\d+)\]:")
_TS_TAGS_RE = re.compile(r"^\[\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?P<tags>(?: [A-Z][A-Z_]*\d+)+)\] ?")
_TP_TAG_RE = re.compile(r"\bTP(\d+)\b")
_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")
_HOST_RE = re.compile(r"^(?P<host>[A-Za-z0-9][\w.\-]{0,62}): ")
_MPI_RE = re.compile(r"^\[(\d+),(\d+)\]<(?:stdout|stderr|stddiag)>:\s?")
_RAY_RE = re.compile(r"^\((?P<name>[\w.:\-]+)(?: rank=(?P<rank>\d+))?(?: pid=(?P<pid>\d+))?(?:, ip=[\d.:a-fA-F]+)?"
                     r"(?:, [\w=.\-]+)*\)\s")
_TS_RE = re.compile(r"^\[?\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?\]?"
                    r"(?: ?[|:] ?| )?")
_GLOG_RE = re.compile(r"^\[?[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+(?: +\d+)? [\w.\-]+:\d+\]\s?")
# vLLM's log header 'ERROR 12-01 09:59:27 [multiproc_executor.py:527] ' (one space after it: a traceback's own
# indentation is kept)
_LEVEL_RE = re.compile(r"^(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? "
                       r"\[[\w.\-]+(?::\d+)?\] ?")
_COMPOSE_RE = re.compile(r"^(?P<svc>[A-Za-z0-9][A-Za-z0-9_.\-]*)\s*\|\s?")
_BRACKET_RE = re.compile(r"^\[(?P<br>[A-Za-z0-9_.:/\-]{1,120})\]\s")
# every fixed prefix above starts like this (a quote marker, '[', '(', a date, a glog letter): a line that does not
# is returned as it is without trying each prefix (most lines of a dump)
_ANY_FIXED_RE = re.compile(r"[ \t]{0,3}>|[\[(]|\d{4}-\d\d-\d\d[T ]|[IWEF]\d{4} |"
                           r"(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL) \d\d-")


@dataclass(frozen=True)
class CleanLine:
    """One input line with its quoting and prefixes removed.

    ``text``: what is left (indentation kept). ``label``: the source the prefixes name (``rank3``, a compose
    service, a pod, ``ray pid 123``) or ``""``. ``rank_hint``/``hint_source``: a rank named by the prefix.
    ``fence``: the line was a markdown fence (a block boundary, no content). ``sticky``: the label came from a
    log-record prefix (SGLang's ``[time TP1]``): the unprefixed lines after it continue that record.
    """

    text: str
    label: str = ""
    rank_hint: Optional[int] = None
    hint_source: str = ""
    fence: bool = False
    sticky: bool = False


class LabelPrefixes(NamedTuple):
    """Which ambiguous per-line prefixes a source uses (see :func:`sniff_label_prefixes`)."""

    compose: bool = False
    bracket: bool = False
    host: bool = False


def sniff_label_prefixes(sample: Iterable[str]) -> LabelPrefixes:
    """Whether compose (``svc | ``), bracket (``[pod/x] ``) and pdsh (``host: ``) prefixes are in use: compose and
    bracket when at least half of the sample's non-blank, non-indented lines carry that prefix (after the
    unambiguous prefixes); host when at least 4 of 5 of all its non-blank lines do, from at most 64 hosts."""
    n = compose = bracket = 0
    lines = host = 0
    hosts: set = set()
    for raw in sample:
        s = _strip_fixed(raw)[0]
        if not s.strip():
            continue
        lines += 1
        m = _HOST_RE.match(s)
        if m:
            host += 1
            hosts.add(m.group("host"))
        if s.startswith((" ", "\t")):
            continue
        n += 1
        if _COMPOSE_RE.match(s):
            compose += 1
        elif _BRACKET_RE.match(s):
            bracket += 1
    c, b = n > 0 and compose * 2 >= n, n > 0 and bracket * 2 >= n
    h = not (c or b) and lines >= 3 and host * 5 >= lines * 4 and len(hosts) <= 64
    return LabelPrefixes(c, b, h)


def _strip_fixed(line: str) -> tuple[str, str, Optional[int], str]:
    return _strip_fixed2(line)[:4]


def _strip_fixed2(line: str) -> tuple[str, str, Optional[int], str, bool]:
    label, hint, src, sticky = "", None, "", False
    s = line
    for _ in range(6):
        if not _ANY_FIXED_RE.match(s):
            break
        before = s
        m = _QUOTE_RE.match(s)
        if m and m.end() > 0 and (len(s) == m.end() or not s[m.end():].startswith(">")):
            s = s[m.end():]
        m = _RANK_RE.match(s)
        if m:
            hint, src, label = int(m.group(1)), f"[rank{m.group(1)}] prefix", f"rank{m.group(1)}"
            s = s[m.end():]
        m = _TORCHRUN_RE.match(s) if hint is None else None
        if m:
            n = m.group("n")
            hint, src, label = int(n), f"torchrun prefix [{m.group('role') or ''}{n}] (local rank)", f"rank{n}"
            s = s[m.end():]
        m = _TS_TAGS_RE.match(s)
        if m:
            tags = m.group("tags").strip()
            label, sticky = label or tags, True
            tp = _TP_TAG_RE.search(tags)
            if tp and hint is None:
                hint, src = int(tp.group(1)), f"log prefix {tags!r}"
            s = s[m.end():]
        m = _MPI_RE.match(s)
        if m:
            hint, src, label = int(m.group(2)), f"mpirun tag [{m.group(1)},{m.group(2)}]", f"rank{m.group(2)}"
            s = s[m.end():]
        m = _RAY_RE.match(s)
        if m:
            label = f"{m.group('name')} pid={m.group('pid')}" if m.group("pid") else m.group("name")
            if m.group("rank") is not None and hint is None:  # vLLM's '(VllmWorker rank=1 pid=123) '
                hint, src = int(m.group("rank")), f"worker prefix ({m.group('name')} rank={m.group('rank')})"
            s = s[m.end():]
        m = _TS_RE.match(s)
        if m and m.end() > 0:
            s = s[m.end():]
        m = _GLOG_RE.match(s)
        if m:
            s = s[m.end():]
        m = _LEVEL_RE.match(s)
        if m:
            s = s[m.end():]
        if s == before:
            break
    return s, label, hint, src, sticky


def clean_line(line: str, compose: bool = False, bracket: bool = False, host: bool = False) -> CleanLine:
    """Strip quoting and prefixes from one line (see the module docstring); ``compose``/``bracket``/``host`` from
    :func:`sniff_label_prefixes`."""
    line = line.rstrip("\r\n")
    if "\x1b" in line:
        line = _ANSI_RE.sub("", line)
    if "\xa0" in line:  # no-break spaces: what copying indented text from a rendered web page gives
        line = line.replace("\xa0", " ")
    fenced = "```" in line or "~~~" in line
    if fenced and _FENCE_RE.match(_QUOTE_RE.sub("", line, count=1)):
        return CleanLine("", fence=True)
    s, label, hint, src, sticky = _strip_fixed2(line)
    outer = None
    if compose and not s.startswith((" ", "\t")):
        outer = _COMPOSE_RE.match(s)
    elif bracket and not s.startswith((" ", "\t")):
        outer = _BRACKET_RE.match(s)
    elif host:
        outer = _HOST_RE.match(s)
    if outer:
        label = label or outer.group(1)
        s, l2, h2, s2, st2 = _strip_fixed2(s[outer.end():])
        hint, src = (h2, s2) if h2 is not None else (hint, src)
        label, sticky = l2 or label, st2 or sticky
    if fenced and _FENCE_RE.match(s):
        return CleanLine("", label=label, rank_hint=hint, hint_source=src, fence=True, sticky=sticky)
    return CleanLine(s, label=label, rank_hint=hint, hint_source=src, sticky=sticky)
