"""Environment nemeses (*natural* actions): what the environment can do to one rank without touching the engine's
own bookkeeping. Each runs from :meth:`repro_injector._site.Site.run` when its site fires on the gated rank:

- ``delay``: the calling thread sleeps ``delay_s`` (only that thread; the rank's other threads go on);
- ``stop``: the whole rank process is stopped (SIGSTOP) and continued (SIGCONT) ``stop_s`` later by a helper
  process (every thread of the rank stops, unlike ``delay``);
- ``clock``: from this fire on, the process's ``time.monotonic`` / ``time.time`` (and the other names listed) read
  ``step_s`` seconds later, plus ``skew`` extra seconds per real second since the fire, for ``for_s`` real seconds
  (0 = until exit). Code that bound a clock function before the fire (``from time import monotonic``) keeps the real
  one; the injector's own ledger, digest and timers use the real functions saved in ``_proc`` / ``_ledger``;
- ``fault``: the call raises ``exception`` once (before calling the original, or after it ran); ``observe_s`` real
  seconds later a ``fault_outcome`` event says what happened to the thread (alive, and whether it called the site
  again: it caught the exception and went on, or it died, or it is alive but never came back);
- ``pending``: a completion poll answers not-done (``value``, default False) for ``polls`` consecutive matching
  calls, without calling the original unless ``call_original``.

The labels: :data:`NATURE` (``natural`` / ``forced`` / ``observe``); a plan's action may carry ``nature`` (e.g.
``control``) which wins. Stdlib only (``subprocess`` for the stop helper); never imports ``repro``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional

from ._proc import _monotonic, _sleep, _wall

if TYPE_CHECKING:
    from ._site import Site

NATURE = {
    "delay": "natural", "stop": "natural", "clock": "natural", "fault": "natural", "pending": "natural",
    "return_value": "forced", "skip": "forced", "state": "forced", "extra_collective": "forced", "none": "observe",
}
NATURAL_KINDS = frozenset(k for k, v in NATURE.items() if v == "natural")

# the clock functions a ``clock`` action may shift, and whether each returns nanoseconds (an int)
CLOCKS: Dict[str, bool] = {"monotonic": False, "time": False, "perf_counter": False,
                           "monotonic_ns": True, "time_ns": True, "perf_counter_ns": True}
_REAL_CLOCKS: Dict[str, Callable[[], Any]] = {name: getattr(time, name) for name in CLOCKS}
STOP_WAIT_S = 30.0  # seconds the stop helper waits for the rank to be stopped before it continues it anyway
_EXCEPTIONS = {"RuntimeError": RuntimeError, "OSError": OSError, "TimeoutError": TimeoutError,
               "ConnectionError": ConnectionError, "ValueError": ValueError}


def nature_of(action: Dict[str, Any]) -> str:
    """``natural``, ``forced``, ``observe`` or the plan's own ``nature`` (e.g. ``control``) for an action dict."""
    return str(action.get("nature") or NATURE.get(str(action.get("kind", "none")), "forced"))


class _ClockShift:
    """The process-wide shift of the clock functions (one per process; the latest ``clock`` fire wins)."""

    def __init__(self) -> None:
        self.t0 = 0.0  # real monotonic time of the fire
        self.step_s = 0.0
        self.skew = 0.0
        self.until = 0.0  # real monotonic time the shift ends (0: never)
        self.installed: Dict[str, Callable[[], Any]] = {}

    def offset_s(self) -> float:
        now = _monotonic()
        if self.until and now >= self.until:
            return 0.0
        return self.step_s + self.skew * (now - self.t0)

    def install(self, names: Any, step_s: float, skew: float, for_s: float) -> Dict[str, Any]:
        self.t0 = _monotonic()
        self.step_s, self.skew = float(step_s), float(skew)
        self.until = self.t0 + float(for_s) if for_s else 0.0
        for name in names:
            if name in self.installed:
                continue
            real = _REAL_CLOCKS[name]
            if CLOCKS[name]:
                def shifted(real: Any = real) -> int:
                    return real() + int(SHIFT.offset_s() * 1e9)
            else:
                def shifted(real: Any = real) -> float:
                    return real() + SHIFT.offset_s()
            shifted.__name__ = shifted.__qualname__ = f"repro_clock[{name}]"
            setattr(time, name, shifted)
            self.installed[name] = shifted
        return {"clocks": sorted(self.installed), "step_s": self.step_s, "skew": self.skew, "for_s": float(for_s or 0)}

    def restore(self) -> None:
        """Put the real functions back (tests; the harness restarts servers instead)."""
        for name in list(self.installed):
            setattr(time, name, _REAL_CLOCKS[name])
            del self.installed[name]


SHIFT = _ClockShift()


def run_natural(site: "Site", self_obj: Any, call: Callable[[], Any]) -> Any:
    """Run the natural action of ``site`` around ``call`` (the original); see the module docstring."""
    kind = site.kind
    a = site.action
    if kind == "delay":
        _sleep(float(a.get("delay_s", 0)))
        return call()
    if kind == "stop":
        stop_self(site, float(a["stop_s"]))
        return call()
    if kind == "clock":
        names = list(a.get("clocks") or ["monotonic", "time"])
        info = SHIFT.install(names, float(a.get("step_s") or 0), float(a.get("skew") or 0), float(a.get("for_s") or 0))
        site.rt.event("clock_shifted", id=site.id, **info)
        return call()
    if kind == "fault":
        return fault(site, call)
    if kind == "pending":
        site.pending_left = int(a.get("polls", 1)) - 1
        return hold_poll(site, call)
    raise ValueError(f"{site.id}: {kind!r} is not a natural action (expected one of {sorted(NATURAL_KINDS)})")


def hold_poll(site: "Site", call: Callable[[], Any]) -> Any:
    """One held poll of a ``pending`` action: answer not-done (``value``), calling the original only when asked."""
    a = site.action
    site.pending_held += 1
    if a.get("call_original"):
        call()
    if site.pending_left <= 0:
        site.rt.event("pending_done", id=site.id, polls_held=site.pending_held,
                      thread=threading.current_thread().name)
    return a.get("value", False)


def stop_self(site: "Site", stop_s: float) -> None:
    """Stop this whole process with SIGSTOP; a helper (``sh``, its own session) sends SIGCONT ``stop_s`` seconds after
    it saw the process stopped.

    The helper is started first, so the stop always ends; its exit is waited for by a daemon thread (no zombie) and
    recorded as ``stop_helper_exit``. Raises OSError when the helper cannot start (then nothing was stopped).
    """
    pid = os.getpid()
    # the helper counts stop_s from the moment the rank is really stopped (state T in /proc/<pid>/stat), so a loaded
    # box that delays the SIGSTOP never shortens the stop; it gives up waiting after STOP_WAIT_S and continues anyway
    script = (f"n=0; while [ \"$(sed 's/.*) //' /proc/{pid}/stat | cut -c1)\" != T ] && [ $n -lt {int(STOP_WAIT_S * 100)} ]; "
              f"do sleep 0.01; n=$((n+1)); done; sleep {stop_s:.3f}; kill -CONT {pid}")
    helper = subprocess.Popen(["/bin/sh", "-c", script], start_new_session=True,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def reap() -> None:
        rc = helper.wait()
        site.rt.event("stop_helper_exit", id=site.id, returncode=rc)

    threading.Thread(target=reap, name="repro-stop-helper", daemon=True).start()
    t0 = _monotonic()
    os.kill(pid, signal.SIGSTOP)  # this thread stops here with all the others, until the helper's SIGCONT
    site.rt.event("stopped", id=site.id, stop_s=stop_s, stopped_s=round(_monotonic() - t0, 3), helper_pid=helper.pid)


def fault(site: "Site", call: Callable[[], Any]) -> Any:
    """Raise ``exception`` once in the calling thread (``when`` = before: instead of the call; after: once it ran)
    and watch that thread for ``observe_s`` seconds (``fault_outcome`` event). ``threading.excepthook`` is chained
    so that the injected exception ending the thread is told apart from the thread ending on its own."""
    a = site.action
    exc_type = _EXCEPTIONS.get(str(a.get("exception") or "RuntimeError"), RuntimeError)
    th = threading.current_thread()
    site.fault_thread = th.ident
    site.fault_reentries = 0
    if a.get("when", "before") == "after":
        call()
    exc = exc_type(str(a.get("message") or f"repro injector: injected fault ({site.id})"))
    killed: Dict[str, Any] = {}
    prev_hook = threading.excepthook

    def hook(args: Any) -> None:
        if args.exc_value is exc:
            killed["by"] = type(exc).__name__
        prev_hook(args)

    threading.excepthook = hook
    _watch_fault(site, th, float(a.get("observe_s", 5.0)), killed)
    raise exc


def _watch_fault(site: "Site", th: threading.Thread, observe_s: float, killed: Dict[str, Any]) -> None:
    def watch() -> None:
        _sleep(observe_s)
        alive = th.is_alive()
        again = site.fault_reentries
        if killed:
            outcome = "thread died"  # the injected exception reached the thread's top
        elif again:
            outcome = "caught: the thread called the site again" + ("" if alive else " (it has ended since)")
        elif alive:
            outcome = "caught or blocked: alive, never called the site again"
        else:
            outcome = "ended without calling the site again"
        site.rt.event("fault_outcome", id=site.id, thread=th.name, alive=alive, reentries=again, outcome=outcome,
                      died_of_fault=bool(killed), observe_s=observe_s, time_checked=_wall())

    threading.Thread(target=watch, name="repro-fault-watch", daemon=True).start()


def note_entry(site: "Site") -> None:
    """Count a later call of a faulted site from the faulted thread (``fault_outcome``'s ``reentries``)."""
    if site.fault_thread is not None and threading.get_ident() == site.fault_thread:
        site.fault_reentries += 1


def thread_name() -> Optional[str]:
    """The calling thread's name (every fire event records it: which thread a nemesis hit)."""
    try:
        return threading.current_thread().name
    except Exception:
        return None
