"""Frame and title rules read from data (``repro/data/frame_rules.toml``), for engines without an adapter yet.

One loader, one set of matchers: Python communication layers (vLLM's ``GroupCoordinator`` / pynccl /
``CpuCommunicator``, DeepSpeed's ``deepspeed.comm`` and ZeRO wrappers, accelerate's ``gather`` /
``wait_for_everyone``), native collective symbols naming their backend (gloo, NCCL, MPI) and group kind (CPU or
device), idle waits (vLLM's ``MessageQueue.dequeue``, autograd's engine wait, interpreter shutdown), helper threads
(watchdog, progress-bar monitor, signal/heartbeat, I/O and callback threads) and process titles (vLLM workers,
ray, torchrun, DeepSpeed). The rules are data: the reader and the analysis never name these engines in code.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional, Sequence

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

RULES_PATH = Path(__file__).resolve().parent.parent / "data" / "frame_rules.toml"


@dataclass(frozen=True)
class _FrameMatch:
    files: tuple[str, ...] = ()
    paths: tuple[str, ...] = ()
    functions: frozenset = frozenset()
    prefixes: tuple[str, ...] = ()
    functions_contain: tuple[str, ...] = ()

    def matches(self, function: str, path: str) -> bool:
        short = function.rsplit(".", 1)[-1]
        base = path.rsplit("/", 1)[-1]
        loc = False
        if self.files:
            loc = any(base == f or path.endswith(f) for f in self.files)
        if not loc and self.paths:
            loc = any(p in path for p in self.paths)
        if not self.files and not self.paths:
            loc = True
        if self.prefixes and any(function.startswith(p) for p in self.prefixes):
            return True
        if self.functions_contain and any(c in function.lower() for c in self.functions_contain):
            return True
        if not (self.files or self.paths):
            return False
        return loc and (not self.functions or short in self.functions)


def _fm(d: dict[str, Any]) -> _FrameMatch:
    def tup(key: str) -> tuple[str, ...]:
        v = d.get(key, ())
        return (v,) if isinstance(v, str) else tuple(v)

    return _FrameMatch(files=tup("file"), paths=tup("path"), functions=frozenset(tup("functions")),
                       prefixes=tup("prefixes"), functions_contain=tuple(s.lower() for s in tup("functions_contain")))


@dataclass(frozen=True)
class CollectiveRule:
    layer: str
    match: _FrameMatch
    group_kind: Optional[str] = None
    backend: Optional[str] = None


@dataclass(frozen=True)
class NativeRule:
    pattern: re.Pattern
    backend: str
    group_kind: Optional[str] = None


@dataclass(frozen=True)
class IdleRule:
    kind: str
    match: _FrameMatch


@dataclass(frozen=True)
class HelperRule:
    what: str
    name: Optional[re.Pattern]
    match: Optional[_FrameMatch]


@dataclass(frozen=True)
class TitleRule:
    engine: str
    pattern: re.Pattern
    role: str
    reason: str = ""


@dataclass(frozen=True)
class NotRankFramesRule:
    match: _FrameMatch
    reason: str


@dataclass(frozen=True)
class TitleMatch:
    """What a title rule says about a process: ``role`` ``rank`` or ``not-rank``; numbers when the title has them."""

    engine: str
    role: str
    reason: str = ""
    rank: Optional[int] = None
    tp: Optional[int] = None
    pp: Optional[int] = None
    dp: Optional[int] = None


@dataclass(frozen=True)
class FrameRules:
    collectives: tuple[CollectiveRule, ...]
    op_alias: dict
    natives: tuple[NativeRule, ...]
    native_ops: tuple[tuple[str, str], ...]
    native_idle: Optional[re.Pattern]
    idles: tuple[IdleRule, ...]
    helpers: tuple[HelperRule, ...]
    titles: tuple[TitleRule, ...]
    not_rank_frames: tuple[NotRankFramesRule, ...] = ()


@lru_cache(maxsize=4)
def load_rules(path: Optional[str] = None) -> FrameRules:
    """Read and compile the rules file (default ``repro/data/frame_rules.toml``); cached.

    Raises:
        ValueError: the file is not valid TOML or a regular expression in it does not compile (names the entry).
    """
    p = Path(path) if path else RULES_PATH
    try:
        data = tomllib.loads(p.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{p}: cannot read the frame rules ({e}); expected the TOML file shipped with repro")

    def rx(s: str, where: str, flags: int = 0) -> re.Pattern:
        try:
            return re.compile(s, flags)
        except re.error as e:
            raise ValueError(f"{p}: {where}: bad regular expression {s!r} ({e})")

    colls = tuple(CollectiveRule(layer=d["layer"], match=_fm(d), group_kind=d.get("group_kind"),
                                 backend=d.get("backend")) for d in data.get("collective", []))
    natives = tuple(NativeRule(pattern=rx(d["pattern"], "[[native]]"), backend=d.get("backend", ""),
                               group_kind=d.get("group_kind")) for d in data.get("native", []))
    ni = data.get("native_idle", {}).get("pattern")
    idles = tuple(IdleRule(kind=d["kind"], match=_fm(d)) for d in data.get("idle", []))
    helpers = tuple(HelperRule(what=d["what"], name=rx(d["name"], "[[helper]]", re.I) if d.get("name") else None,
                               match=_fm(d) if any(k in d for k in ("file", "path", "functions", "functions_contain"))
                               else None) for d in data.get("helper", []))
    titles = tuple(TitleRule(engine=d["engine"], pattern=rx(d["pattern"], "[[title]]"), role=d["role"],
                             reason=d.get("reason", "")) for d in data.get("title", []))
    return FrameRules(collectives=colls, op_alias=dict(data.get("op_alias", {})), natives=natives,
                      native_ops=tuple(data.get("native_op", {}).items()),
                      native_idle=rx(ni, "[native_idle]") if ni else None, idles=idles, helpers=helpers,
                      titles=titles,
                      not_rank_frames=tuple(NotRankFramesRule(match=_fm(d), reason=d["reason"])
                                            for d in data.get("not_rank_frames", [])))


def collective_layer(function: str, path: str) -> Optional[CollectiveRule]:
    """The communication layer a Python frame belongs to per the data rules, or None."""
    for r in load_rules().collectives:
        if r.match.matches(function, path):
            return r
    return None


def op_alias(function: str) -> Optional[str]:
    """The collective op a wrapper function stands for (``wait_for_everyone`` → ``barrier``), or None."""
    return load_rules().op_alias.get(function.rsplit(".", 1)[-1])


def native_backend(symbol: str) -> Optional[NativeRule]:
    """The rule naming the backend of a native communication symbol (``gloo::…`` → gloo), or None."""
    for r in load_rules().natives:
        if r.pattern.search(symbol):
            return r
    return None


def native_op(symbol: str) -> Optional[str]:
    """The collective op a native symbol names (``gloo::…::allreduce`` → ``all_reduce``), or None."""
    low = symbol.lower().replace("_", "")
    for needle, op in load_rules().native_ops:
        if needle in low:
            return op
    return None


def is_native_idle(symbol: str) -> bool:
    """A native wait primitive (``epoll_wait``, ``pthread_cond_wait``…): waiting, not on CPU."""
    ni = load_rules().native_idle
    return bool(ni and ni.search(symbol))


def idle_kind(function: str, path: str) -> Optional[str]:
    """The kind of idle wait a Python frame is per the data rules, or None."""
    for r in load_rules().idles:
        if r.match.matches(function, path):
            return r.kind
    return None


def helper_kind(name: str, frames: Sequence[tuple[str, str]]) -> Optional[str]:
    """What helper a thread is (``watchdog``, ``progress bar monitor``…) from its name or its ``(function, path)``
    frames, or None for a thread that may stand for its rank."""
    for r in load_rules().helpers:
        if r.name is not None and name and r.name.search(name):
            return r.what
        if r.match is not None and any(r.match.matches(fn, p) for fn, p in frames):
            return r.what
    return None


def title_match(title: str) -> Optional[TitleMatch]:
    """What the data's title rules say about a process title, or None when no rule matches."""
    for r in load_rules().titles:
        m = r.pattern.search(title or "")
        if not m:
            continue
        g = m.groupdict()

        def num(k: str) -> Optional[int]:
            v = g.get(k)
            return int(v) if v is not None else None

        return TitleMatch(engine=r.engine, role=r.role, reason=r.reason, rank=num("rank"), tp=num("tp"),
                          pp=num("pp"), dp=num("dp"))
    return None


def not_rank_by_frames(frames: Sequence[tuple[str, str]]) -> Optional[str]:
    """Why a process without a title is not a rank, from its Python ``(function, path)`` frames (torchrun's
    elastic agent), or None."""
    for r in load_rules().not_rank_frames:
        if any(r.match.matches(fn, p) for fn, p in frames):
            return r.reason
    return None
