"""The SGLang adapter package (sglang 0.5.23; older releases through ``releases/``): :class:`SGLangAdapter`
(``adapter``), PD disaggregation's topology and router (``pd``), the engine's own state dumps (``dumps``), and the
per-release data (``releases/<V>.toml``, ``releases/index.toml`` + ``index.json``; schema in docs/adapters.md)."""

from repro.targets.sglang.adapter import SGLangAdapter, parse_scheduler_title

__all__ = ["SGLangAdapter", "parse_scheduler_title"]
