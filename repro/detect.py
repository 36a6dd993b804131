"""The detect stage of a run: detectors polled while a burst runs, each able to end it with a verdict.

The session (``repro.runner.Session.drive``) calls every detector's :meth:`Detector.poll` once per poll interval
(``repro.runner.POLL_S``, 0.2 s) with a :class:`DetectContext`, in order, until one returns a deciding
:class:`Detection` or the burst ends. The built-in ``repro.detectors.StallDetector`` is today's rule (no progress for
``stall_s`` → capture every rank twice → the DEADLOCKED rule of ``repro.verdict.judge_stall``). A second detector
(the live ledger proof) plugs in the same way::

    class LedgerProofDetector:
        name = "ledger-proof"
        def start(self, ctx): ...               # the burst is about to start: open the ledgers, remember offsets
        def poll(self, ctx): ...                # cheap; return None, or Detection(decided=True, verdict=...)
        def stop(self, ctx): ...                # the burst ended (also after another detector decided)

and is added by ``repro.detectors.default_detectors`` (or passed to ``Session(..., detectors=...)``). Rules:

- ``poll`` must be cheap when it has nothing to do (it runs every 0.2 s) and must not raise for bad input (say so
  in a non-deciding Detection's ``reason`` instead); ``KeyboardInterrupt`` passes through.
- A non-deciding Detection is kept as the detector's latest word: its ``analysis`` becomes the run's analysis when
  nothing decides, and its ``reason`` is quoted if the budget ends (``budget of N s ended without a verdict (4 of 8 requests answered, 4 outstanding with no progress for 171 s): …``).
- ``record`` (a JSON-able dict) is appended to ``stalls.json`` of the run folder when given, with the detector's
  name; ``evidence`` (file name → JSON-able object) is written into the run folder.

This module renders nothing and starts no process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Protocol, Sequence, runtime_checkable

from repro.verdict import Verdict


@dataclass
class DetectContext:
    """What a detector may look at while a burst runs (read it; do not change it).

    Attributes:
        rank_pids: rank -> pid of every rank process of the server.
        expected_ranks: every rank the server has.
        run_dir: the variant's evidence folder (``repro.evidence.EvidenceDir``: ``stacks_dir``, ``write_json`` …).
        injector_dir: the session's injector folder (fire logs, ledgers).
        plan: the session's plan (``faulthandler_signal``, ``ledger``, …).
        stall_s: the scenario's stall threshold in seconds.
        native: py-spy ``--native``.
        state: the burst's latest ``repro.driver.DriverState`` (set before each poll).
        now: ``time.time()`` of this poll.
        t_burst: ``time.time()`` when the burst started.
    """

    rank_pids: Mapping[int, int]
    expected_ranks: Sequence[int]
    run_dir: Any
    injector_dir: Optional[Path]
    plan: Mapping[str, Any]
    stall_s: float
    native: bool = False
    state: Any = None
    now: float = 0.0
    t_burst: float = 0.0
    observe: Any = None  # progress callback ``(event, data)`` of the session (None: no progress events)
    server_log: Optional[Path] = None  # the server's log (``server.log``): why a rank died is read there

    def emit(self, event: str, data: dict) -> None:
        """Send a progress event (``capture``, …) to the session's observer, if any."""
        if self.observe is not None:
            self.observe(event, data)


@dataclass(frozen=True)
class Detection:
    """A detector's word on the burst so far.

    Attributes:
        detector: the detector's name.
        decided: True ends the burst with ``verdict`` (no later detector is polled).
        verdict: the verdict when decided (e.g. DEADLOCKED), else None.
        analysis: a ``repro.analysis.Analysis`` to report (the deciding capture's, or the latest one).
        reason: one sentence (also when not decided: why it is not a deadlock yet).
        record: appended to the run folder's ``stalls.json`` (with ``detector``); None = nothing to record.
        evidence: store member (``repro.evidence.Layout.PROOF`` …) → JSON-able object written into the run folder.
    """

    detector: str
    decided: bool
    verdict: Optional[Verdict] = None
    analysis: Any = None
    reason: str = ""
    record: Optional[dict] = None
    evidence: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class Detector(Protocol):
    """One detector of the detect stage (see the module docstring)."""

    name: str

    def start(self, ctx: DetectContext) -> None:
        """The burst is about to start (after arming)."""

    def poll(self, ctx: DetectContext) -> Optional[Detection]:
        """Look once; None when there is nothing new to say."""

    def stop(self, ctx: DetectContext) -> None:
        """The burst ended (by a verdict, the budget, completion or an error)."""


class ScopedDetector:
    """One server's detector inside a stack of several (``repro.pd``): ``inner`` sees only that server's ranks,
    injector folder (ledgers), plan, log and ``servers/<server>/`` of the run folder; everything else of the burst's
    :class:`DetectContext` (state, times, observer) is the stack's.

    Args:
        inner: a detector of :func:`default_detectors` (rank death, ledger proof).
        server: the server's name (``prefill``); its Detection's record gets ``server``.
        rank_pids / injector_dir / plan / server_log: that server's.
        run_dir_for: run folder → that server's ``servers/<server>/`` view (a ``repro.evidence.EvidenceDir``).
    """

    def __init__(self, inner: Any, server: str, rank_pids: Mapping[int, int], injector_dir: Optional[Path],
                 plan: Mapping[str, Any], server_log: Optional[Path], run_dir_for: Any) -> None:
        self.inner, self.server = inner, server
        self.name = inner.name
        self.rank_pids, self.injector_dir, self.plan, self.server_log = dict(rank_pids), injector_dir, plan, server_log
        self.run_dir_for = run_dir_for
        self._ctx: Optional[DetectContext] = None
        self.last_analysis: Any = None  # the latest analysis its detector gave (the deciding capture's)

    def scoped(self, ctx: DetectContext) -> DetectContext:
        """``ctx`` narrowed to this server (the same object across one burst, its state and times refreshed)."""
        import dataclasses

        if self._ctx is None or self._ctx.t_burst != ctx.t_burst:
            self._ctx = dataclasses.replace(ctx, rank_pids=self.rank_pids, expected_ranks=sorted(self.rank_pids),
                                            run_dir=self.run_dir_for(ctx.run_dir), injector_dir=self.injector_dir,
                                            plan=self.plan, server_log=self.server_log)
        self._ctx.state, self._ctx.now = ctx.state, ctx.now
        return self._ctx

    def start(self, ctx: DetectContext) -> None:
        self._ctx = None
        self.last_analysis = None
        self.inner.start(self.scoped(ctx))

    def poll(self, ctx: DetectContext) -> Optional[Detection]:
        sc = self.scoped(ctx)
        det = self.inner.poll(sc)
        if det is None:
            return None
        for member, obj in det.evidence.items():  # the server's own folder gets it too (its REPORT.md reads it)
            try:
                sc.run_dir.member(member).write(obj)
            except Exception:
                pass
        if det.analysis is not None:
            self.last_analysis = det.analysis
        record = {**det.record, "server": self.server} if det.record is not None else None
        return Detection(det.detector, det.decided, det.verdict, det.analysis, det.reason, record, det.evidence)

    def stop(self, ctx: DetectContext) -> None:
        self.inner.stop(self.scoped(ctx))

    def final_verdict(self, verdict: Verdict, ctx: Any = None) -> Verdict:
        """The inner detector's word after the burst, on this server's records."""
        fv = getattr(self.inner, "final_verdict", None)
        return fv(verdict, self.scoped(ctx)) if callable(fv) and ctx is not None else verdict

    def __getattr__(self, name: str) -> Any:  # timings, proof, deaths, captures … of the inner detector
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
