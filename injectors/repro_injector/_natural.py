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
  calls — on a method site, calls on the same object only (one request's sender, one event; the other objects'
  polls get their own answers) — without calling the original unless ``call_original``. With ``only_done`` the poll is called and one whose
  true answer is not done — equal to ``value``, or, when ``done`` is given, not equal to ``done`` (a status poll:
  sglang's ``KVPoll.Success`` = 4) — is no fire and no match (:func:`take_back`), so occurrence ``first`` / ``nth``
  counts the polls that would have said done — "the event completed on this rank and its poll missed it";
- ``miss``: a storage call (a backend's exists / get / set) runs, and its answer says that the pages from index
  ``keep_pages`` on are not there (:func:`cut_answer`): on a query or a read "not stored", on a write the backend's
  failure answer. With ``only_hits`` (default) a call that found no more than ``keep_pages`` pages is no fire (there
  is nothing to miss): its match is not counted either, so occurrence ``first`` / ``nth`` counts the calls that found
  pages — "the first request whose pages this rank's storage holds";
- ``fail``: a storage call reports failure without doing its work (nothing is read or written): it answers
  ``answer`` (``false`` / ``none`` / ``zero``), or with ``per_key`` a list of it, one per key of the call's first
  list argument (the failure answers of sglang 0.5.23's ``HiCacheFile.batch_set`` / ``batch_get``).

``miss`` and ``fail`` are natural only where the site is an environment boundary (a storage backend's method: its
answer comes from outside the replicated state); the injector cannot tell, the catalogue that names the site does.

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
    "miss": "natural", "fail": "natural", "return_value": "forced", "skip": "forced", "state": "forced", "extra_collective": "forced", "none": "observe",
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


def run_natural(site: "Site", self_obj: Any, call: Callable[[], Any], args: tuple = ()) -> Any:
    """Run the natural action of ``site`` around ``call`` (the original); ``args``: the call's positional arguments
    (``self`` first for a method). See the module docstring."""
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
        site.pending_self = id(self_obj) if self_obj is not None else None
        if a.get("only_done"):
            true_answer = call()
            want = a.get("done")
            done = _equal(true_answer, want) if want is not None else not _equal(true_answer, a.get("value", False))
            if not done:
                return take_back(site, true_answer, f"{_short(true_answer)}: not done yet, nothing to hold")
            site.pending_left = int(a.get("polls", 1)) - 1
            site.rt.event("held_done", id=site.id, true_answer=_short(true_answer), thread=threading.current_thread().name)
            return hold_poll(site, lambda: None)
        site.pending_left = int(a.get("polls", 1)) - 1
        return hold_poll(site, call)
    if kind == "miss":
        return miss(site, call)
    if kind == "fail":
        return fail(site, call, args)
    raise ValueError(f"{site.id}: {kind!r} is not a natural action (expected one of {sorted(NATURAL_KINDS)})")


def pages_found(answer: Any) -> int:
    """How many pages (from the first) a storage answer says are there: an int is that count, a bool 1 or 0, a
    list / tuple its leading items that are neither None nor False, None 0, anything else (a tensor read) 1."""
    if isinstance(answer, bool):
        return int(answer)
    if isinstance(answer, int):
        return answer
    if isinstance(answer, (list, tuple)):
        n = 0
        for x in answer:
            if x is None or x is False:
                break
            n += 1
        return n
    return 0 if answer is None else 1


def cut_answer(answer: Any, keep_pages: int) -> Any:
    """The storage answer ``answer`` with the pages from index ``keep_pages`` on not there.

    An int (a count of leading pages found, ``batch_exists``) → at most ``keep_pages``; a list / tuple (one entry
    per key) → entries from ``keep_pages`` on become False (a bool list) or None (anything else, e.g. tensors read);
    a bool (one answer for the call: ``exists``, ``set``, ``batch_set``) → False when ``keep_pages`` is 0, else
    unchanged; any other answer (the tensor of a ``get``) → None when ``keep_pages`` is 0, else unchanged.
    """
    if isinstance(answer, bool) or not isinstance(answer, (int, list, tuple)):
        return answer if keep_pages > 0 or answer is None else (False if isinstance(answer, bool) else None)
    if isinstance(answer, int):
        return min(answer, keep_pages)
    out = [x if i < keep_pages else (False if isinstance(x, bool) else None) for i, x in enumerate(answer)]
    return tuple(out) if isinstance(answer, tuple) else out


def _keys_of(args: tuple) -> Optional[list]:
    """The call's first list / tuple positional argument after ``self`` (a storage call's keys), or None."""
    for x in args:
        if isinstance(x, (list, tuple)):
            return list(x)
    return None


def miss(site: "Site", call: Callable[[], Any]) -> Any:
    """Call the storage, then answer that the pages from ``keep_pages`` on are not there (:func:`cut_answer`); a
    ``missed`` event records the pages found and answered. With ``only_hits`` (default True) a call whose answer
    has nothing to cut is no fire and no match (``fire_inapplicable``), so the occurrence gate counts only calls
    that found pages."""
    a = site.action
    keep = int(a.get("keep_pages") or 0)
    true_answer = call()
    answer = cut_answer(true_answer, keep)
    found, told = pages_found(true_answer), pages_found(answer)
    if told >= found and a.get("only_hits", True):
        return take_back(site, true_answer, f"{found} page(s) found: nothing to miss")
    site.rt.event("missed", id=site.id, found_pages=found, answered_pages=told, keep_pages=keep,
                  thread=threading.current_thread().name)
    return answer


def take_back(site: "Site", answer: Any, why: str) -> Any:
    """Undo the fire (and match) just counted for a call with nothing to change, write ``fire_inapplicable`` (``n``:
    the fire event it takes back; the harness's records drop it) and return the call's own ``answer``."""
    with site.lock:
        n = site.counts.fired
        site.counts.fired -= 1
        site.counts.matched -= 1
    site.rt.dirty = True
    site.rt.event("fire_inapplicable", id=site.id, n=n, returned=why)
    site.rt.write_counts()
    return answer


def _equal(a: Any, b: Any) -> bool:
    """``a == b`` as a plain truth value; False when the comparison raises or is not a bool (a tensor)."""
    try:
        r = a == b
        return r if isinstance(r, bool) else False
    except Exception:
        return False


def _short(x: Any) -> str:
    return repr(x)[:80]


_FAIL_ANSWERS: Dict[str, Any] = {"false": False, "none": None, "zero": 0}


def fail(site: "Site", call: Callable[[], Any], args: tuple) -> Any:
    """Answer the backend's failure (``answer``; with ``per_key`` one per key of the call's first list argument)
    without calling it: nothing is read or written. A ``failed`` event records the keys and the answer."""
    a = site.action
    value = _FAIL_ANSWERS[str(a.get("answer") or "false")]
    keys = _keys_of(args)
    if a.get("per_key"):
        if keys is None:
            raise ValueError(f"{site.id}: fail with per_key needs a call whose first list argument holds its keys")
        answer: Any = [value] * len(keys)
    else:
        answer = value
    site.rt.event("failed", id=site.id, keys=None if keys is None else len(keys), answer=repr(answer)[:80],
                  thread=threading.current_thread().name)
    return answer


def hold_poll(site: "Site", call: Callable[[], Any]) -> Any:
    """One held poll of a ``pending`` action: answer not-done (``value``), calling the original only when asked."""
    a = site.action
    site.pending_held += 1
    if a.get("call_original") or a.get("only_done"):
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
    so that the injected exception ending the thread (itself, or another exception raised from it: sglang 0.5.23's PD
    ``transfer_worker`` re-raises a RuntimeError) is told apart from the thread ending on its own."""
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
        elif args.thread is th and _caused_by(args.exc_value, exc):  # caught, then re-raised as another exception
            killed["by"] = type(exc).__name__
            killed["as"] = type(args.exc_value).__name__
        prev_hook(args)

    threading.excepthook = hook
    _watch_fault(site, th, float(a.get("observe_s", 5.0)), killed)
    raise exc


def _caused_by(err: Optional[BaseException], exc: BaseException, depth: int = 8) -> bool:
    """Whether ``exc`` is in ``err``'s ``__cause__`` / ``__context__`` chain (at most ``depth`` links)."""
    while err is not None and depth > 0:
        if err is exc:
            return True
        err = err.__cause__ or err.__context__
        depth -= 1
    return False


def _watch_fault(site: "Site", th: threading.Thread, observe_s: float, killed: Dict[str, Any]) -> None:
    def watch() -> None:
        _sleep(observe_s)
        alive = th.is_alive()
        again = site.fault_reentries
        if killed.get("as"):
            outcome = f"thread died (the injected {killed['by']} re-raised as {killed['as']})"
        elif killed:
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
