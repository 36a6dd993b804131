"""Rank identity from process titles: the engine adapters first (``repro.targets.registry``), then data.

Order: (1) every registered adapter's title parser (SGLang's ``sglang::scheduler[_DP…][_PP…]_TP{k}[_EP…]``);
(2) a title under an adapter's rank-process prefix that its parser cannot number (``sglang::scheduler_None``,
written by older SGLang with no DP rank) is a rank process with an unknown rank; (3) another title in an
adapter's namespace (``sglang::detokenizer``) is not a rank; (4) the data rules of
``repro/data/frame_rules.toml`` (vLLM ``VLLM::Worker_TP0_EP0``, ``ray::…``, ``--local_rank=N``, launchers);
(5) anything else (plain ``python train.py``) is unknown: the caller decides from the other processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional


@dataclass(frozen=True)
class TitleInfo:
    """What a title says: ``role`` ``rank`` / ``not-rank``; ``tp``/``pp``/``dp``/``rank`` when it has them;
    ``engine`` that knows the title; ``reason`` in words (why skipped, or where the rank came from)."""

    engine: str
    role: str
    tp: Optional[int] = None
    pp: Optional[int] = None
    dp: Optional[int] = None
    rank: Optional[int] = None
    reason: str = ""


def identify_title(title: str) -> Optional[TitleInfo]:
    """Identify a process title (see the module docstring); None when nothing knows it."""
    t = (title or "").strip()
    if not t:
        return None
    try:
        from repro.targets import registry
        hit = registry.parse_title_any(t)
        adapters = registry.all_adapters()
    except Exception:  # pragma: no cover - the registry must never break reading dumps
        hit, adapters = None, {}
    if hit is not None:
        name, rt = hit
        return TitleInfo(engine=name, role="rank", tp=rt.tp, pp=rt.pp, dp=rt.dp,
                         reason=f"title {t[:60]!r} ({name})")
    word = t.split(" ", 1)[0]
    for name, a in adapters.items():
        prefix = a.watch_defaults.title_match
        if prefix and word.startswith(prefix):
            return TitleInfo(engine=name, role="rank",
                             reason=f"title {word!r} is a {name} rank process but names no rank")
    for name, a in adapters.items():
        ns = a.title_namespace
        if ns and word.startswith(ns):
            return TitleInfo(engine=name, role="not-rank",
                             reason=f"{word!r} is a {name} process that is not a rank (no collective runs there)")
    from repro.readers.rules import title_match

    m = title_match(t)
    if m is None:
        return None
    if m.role != "rank":
        return TitleInfo(engine=m.engine, role="not-rank", reason=f"{word[:60]!r}: {m.reason}")
    tp = m.tp if m.tp is not None else m.rank
    return TitleInfo(engine=m.engine, role="rank", tp=tp, pp=m.pp, dp=m.dp, rank=m.rank,
                     reason=f"title {t[:60]!r} ({m.engine})" if tp is not None
                     else f"title {word[:60]!r} is a {m.engine} rank process but names no rank")


def dumps_engine(titles: Iterable[str]) -> dict[str, str]:
    """Which engine dumps came from, for verbs that have no scenario (``repro analyze``): ``{"name", "from"}``. The
    engines the rank titles name (``from``: ``the rank titles``), else every registered engine, *assumed* (the
    analysis then reads the frames with every registered adapter's rules; ``from`` says so)."""
    names = sorted({i.engine for i in (identify_title(t) for t in titles) if i is not None and i.engine})
    if names:
        return {"name": ", ".join(names), "from": "the rank titles"}
    try:
        from repro.targets.registry import known_adapters

        known = known_adapters()
    except Exception:  # pragma: no cover - the registry must never break reading dumps
        known = []
    return {"name": "any of: " + ", ".join(known), "from": "assumed: no title names an engine; the frames are read "
            "with every registered engine's rules"}
