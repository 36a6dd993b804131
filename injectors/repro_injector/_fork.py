"""Opt-in: an engine's ranks forked from the launcher after its imports, instead of spawned (issue 36 item 2).

Which call to switch is the engine's, carried in the plan (``fork_ranks``: ``{"caller": "module:function",
"device": "local.attr"}``, from the adapter's ``InjectorProfile``; the injector names no engine). For SGLang the
caller is ``sglang.srt.entrypoints.engine:_set_envs_and_config``: SGLang 0.5.23 calls
``mp.set_start_method("spawn", force=True)`` there (~line 1995; checked on the testbed's 0.5.23 wheel) before
``Engine._launch_subprocesses`` starts the scheduler processes (``_launch_scheduler_processes``) and the detokenizer
(``_launch_detokenizer_subprocesses``) with ``mp.Process``. A spawned rank is a fresh interpreter that re-imports the
launcher's main module and the scheduler's (~30 s each on the 2-core box, three at a time). With
``REPRO_FORK_RANKS=1`` in the launcher's environment this module makes that one call choose ``"fork"``: the ranks
start as copies of the launcher with every module already imported (and the injector's sites already patched) and
run the same targets in the same layout (launcher + ranks + detokenizer). A plan without ``fork_ranks.caller``
(an engine that declares none) leaves every call alone.

The switch happens only when all hold, else the call goes through unchanged:

- the requested method is ``"spawn"`` and the caller is the plan's ``fork_ranks.caller`` (the launcher; never a
  rank, never another library's call);
- the caller's ``fork_ranks.device`` (a local's attribute, SGLang: ``server_args.device``) is ``"cpu"`` and CUDA is
  not initialized in this process: forking after
  CUDA/NCCL initialisation is unsafe, so a GPU launch keeps ``spawn`` and one line on stderr / ``errors.log`` says so
  (event ``fork_ranks_refused`` with the reason).

In every process forked after the switch (``os.register_at_fork``), before the rank's target runs:

- the default start method is set back to ``"spawn"``, as multiprocessing's spawn ``prepare()`` does in a spawned
  child, so a rank's own ``mp.Process`` children are spawned as before;
- the launcher's resource tracker (started at the switch, as spawn starts it at the first ``Process.start``) is the
  rank's, as it is a spawned rank's: one tracker in the tree, not one per rank;
- Python signal handlers the launcher installed after interpreter start (sglang's ``launch_phase_sigquit_handler``
  for SIGQUIT) are put back to what they were at interpreter start, which is what a spawned child has;
- the injector's own state is re-made by ``Runtime.after_fork`` (new pid files, writer threads, faulthandler file).

Around each such fork the parent holds the injector's record lock and the ledger's writer lock (``before`` hook,
released in both processes after it), so no injector thread is inside a file write when the process is copied.
The ``fork_point`` event (launcher's ``fires-<pid>.jsonl``, first ``MAX_FORK_EVENTS`` forks) lists the parent's Python
threads (``threading.enumerate``) and native threads (``/proc/self/task``: tid, name, state, wchan) at that moment.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, Dict, List, Optional

FORK_ENV = "REPRO_FORK_RANKS"
MAX_FORK_EVENTS = 8

_state: Dict[str, Any] = {"switched": False, "signals": {}, "orig": None, "forks": 0, "locks": []}


def wanted(env: Optional[Dict[str, str]] = None) -> bool:
    """True iff ``REPRO_FORK_RANKS`` is ``"1"`` in ``env`` (default ``os.environ``)."""
    return (env if env is not None else os.environ).get(FORK_ENV, "") == "1"


def _native_threads() -> List[str]:
    """``tid:comm:state:wchan`` of every thread of this process (``/proc/self/task``), Python's or not."""
    out = []
    try:
        for tid in sorted(os.listdir("/proc/self/task"), key=int):
            parts = [tid]
            for name in ("comm", "stat", "wchan"):
                try:
                    with open(f"/proc/self/task/{tid}/{name}", encoding="utf-8", errors="replace") as fh:
                        v = fh.read().strip()
                except OSError:
                    v = "?"
                parts.append(v.rsplit(")", 1)[-1].split()[0] if name == "stat" and ")" in v else v)
            out.append(":".join(parts))
    except OSError:
        pass
    return out


def _device(frame: Any, path: str) -> Any:
    """The value of ``path`` (``local.attr.attr``) in ``frame``'s locals, else None."""
    head, *rest = (path or "").split(".")
    obj = frame.f_locals.get(head) if frame is not None and head else None
    for a in rest:
        obj = getattr(obj, a, None)
    return obj


def _refusal(frame: Any, device_path: str) -> Optional[str]:
    """Why the caller at ``frame`` must keep ``spawn``, or None when forking is allowed (CPU device, no CUDA)."""
    device = _device(frame, device_path)
    if device != "cpu":
        return (f"{FORK_ENV}=1 needs --device cpu ({device_path} is {device!r}): forking ranks after CUDA/NCCL "
                "initialisation is unsafe, so this launch keeps spawn; unset REPRO_FORK_RANKS on a GPU box")
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return f"{FORK_ENV}=1 but CUDA is initialized in the launcher: keeping spawn (unset REPRO_FORK_RANKS)"
    except Exception:
        pass
    return None


def install(rt: Any) -> None:
    """Wrap ``multiprocessing.set_start_method`` in this process (see the module docstring) and register the fork
    hooks. Called by ``activate()`` only when :func:`wanted`. ``rt``: the process's ``_runtime.Runtime`` (its plan's
    ``fork_ranks`` names the call; without a caller nothing is installed)."""
    import multiprocessing

    if _state["orig"] is not None:
        return
    spec = (getattr(rt, "plan", None) or {}).get("fork_ranks") or {}
    caller = str(spec.get("caller") or "")
    if ":" not in caller:
        return
    caller_module, caller_name = caller.split(":", 1)
    device_path = str(spec.get("device") or "")
    _state["signals"] = {}
    for sig in signal.valid_signals():
        try:
            _state["signals"][sig] = signal.getsignal(sig)
        except (OSError, ValueError):
            pass
    orig = multiprocessing.set_start_method
    _state["orig"] = orig

    def repro_set_start_method(method: Any, force: bool = False) -> Any:
        f = sys._getframe(1)
        if (method == "spawn" and not _state["switched"] and f.f_code.co_name == caller_name
                and f.f_globals.get("__name__") == caller_module):
            why = _refusal(f, device_path)
            if why is None:
                _state["switched"] = True
                res = orig("fork", force=force)
                tracker = _start_resource_tracker(rt)
                rt.event("start_method", requested="spawn", used="fork", caller=caller, resource_tracker=tracker)
                return res
            rt.error(why)
            rt.event("fork_ranks_refused", reason=why)
        return orig(method, force=force)

    repro_set_start_method.__wrapped__ = orig  # type: ignore[attr-defined]
    multiprocessing.set_start_method = repro_set_start_method
    os.register_at_fork(before=lambda: _before(rt), after_in_parent=_after_parent,
                        after_in_child=lambda: _after_child(rt))


def _start_resource_tracker(rt: Any) -> Optional[int]:
    """Start multiprocessing's resource tracker in the launcher now, as the first spawn would
    (``popen_spawn_posix`` calls ``resource_tracker.getfd()``): the forked ranks inherit its fd and share it, so the
    tree keeps spawn's one tracker instead of one per rank that registers a semaphore or shared memory (measured
    on the testbed: two). Returns the tracker's pid."""
    try:
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
        return getattr(resource_tracker._resource_tracker, "_pid", None)
    except Exception as e:
        rt.error("starting the resource tracker before forking the ranks", e)
        return None


def _before(rt: Any) -> None:
    """Parent, just before a fork: record the threads alive (first forks only) and hold the injector's writer locks."""
    if not _state["switched"]:
        return
    _state["forks"] += 1
    if _state["forks"] <= MAX_FORK_EVENTS:
        try:
            py = [{"name": t.name, "daemon": t.daemon, "ident": t.ident, "native_id": getattr(t, "native_id", None)}
                  for t in threading.enumerate()]
            rt.event("fork_point", n=_state["forks"], python_threads=py, native_threads=_native_threads())
        except Exception as e:
            rt.error("fork_point record", e)
    locks = [rt._io_lock]
    led = getattr(rt, "ledger", None)
    if led is not None:
        locks.append(led._wlock)
    for lk in locks:
        lk.acquire()
    _state["locks"] = locks


def _release() -> None:
    for lk in reversed(_state["locks"]):
        try:
            lk.release()
        except RuntimeError:
            pass
    _state["locks"] = []


def _after_parent() -> None:
    if _state["switched"]:
        _release()


def _after_child(rt: Any) -> None:
    """Child of a switched fork: what a spawned child has (start method, signal handlers); the runtime's own state is
    re-made by ``Runtime.after_fork``, registered before these hooks and run before this one."""
    if not _state["switched"]:
        return
    _release()  # the child's copies of the held locks (after_fork replaced the runtime's; these are the old ones)
    _state["forks"] = 0
    try:  # a spawned child has the tracker's fd but not its pid (it is not the tracker's parent)
        from multiprocessing import resource_tracker

        if getattr(resource_tracker._resource_tracker, "_fd", None) is not None:
            resource_tracker._resource_tracker._pid = None
    except Exception:
        pass
    orig = _state["orig"]
    try:
        orig("spawn", force=True)
    except Exception as e:
        rt.error("resetting the start method in a forked rank", e)
    restored: list = []
    failed: dict = {}
    for sig, h in list(_state["signals"].items()):  # a copy: nothing another thread does can end the loop early
        if h is None:
            continue
        try:
            if signal.getsignal(sig) is not h:
                signal.signal(sig, h)
                restored.append(_signal_name(sig))
        except OSError:
            pass  # SIGKILL / SIGSTOP and the like: no handler can be set, none was changed
        except Exception as e:  # recorded, never fatal: a rank that keeps a launcher handler is named in the event
            failed[_signal_name(sig)] = f"{type(e).__name__}: {e}"
    _state["switched"] = False  # this process is a rank now: its own forks are ordinary ones
    rt.event("forked_rank", parent=os.getppid(), signals_restored=restored, signals_not_restored=failed)


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:  # a real-time signal has no member
        return f"signal {sig}"
