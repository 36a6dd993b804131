"""Command-line interface: one verb per job; the CLI only wires the modules together and renders.

Exit codes for commands that end in a verdict: 0 ALL REQUESTS SUCCEEDED, 3 DEADLOCKED, 4 INCONCLUSIVE, 2 bad
input/usage, 1 internal error; with ``--expect``: 0 iff the verdict matches, else 5.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="repro",
    help="Reproduce, capture and explain tensor-parallel collective-desync deadlocks (SGLang).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

EXIT_SUCCESS = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_DEADLOCKED = 3
EXIT_INCONCLUSIVE = 4
EXIT_MISMATCH = 5


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
