"""repro injector (the nemesis): scenario-driven, stack-gated collective faults inside every rank process.

Loaded by ``injectors/sitecustomize.py`` / ``usercustomize.py`` in every Python process that has ``injectors/`` on
PYTHONPATH. Inert unless ``REPRO_PLAN`` names a plan file (``repro.scenario.compile_plan``). Stdlib + torch only;
never imports ``repro``. See ``_runtime`` for what it writes, ``gate`` for the stack gate and ``resolve`` for sites.
"""

from __future__ import annotations

from typing import Any

PLAN_ENV = "REPRO_PLAN"


def activate() -> Any:
    """Start the injector in this process when ``REPRO_PLAN`` is set (idempotent, never raises).

    Returns:
        The process's ``_runtime.Runtime``, or None when inactive.
    """
    import os

    if not os.environ.get(PLAN_ENV):
        return None
    from ._runtime import activate as _activate

    return _activate()


__all__ = ["activate", "PLAN_ENV"]
