"""The adapter registry: engine name → adapter, extended by the Python entry-point group ``repro.adapters``.

A scenario's ``[server] adapter = "NAME"`` selects ``get_adapter("NAME")``. Built in: ``sglang``
(``repro.targets.sglang:SGLangAdapter``) and ``vllm`` (``repro.targets.vllm:VLLMAdapter``). Another package adds an engine without touching the harness::

    # its pyproject.toml
    [project.entry-points."repro.adapters"]
    myengine = "my_pkg.repro_adapter:MyEngineAdapter"

or, in code (tests, notebooks): ``register("myengine", MyEngineAdapter)``. The factory is called with no
arguments, once per lookup (adapters are cheap and hold no state between runs).

Engine-neutral readers that do not know which engine wrote what they read (``repro analyze`` on pasted dumps, the
injector records' titles) ask every registered adapter: :func:`parse_title_any`, :func:`combined_frame_rules`.
See ``docs/adapters.md``.
"""

from __future__ import annotations

import threading
from importlib import metadata
from typing import Callable, Optional

from repro.targets import DEFAULT_ADAPTER
from repro.targets.base import Adapter, FrameRules, RankTitle

ENTRY_POINT_GROUP = "repro.adapters"

AdapterFactory = Callable[[], Adapter]


class UnknownAdapterError(ValueError):
    """No adapter is registered under the name; the message names the known ones."""


_lock = threading.Lock()
_factories: dict[str, AdapterFactory] = {}
_entry_points_loaded = False
_generation = 0  # bumped on every change, so cached combined data is recomputed
_combined: tuple[int, Optional[FrameRules]] = (-1, None)
_instances: tuple[int, dict[str, Adapter]] = (-1, {})


def _builtin_sglang() -> Adapter:
    from repro.targets.sglang import SGLangAdapter

    return SGLangAdapter()


def _builtin_vllm() -> Adapter:
    from repro.targets.vllm import VLLMAdapter

    return VLLMAdapter()


def _load_entry_points() -> None:
    global _entry_points_loaded, _generation
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    try:
        eps = metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception:  # a broken installation must not stop the built-in adapters
        return
    for ep in eps:
        if ep.name in _factories:
            continue  # code registration and the built-ins win over a duplicate entry point

        def factory(ep=ep) -> Adapter:
            obj = ep.load()
            return obj() if callable(obj) else obj

        _factories[ep.name] = factory
        _generation += 1


def register(name: str, factory: AdapterFactory, *, replace: bool = False) -> None:
    """Register an adapter factory under ``name`` (the scenario's ``server.adapter``).

    Args:
        name: engine name, e.g. ``vllm``.
        factory: called with no arguments; returns an :class:`~repro.targets.base.Adapter`.
        replace: allow replacing an existing registration (otherwise an error).
    Raises:
        ValueError: ``name`` is empty or already registered (and ``replace`` is False).
    """
    global _generation
    if not name:
        raise ValueError("register: the adapter name must not be empty")
    with _lock:
        _load_entry_points()
        if name in _factories and not replace:
            raise ValueError(f"adapter {name!r} is already registered; pass replace=True to replace it")
        _factories[name] = factory
        _generation += 1


def unregister(name: str) -> None:
    """Remove a registration (tests); unknown names are ignored."""
    global _generation
    with _lock:
        if _factories.pop(name, None) is not None:
            _generation += 1


def known_adapters() -> list[str]:
    """The registered adapter names, sorted."""
    with _lock:
        _load_entry_points()
        return sorted(_factories)


def get_adapter(name: Optional[str] = None) -> Adapter:
    """The adapter registered under ``name`` (default :data:`DEFAULT_ADAPTER`).

    Raises:
        UnknownAdapterError: no such adapter; the message names the known ones and how to register one.
    """
    name = name or DEFAULT_ADAPTER
    with _lock:
        _load_entry_points()
        factory = _factories.get(name)
        known = sorted(_factories)
    if factory is None:
        raise UnknownAdapterError(
            f"unknown adapter {name!r}; known adapters: {', '.join(known) or 'none'} (an engine package registers "
            f"one in the {ENTRY_POINT_GROUP!r} entry-point group)"
        )
    return factory()


def all_adapters() -> dict[str, Adapter]:
    """One instance of every registered adapter, by name (cached until the registry changes)."""
    global _instances
    with _lock:
        _load_entry_points()
        gen = _generation
        if _instances[0] == gen:
            return dict(_instances[1])
        factories = dict(_factories)
    out: dict[str, Adapter] = {}
    for n in sorted(factories):
        try:
            out[n] = factories[n]()
        except Exception:  # a broken third-party adapter must not break reading another engine's dumps
            continue
    with _lock:
        if _generation == gen:
            _instances = (gen, out)
    return dict(out)


def parse_title_any(title: str) -> Optional[tuple[str, RankTitle]]:
    """Parse a process title with every registered adapter: ``(adapter name, RankTitle)`` of the first that reads
    it (the default adapter first, then by name), else None."""
    adapters = all_adapters()
    order = sorted(adapters, key=lambda n: (n != DEFAULT_ADAPTER, n))
    for n in order:
        try:
            t = adapters[n].parse_title(title)
        except Exception:
            t = None
        if t is not None:
            return n, t
    return None


def rank_title_any(title: str) -> Optional[RankTitle]:
    """:func:`parse_title_any` without the adapter name."""
    hit = parse_title_any(title)
    return None if hit is None else hit[1]


def is_engine_title(title: str) -> bool:
    """True when some registered adapter's process-title namespace holds ``title`` (e.g. ``sglang::detokenizer``):
    a process of a known engine that is not a rank."""
    for a in all_adapters().values():
        prefix = a.title_namespace
        if prefix and (title or "").strip().startswith(prefix):
            return True
    return False


def combined_frame_rules() -> FrameRules:
    """Every registered adapter's :class:`FrameRules`, merged (default adapter first): for dumps of any engine."""
    global _combined
    adapters = all_adapters()
    with _lock:
        gen = _generation
        if _combined[0] == gen and _combined[1] is not None:
            return _combined[1]
    rules = FrameRules()
    for n in sorted(adapters, key=lambda n: (n != DEFAULT_ADAPTER, n)):
        rules = rules.merged(adapters[n].frame_rules)
    with _lock:
        if _generation == gen:
            _combined = (gen, rules)
    return rules


def engine_dump_rules_all() -> list:
    """Every registered adapter's :class:`~repro.targets.base.EngineDumpRules` (default adapter first, each once):
    the patterns of the engines' own state dumps that ``repro analyze`` reads."""
    adapters = all_adapters()
    out: list = []
    for n in sorted(adapters, key=lambda n: (n != DEFAULT_ADAPTER, n)):
        rules = adapters[n].engine_dump_rules
        if rules is not None and rules not in out:
            out.append(rules)
    return out


_factories[DEFAULT_ADAPTER] = _builtin_sglang
_factories["vllm"] = _builtin_vllm  # also the `repro.adapters` entry point of pyproject.toml (an editable install
# made before that entry was added does not list it)
