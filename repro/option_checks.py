"""Checks of numeric command-line options that every verb shares (one line naming the flag; the verb raises it as
its own input error, exit 2).

``nan`` and ``inf`` parse as floats and slip past ``<= 0`` tests (``nan <= 0`` is False): a budget of ``nan``
minutes made every hunt trial NOT RUN, an ``inf`` interval a watch that never probes again.
"""

from __future__ import annotations

import math


def positive_number_problem(flag: str, value: object, unit: str) -> str:
    """"" when ``value`` is a finite number > 0, else one line naming ``flag``, what was expected and what it got.

    Args:
        flag: the option as typed (``--budget-min``); unit: in words (``minutes``, ``seconds``).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return f"{flag} must be a finite number of {unit} > 0 (got {value})"
    return ""


def non_negative_number_problem(flag: str, value: object, unit: str) -> str:
    """As :func:`positive_number_problem`, for a value that may be 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return f"{flag} must be a finite number of {unit} >= 0 (got {value})"
    return ""
