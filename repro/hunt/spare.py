"""The hunt's spare trial server (``repro hunt --spare``): after a hang the hunt swaps to a server launched in the
background instead of restarting."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

from repro.hunt.report import HuntLog


class SparedSession:
    """A hunt's trial server with a spare: two :class:`repro.runner.Session` over two plans of the same trials.

    Looks like one session to :func:`repro.runner.run_variants` (``p``, ``server``, ``rank_pids``, ``healthy_s``,
    ``start``, ``restart``, ``drive``, ``stop``, ``close_drivers``; ``p`` is the active server's plan, so each
    trial's evidence, log slice and injector records come from the server it ran on). Once the active server is
    healthy the other session's server is launched in the background (``Session.launch``, only while
    ``want_spare()``); after a hang or a crash ``restart`` swaps: the hung server is torn down in a thread while
    the spare's remaining start-up is waited for (it must answer health, map its ranks and resolve its sites like
    any fresh server: a fresh process tree, nothing of the hung one reused), and a new spare is launched on the
    freed plan. With no spare launched, ``restart`` stops and starts as a plain session does.

    The two servers run at once only while one of them starts or idles; the launcher gives each its own ports and
    HiCache storage folder. ``stop`` ends both (also on KeyboardInterrupt: the teardown thread is joined first).

    Args:
        active, other: sessions over two prepared plans of the same trial variants (``runner.prepare`` twice).
        want_spare: asked before each launch of a spare (e.g. "a trial is left after the next one, budget left").
        log: the hunt log: one ``spare`` event per swap or failed spare launch.
    """

    def __init__(self, active: Any, other: Any, want_spare: Callable[[], bool], log: Optional[HuntLog] = None) -> None:
        self.active, self.other = active, other
        self.want_spare = want_spare
        self.log = log
        self.spare_launched = False
        self.stopper: Optional[threading.Thread] = None
        self.swaps: list[dict] = []  # per swap: seconds blocked waiting for the spare, its start-up since launch
        self.restarts = 0  # plain restarts (no spare was launched to swap to)

    @property
    def p(self) -> Any:
        return self.active.p

    @property
    def server(self) -> Any:
        return self.active.server

    @property
    def rank_pids(self) -> dict:
        return self.active.rank_pids

    @property
    def healthy_s(self) -> Optional[float]:
        return self.active.healthy_s

    def _event(self, **data: Any) -> None:
        if self.log is not None:
            self.log.event("spare", **data)

    def _join_stopper(self) -> None:
        if self.stopper is not None:
            self.stopper.join()
            self.stopper = None

    def _launch_spare(self) -> None:
        if self.spare_launched or not self.want_spare():
            return
        self._join_stopper()  # the other plan's previous server is fully gone before its plan is reused
        failed = self.other.launch()
        if failed is not None:
            self.other.stop()
            self._event(action="launch_failed", reason=failed.reason)
            return
        self.spare_launched = True

    def start(self) -> Optional[Any]:
        """Start the active server (waits healthy), then launch the spare. Returns None or the failure verdict."""
        failed = self.active.start()
        if failed is None:
            self._launch_spare()
        return failed

    def restart(self) -> Optional[Any]:
        """After a hang or a crash: swap to the spare (or, with none launched, restart the active server).

        Returns:
            None once the new active server is healthy, else the INCONCLUSIVE verdict saying why it is not.
        """
        old = self.active
        if not self.spare_launched:
            self.restarts += 1
            failed = old.restart()
        else:
            self.active, self.other, self.spare_launched = self.other, old, False
            self.stopper = threading.Thread(target=old.stop, name="repro-hunt-teardown")
            self.stopper.start()
            t0 = time.time()
            failed = self.active.start()  # the rest of its start-up, checked like any fresh server
            self.swaps.append({"waited_s": round(time.time() - t0, 1), "healthy_s": round(self.active.healthy_s or 0.0, 1),
                               "ok": failed is None})
            self._event(action="swap", evidence=str(self.active.p.evidence.path), **self.swaps[-1],
                        **({"reason": failed.reason} if failed is not None else {}))
        if failed is None:
            self._launch_spare()
        return failed

    def drive(self, *a: Any, **kw: Any) -> Any:
        return self.active.drive(*a, **kw)

    def stop(self) -> list:
        """End both servers (idempotent); returns what was left running of either."""
        self._join_stopper()
        self.spare_launched = False
        return [*self.active.stop(), *self.other.stop()]

    def close_drivers(self) -> None:
        self.active.close_drivers()
        self.other.close_drivers()

    def summary(self) -> str:
        """One line for HUNT.md: swaps to the spare (and the seconds waited for it in all), plain restarts."""
        waited = sum(x["waited_s"] for x in self.swaps)
        return (f"{len(self.swaps)} swap(s) to the spare server (waited {waited:.0f} s in all for it to be healthy), "
                f"{self.restarts} plain restart(s)")
