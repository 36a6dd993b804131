"""What a hunt needs of the harness's runs, as a protocol: prepare a plan, make its session, write a run's evidence,
read what its injector recorded, run a scenario file once (``--confirm``).

:class:`RunnerRuns` is the real one (:mod:`repro.runner`'s functions of the same names); tests pass a stand-in that
scripts the sessions. The one multi-variant loop (``repro.runner.run_variants`` / ``run_one``) drives either.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

from repro import runner


class Runs(Protocol):
    """The runs of a hunt (each method as the ``repro.runner`` function of the same name)."""

    def prepare(self, opts: Any, label_default: Optional[str] = None, variants: Optional[Sequence[str]] = None) -> Any:
        """Check a ``RunOptions`` and make its evidence folder and plan; launches nothing (raises ``RunError``)."""

    def make_session(self, p: Any, observe: Any) -> Any:
        """The session (one server, or a stack) of a prepared plan ``p``."""

    def finish_evidence(self, p: Any, opts: Any, variant: Any, evd: Any, outcome: Any, rank_pids: Any,
                        interrupted: bool) -> None:
        """Write one run's analysis, REPORT.md and, last, verdict.json into ``evd``."""

    def snapshot_session(self, p: Any, run_dir: Any) -> None:
        """Copy the session's injector records and server log into a run folder."""

    def collect_versions(self, injector_dir: Any, python: str, adapter: Any) -> dict:
        """Versions for env.json (the run's engine and its version, torch, python) from the injector's loaded markers."""

    def injection_checks(self, injector_dir: Any, variant: Any, rank_pids: Any) -> tuple:
        """(ranks loaded, ranks armed, per-injection counts by rank, the records) after the last arming."""

    def run(self, opts: Any, observe: Any) -> Any:
        """Prepare and run one scenario variant on a fresh server (a ``RunResult``)."""


class RunnerRuns:
    """The real runs: :mod:`repro.runner`."""

    def prepare(self, opts: Any, label_default: Optional[str] = None, variants: Optional[Sequence[str]] = None) -> Any:
        return runner.prepare(opts, label_default=label_default, variants=variants)

    def make_session(self, p: Any, observe: Any) -> Any:
        return runner.make_session(p, observe)

    def finish_evidence(self, p: Any, opts: Any, variant: Any, evd: Any, outcome: Any, rank_pids: Any,
                        interrupted: bool) -> None:
        runner.finish_evidence(p, opts, variant, evd, outcome, rank_pids, interrupted)

    def snapshot_session(self, p: Any, run_dir: Any) -> None:
        runner.snapshot_session(p, run_dir)

    def collect_versions(self, injector_dir: Any, python: str, adapter: Any) -> dict:
        return runner.collect_versions(injector_dir, python, adapter)

    def injection_checks(self, injector_dir: Any, variant: Any, rank_pids: Any) -> tuple:
        return runner.injection_checks(injector_dir, variant, rank_pids)

    def run(self, opts: Any, observe: Any) -> Any:
        return runner.run(opts, observe)


def default_runs() -> Runs:
    """The real runs (:class:`RunnerRuns`)."""
    return RunnerRuns()
