"""The injector's runtime: plan, patching, arming and records (one injection's gate and actions: ``_site``; the
post-import hook: ``_hooks``; this process's clocks and facts: ``_proc``).

One :class:`Runtime` per process, created by ``activate()`` only when ``REPRO_PLAN`` names a plan file (the plan
contract is ``repro.scenario.compile_plan``; this package never imports ``repro``). Records (read by
``repro.injection_records``) go to the plan's ``out_dir``:

- ``loaded-<pid>.json``: written at activation (and in a forked child) and rewritten atomically when something changes (rank first seen,
  a site patched, the process title set by sglang): ``pid``, ``create_time`` (epoch seconds computed like psutil:
  boot time + ``/proc/self/stat`` starttime / CLK_TCK), ``start_ticks``, ``argv``, ``proctitle``, ``rank``,
  ``sites`` {injection id: {resolved, patched, error, alternatives_tried}}, ``python``/``torch``, the plan's
  engine (``engine``, ``engine_version``, and the version under the engine's distribution name, e.g. ``sglang``),
  ``scenario``, ``variant``, ``faulthandler``, ``time``, ``forked_from`` (the parent's pid in a forked child, else null).
- ``fires-<pid>.jsonl``, one JSON object per line, flushed per line; every line has ``event``, ``time``, ``pid``,
  ``rank``: ``armed`` / ``disarmed`` (``ids``, ``arm_seq``; ``armed`` also ``arm_file_mtime``); ``counts``
  (``arm_seq``, ``armed``, ``counts`` = {id: {entered, matched, fired, first_/last_entered, first_/last_matched,
  first_/last_fired, entered_before_poll}}); ``fire`` (``id``, ``arm_seq``, ``n``, ``action``, ``nature``
  (natural / forced / observe / control, ``_natural.nature_of``), ``thread`` (the calling thread's name), ``caller``,
  ``stack``), written before the action runs; the natural actions' own events (``_natural``): ``clock_shifted``,
  ``stopped`` / ``stop_helper_exit``, ``fault_outcome``, ``pending_done``; ``seen`` (observe mode: ``id``, ``caller``, ``line``, ``stack``,
  ``loops``; see ``Runtime.record_caller``); ``fire_done`` (``id``, ``duration_s``, ``error``); ``error`` (``id``,
  ``message``). With the ``REPRO_FORK_RANKS=1`` opt-in (``_fork``): ``start_method`` / ``fork_ranks_refused`` and
  ``fork_point`` (threads at each fork) in the launcher's log, ``forked_rank`` (``parent``, ``signals_restored``) in
  each forked rank's.
- ``errors.log``: one line per exception inside the injector (also one line on stderr).
- ``faulthandler-<pid>.txt``: all threads' stacks each time the plan's ``faulthandler_signal`` arrives (chained to a
  previous Python handler only; never to SIG_DFL, which would terminate the process).

Counts restart at each arming (a new write of a non-empty arm file) and count only calls made while armed, plus
(as ``entered`` and ``entered_before_poll``) calls made after the arm file was written but before this process
noticed it: ranks poll the file independently, up to ``arm_poll_s`` apart.

- ``ledger-<pid>.jsonl`` (+ ``ledger-<pid>.1.jsonl``): the collective ledger when the plan enables it (``_ledger``).

The injector's frames in a py-spy dump: ``repro_injected[<patched site qualname>]`` (e.g.
``repro_injected[Scheduler.run_batch]``: the wrapper's code object carries the site's name), ``Site.run``,
``Site._collective`` (file ``repro_injector/_site.py``; the wrapper's is ``_runtime.py``); the ledger's wrappers read ``repro_ledger[<api>]`` and
``repro_tick[<tick function>]`` (file ``repro_injector/_ledger.py``).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import traceback
from typing import Any, Callable, Dict, List, Optional

from . import files as _files
from . import gate as _gate
from ._hooks import _HookFinder
from ._proc import _dist, _monotonic, _proc_start, _proctitle, _sleep, _wall, record_mp_names
from . import _natural
from ._site import HOLD, Counts, Site
from .resolve import Target, resolve_in_module, split_site

PLAN_ENV = "REPRO_PLAN"
SUPPORTED_PLAN_VERSIONS = (1,)
COUNTS_INTERVAL_S = 0.2
TITLE_INTERVAL_S = 1.0


class PlanError(ValueError):
    """The plan file is missing or malformed (message names the file and the key)."""


def _dist_version(module: str, dist: str) -> Optional[str]:
    """``module.__version__`` when the module is imported, else the installed distribution's version (metadata)."""
    m = sys.modules.get(module)
    v = getattr(m, "__version__", None) if m is not None else None
    if v is None:
        try:
            from importlib.metadata import version

            v = version(dist)
        except Exception:
            v = None
    return str(v) if v is not None else None


class Runtime:
    """All injector state of one process (see the module docstring for what it writes)."""

    def __init__(self, plan: Dict[str, Any], plan_path: str) -> None:
        self.plan = plan
        self.plan_path = plan_path
        self.pid = os.getpid()
        self.out_dir = plan["out_dir"]
        self.arm_file = plan["arm_file"]
        self.poll_s = float(plan.get("arm_poll_s", 0.1))
        self.sites: List[Site] = [Site(self, s) for s in plan.get("injections") or []]
        self.by_id = {s.id: s for s in self.sites}
        self.armed: frozenset = frozenset()
        self.arm_seq = 0
        self._arm_key: Any = None
        self._next_poll = 0.0
        self._arm_lock = threading.Lock()
        self._io_lock = threading.RLock()
        self.dirty = False
        self.marker_dirty = True
        self.rank: Optional[int] = None
        self.start = _proc_start()
        self.title = ""
        self.fh_file: Any = None
        self.fh_signal: Optional[str] = None
        self.watched: Dict[str, List[Any]] = {}
        self.watch_prefixes: tuple = ()  # post-import hook also for every module under these prefixes
        self.prefix_callbacks: List[Any] = []
        self.ledger: Any = None  # _ledger.Ledger when the plan enables it
        self._fires: Any = None
        self._thread: Optional[threading.Thread] = None
        self.forked_from: Optional[int] = None  # parent's pid when this process is a fork of an injected one

    # ---- records ----------------------------------------------------------------------------------------------

    def _path(self, name: str) -> str:
        return os.path.join(self.out_dir, name)

    def error(self, msg: str, exc: Optional[BaseException] = None, inj: Optional[str] = None) -> None:
        """Record an exception inside the injector: errors.log, one stderr line, an ``error`` fire event."""
        line = f"{msg}: {type(exc).__name__}: {exc}" if exc is not None else msg
        try:
            sys.stderr.write(f"repro injector (pid {os.getpid()}): {line}\n")
        except Exception:
            pass
        try:
            with open(self._path(_files.ERRORS_LOG), "a", encoding="utf-8") as fh:
                fh.write(f"{_wall():.3f} pid={os.getpid()} rank={self.rank} {line}\n")
                if exc is not None:
                    fh.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        except Exception:
            pass
        self.event("error", id=inj, message=line)

    def event(self, kind: str, **fields: Any) -> None:
        rec = {"event": kind, "time": _wall(), "pid": self.pid, "rank": self.rank}
        rec.update(fields)
        try:
            data = json.dumps(rec, default=repr) + "\n"
            with self._io_lock:
                if self._fires is None:
                    self._fires = open(self._path(_files.fire_log(self.pid)), "a", encoding="utf-8")
                self._fires.write(data)
                self._fires.flush()
        except Exception as e:  # never raise into the target
            try:
                sys.stderr.write(f"repro injector (pid {os.getpid()}): cannot write fire log: {e}\n")
            except Exception:
                pass

    def record_caller(self, site: Site, frame: Any) -> None:
        """Observe mode: write a ``seen`` event the first time ``site`` is called from this place: the (code, offset)
        of its first 3 non-decorator frames, so one caller reached from two places of its own caller counts twice.

        The event has ``id``, ``arm_seq``, ``caller`` (first non-decorator frame), ``line``, ``stack`` (up to 8 frame
        names), and ``loops``: for each of the first 3 frames of ``stack``, the ``for`` targets enclosing the call
        (outermost first). Costs a 3-frame walk and one set lookup per call once a place was seen.
        """
        frames = []
        g = frame
        while g is not None and len(frames) < 3:
            if not _gate.is_decorator_frame(g):
                frames.append(g)
            g = g.f_back
        if not frames:
            return
        f = frames[0]
        key = tuple((id(x.f_code), x.f_lasti) for x in frames)
        if key in site.seen_keys:
            return
        site.seen_keys.add(key)
        if self.rank is None:
            self.see_rank()
        try:
            loops = [_gate.enclosing_loops(x.f_code, x.f_lasti) for x in frames]
            self.event("seen", id=site.id, arm_seq=self.arm_seq, caller=_gate.frame_name(f), line=f.f_lineno,
                       stack=_gate.caller_chain(f), loops=loops)
        except Exception as e:
            self.error(f"{site.id}: recording the caller failed", e, site.id)

    def write_counts(self) -> None:
        with self._io_lock:
            self.dirty = False
            self.event("counts", arm_seq=self.arm_seq, armed=sorted(self.armed),
                       counts={s.id: s.counts.as_dict() for s in self.sites})

    def _versions(self) -> Dict[str, Optional[str]]:
        """python, torch and the plan's engine (``engine``: ``{"name", "package", "distribution"}``): its version,
        as ``engine_version`` and under the distribution's name; a plan naming no engine records none."""
        eng = self.plan.get("engine") or {}
        dist = str(eng.get("distribution") or eng.get("package") or "")
        out: Dict[str, Optional[str]] = {"python": sys.version.split()[0], "torch": _dist_version("torch", "torch")}
        if dist:
            v = _dist_version(str(eng.get("package") or dist), dist)
            out.update({"engine": str(eng.get("name") or dist), "engine_version": v, dist: v})
        return out

    def write_marker(self) -> None:
        """(Re)write ``loaded-<pid>.json`` atomically."""
        with self._io_lock:
            self.marker_dirty = False
            self.title = _proctitle()
            rec: Dict[str, Any] = {
                "pid": self.pid,
                "create_time": self.start["create_time"],
                "start_ticks": self.start["start_ticks"],
                "argv": list(sys.argv),
                "proctitle": self.title,
                "rank": self.rank,
                "scenario": self.plan.get("scenario"),
                "variant": self.plan.get("variant"),
                "plan": self.plan_path,
                "forked_from": self.forked_from,
                "sites": {s.id: s.record() for s in self.sites},
                "faulthandler": {"signal": self.fh_signal, "file": getattr(self.fh_file, "name", None)},
                "time": _wall(),
            }
            rec.update(self._versions())
            path = self._path(_files.loaded_marker(self.pid))
            tmp = path + _files.TMP_SUFFIX
            try:
                with open(tmp, "w", encoding="utf-8") as fh:
                    json.dump(rec, fh, indent=1, default=repr)
                os.replace(tmp, path)
            except Exception as e:
                self.error("cannot write loaded marker", e)

    # ---- arming -----------------------------------------------------------------------------------------------

    def poll_arm(self, force: bool = False) -> None:
        """Re-read the arm file if its (mtime, size, inode) changed; at most every ``arm_poll_s`` unless forced."""
        now = _monotonic()
        if not force and now < self._next_poll:
            return
        with self._arm_lock:
            if not force and now < self._next_poll:
                return
            self._next_poll = now + self.poll_s
            try:
                st = os.stat(self.arm_file)
                key: Any = (st.st_mtime_ns, st.st_size, st.st_ino)
            except FileNotFoundError:
                key = None
            except Exception as e:
                self.error(f"cannot stat arm file {self.arm_file}", e)
                return
            if key == self._arm_key:
                return
            self._arm_key = key
            ids: List[str] = []
            if key is not None:
                try:
                    with open(self.arm_file, encoding="utf-8") as fh:
                        ids = [ln.strip() for ln in fh if ln.strip() and not ln.strip().startswith("#")]
                except FileNotFoundError:
                    ids = []
            unknown = [i for i in ids if i not in self.by_id]
            if unknown:
                self.error(f"arm file {self.arm_file} lists unknown injection id(s) {unknown}; known: {sorted(self.by_id)}")
            ids = [i for i in ids if i in self.by_id]
            if ids:
                if self.armed:
                    self.write_counts()
                # Ranks notice the arm file up to arm_poll_s apart: calls made after it was written but before this
                # process noticed count as entered (not matched/fired), so "entered after arming" holds on a rank
                # that passed the site in the same tick its peer fired.
                written = key[0] / 1e9
                for s in self.sites:
                    c = Counts()
                    early = sorted(t for t in list(s.recent) if t >= written) if s.id in ids else []
                    if early:
                        c.entered = c.entered_before_poll = len(early)
                        c.first_entered, c.last_entered = early[0], early[-1]
                    s.recent.clear()
                    with s.lock:
                        s.counts = c
                self.arm_seq += 1
                self.armed = frozenset(ids)
                if self.ledger is not None:
                    self.ledger.note_armed()
                self.event("armed", ids=ids, arm_seq=self.arm_seq, arm_file_mtime=key[0] / 1e9)
                self.write_counts()
            elif self.armed:
                self.write_counts()
                self.armed = frozenset()
                self.event("disarmed", ids=[], arm_seq=self.arm_seq)

    # ---- patching ---------------------------------------------------------------------------------------------

    def _make_wrapper(self, site: Site, target: Target) -> Callable:
        rt = self
        kind = target.kind
        inj_id = site.id
        if kind in ("staticmethod", "classmethod"):
            orig = target.raw.__func__
        else:
            orig = target.raw
        has_self = kind in ("function", "classmethod")
        recent_append = site.recent.append

        def repro_injected(*args: Any, **kwargs: Any) -> Any:
            if _monotonic() >= rt._next_poll:
                rt.poll_arm()
            if inj_id not in rt.armed:
                recent_append(_wall())
                return orig(*args, **kwargs)
            self_obj = args[0] if has_self and args else None
            if rt.rank is None:
                rt.see_rank()  # the marker gets its rank as soon as a site runs under torch.distributed
            try:
                fire = site.enter(self_obj, sys._getframe(1))
            except Exception as e:
                rt.error(f"{inj_id}: gate failed", e, inj_id)
                fire = False
            if site.held and site.release_due():
                site.release()
            if site.fault_thread is not None:
                _natural.note_entry(site)
            if not fire:
                return orig(*args, **kwargs)
            if fire is HOLD:
                return _natural.hold_poll(site, lambda: orig(*args, **kwargs))
            caller = sys._getframe(1)
            if rt.rank is None:
                rt.see_rank()
            rt.write_counts()  # synchronously: a fire is on disk before a hang
            rt.event("fire", id=inj_id, arm_seq=rt.arm_seq, n=site.counts.fired, action=site.action,
                     nature=site.nature, thread=_natural.thread_name(), caller=site.gate.last_caller or _gate.frame_name(caller), stack=_gate.caller_chain(caller))
            t0 = _monotonic()
            try:
                res = site.run(self_obj, lambda: orig(*args, **kwargs), args)
            except BaseException as e:
                rt.event("fire_done", id=inj_id, duration_s=_monotonic() - t0, error=f"{type(e).__name__}: {e}")
                raise
            rt.event("fire_done", id=inj_id, duration_s=_monotonic() - t0, error=None)
            return res

        site_name = target.site.partition(":")[2] or target.site
        try:  # stack dumps read repro_injected[Scheduler.run_batch], not the generic closure name
            name = f"repro_injected[{site_name}]"
            repro_injected.__code__ = repro_injected.__code__.replace(co_name=name, co_qualname=name)
        except (TypeError, ValueError, AttributeError):
            pass
        _gate.OWN_CODES.add(repro_injected.__code__)
        from . import _ledger

        _ledger.INJECTED_CODES[repro_injected.__code__] = (inj_id, target.site)
        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            try:
                setattr(repro_injected, attr, getattr(orig, attr))
            except Exception:
                pass
        try:
            repro_injected.__dict__.update(getattr(orig, "__dict__", {}))
        except Exception:
            pass
        repro_injected.__wrapped__ = orig  # type: ignore[attr-defined]
        repro_injected.__repro_injection__ = inj_id  # type: ignore[attr-defined]
        if kind == "staticmethod":
            return staticmethod(repro_injected)  # type: ignore[return-value]
        if kind == "classmethod":
            return classmethod(repro_injected)  # type: ignore[return-value]
        return repro_injected

    def _watch(self, modname: str, cb: Any) -> None:
        self.watched.setdefault(modname, []).append(cb)
        mod = sys.modules.get(modname)
        if mod is not None and not getattr(getattr(mod, "__spec__", None), "_initializing", False):
            try:
                cb(mod)
            except Exception as e:
                self.error(f"patching in {modname} failed", e)

    def on_module(self, module: Any) -> None:
        """Post-import hook: a watched module (or one under a watched prefix) finished executing."""
        name = getattr(module, "__name__", "") or ""
        for cb in list(self.watched.get(name, [])):
            try:
                cb(module)
            except Exception as e:
                self.error(f"patching in {module.__name__} failed", e)
        if self.watch_prefixes and name.startswith(self.watch_prefixes):
            for cb in list(self.prefix_callbacks):
                try:
                    cb(module)
                except Exception as e:
                    self.error(f"prefix hook in {name} failed", e)

    def _try_patch(self, site: Site, alt: str, module: Any) -> None:
        """Patch alternative ``alt`` of ``site`` in ``module``. Every alternative that resolves is patched (one
        injection, one set of counts): a release can define several of them, and the one its code calls is not
        always the first imported (sglang 0.5.18 imports UnifiedRadixCache before HiRadixCache, and builds the
        latter for HiCache). ``site.patched`` is the first one patched."""
        rec = site.tried[alt]
        if rec["status"] == "patched":
            return
        try:
            target = resolve_in_module(module, alt)
        except (AttributeError, TypeError) as e:
            rec.update(status="absent", error=str(e))
            self.marker_dirty = True
            return
        if getattr(getattr(target.raw, "__func__", target.raw), "__repro_injection__", None) == site.id:  # inherited, patched already
            rec.update(status="patched", error=None)
            self.marker_dirty = True
            return
        wrapper = self._make_wrapper(site, target)
        setattr(target.owner, target.name, wrapper)
        if site.patched is None:
            site.patched, site.wrapper = target, wrapper
            site.original = target.raw
        rec.update(status="patched", error=None)
        site.error = None
        self.marker_dirty = True
        if target.kind == "module_function":
            for alias in site.aliases:
                amod, aparts = split_site(alias)
                self._watch(amod, lambda m, a=aparts, t=target, w=wrapper, s=site: self._patch_alias(s, m, a, t, w))

    def _patch_alias(self, site: Site, module: Any, parts: List[str], target: Target, wrapper: Any) -> None:
        owner = module
        for p in parts[:-1]:
            owner = getattr(owner, p)
        cur = getattr(owner, parts[-1], None)
        if cur is target.raw:
            setattr(owner, parts[-1], wrapper)
        else:
            site.error = f"alias {module.__name__}:{'.'.join(parts)} is not a copy of {target.site}; left alone"
            self.marker_dirty = True

    def install(self) -> None:
        """Register post-import hooks for every site alternative (patching now those already imported), and the
        collective ledger's hooks when the plan enables it."""
        sys.meta_path.insert(0, _HookFinder(self))
        record_mp_names(self)
        spec = self.plan.get("ledger") or {}
        if spec.get("enabled"):
            from ._ledger import Ledger

            try:
                self.ledger = Ledger(self, spec)
                self.ledger.install()
            except Exception as e:
                self.error("ledger install failed", e)
        for site in self.sites:
            for alt in site.alternatives:
                try:
                    modname, _ = split_site(alt)
                except ValueError as e:
                    site.tried[alt].update(status="error", error=str(e))
                    continue
                self._watch(modname, lambda m, s=site, a=alt: self._try_patch(s, a, m))

    # ---- background -------------------------------------------------------------------------------------------

    def see_rank(self) -> None:
        d = _dist()
        if d is not None and self.rank is None:
            try:
                self.rank = int(d.get_rank())
                self.marker_dirty = True
            except Exception:
                pass

    def _loop(self) -> None:
        next_title = 0.0
        while True:
            try:
                _sleep(min(self.poll_s, COUNTS_INTERVAL_S))
                self.poll_arm()
                if self.rank is None:
                    self.see_rank()
                now = _monotonic()
                if now >= next_title:
                    next_title = now + TITLE_INTERVAL_S
                    if _proctitle() != self.title:
                        self.marker_dirty = True
                if self.dirty:
                    self.write_counts()
                if self.marker_dirty:
                    self.write_marker()
            except Exception as e:
                self.error("background thread", e)
                _sleep(1.0)

    def flush(self) -> None:
        """Write pending counts and marker now (also run at interpreter exit)."""
        try:
            if self.rank is None:
                self.see_rank()
            if self.dirty:
                self.write_counts()
            if self.marker_dirty:
                self.write_marker()
        except Exception:
            pass
        try:
            if self.ledger is not None:
                self.ledger.drain()
        except Exception:
            pass

    def start_thread(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="repro-injector", daemon=True)
        self._thread.start()

    def setup_faulthandler(self) -> None:
        name = self.plan.get("faulthandler_signal") or ""
        if not name:
            return
        sig = getattr(signal, name, None)
        if not isinstance(sig, int) or not hasattr(faulthandler, "register"):
            self.error(f"plan faulthandler_signal {name!r} is not a signal on this platform (expected e.g. 'SIGUSR2')")
            return
        self.fh_file = open(self._path(_files.faulthandler_file(self.pid)), "a", encoding="utf-8")
        # chain only to a real previous handler: chaining to SIG_DFL re-raises the signal's default action, which
        # for SIGUSR1/2 terminates the process (measured) - a capture must never kill a rank.
        prev = signal.getsignal(sig)
        chain = callable(prev)
        faulthandler.register(sig, file=self.fh_file, all_threads=True, chain=chain)
        self.fh_signal = name

    def after_fork(self) -> None:
        """In a forked child: new pid, new files, new thread; counts and arming state carry over."""
        self.pid = os.getpid()
        self.forked_from = os.getppid()
        self.start = _proc_start()
        self._fires = None
        for f in sys.meta_path:  # an import the parent's other threads were in does not go on here
            if isinstance(f, _HookFinder):
                f.busy = set()
        self._io_lock = threading.RLock()
        self._arm_lock = threading.Lock()
        try:
            self.setup_faulthandler()
        except Exception as e:
            self.error("faulthandler in fork child", e)
        self.write_marker()
        self.start_thread()
        if self.ledger is not None:
            self.ledger.after_fork()


def _register_action_codes() -> None:
    from . import _ledger

    _ledger.ACTION_CODES.add(Site._collective.__code__)


_register_action_codes()


def load_plan(path: str) -> Dict[str, Any]:
    """Read and check the plan JSON. Raises PlanError naming the file and the key."""
    try:
        with open(path, encoding="utf-8") as fh:
            plan = json.load(fh)
    except FileNotFoundError:
        raise PlanError(f"{PLAN_ENV}={path}: plan file not found") from None
    except ValueError as e:
        raise PlanError(f"{PLAN_ENV}={path}: not valid JSON: {e}") from None
    if not isinstance(plan, dict):
        raise PlanError(f"{path}: expected a JSON object")
    if plan.get("version") not in SUPPORTED_PLAN_VERSIONS:
        raise PlanError(f"{path}: plan version {plan.get('version')!r} not supported (expected one of {SUPPORTED_PLAN_VERSIONS}); "
                        "rebuild the plan with this checkout's repro")
    for key in ("out_dir", "arm_file", "injections"):
        if key not in plan:
            raise PlanError(f"{path}: missing key {key!r}")
    for i, inj in enumerate(plan["injections"]):
        for key in ("id", "site", "action"):
            if key not in inj:
                raise PlanError(f"{path}: injections[{i}] missing key {key!r}")
    return plan


_RUNTIME: Optional[Runtime] = None
_TRIED = False
_LOCK = threading.Lock()


def activate() -> Optional[Runtime]:
    """Start the injector in this process if ``REPRO_PLAN`` is set; idempotent; never raises.

    Returns:
        The process's Runtime, or None when the env var is unset or the plan could not be used (then the error is
        on stderr and, when the out_dir is known, in ``errors.log``).
    """
    global _RUNTIME
    path = os.environ.get(PLAN_ENV)
    if not path:
        return None
    global _TRIED
    with _LOCK:
        if _RUNTIME is not None or _TRIED:
            return _RUNTIME
        _TRIED = True  # both entry files call us: report a bad plan once
        try:
            plan = load_plan(path)
        except Exception as e:
            sys.stderr.write(f"repro injector (pid {os.getpid()}): {e}\n")
            return None
        rt = Runtime(plan, path)
        try:
            os.makedirs(rt.out_dir, exist_ok=True)
        except Exception as e:
            sys.stderr.write(f"repro injector (pid {os.getpid()}): cannot create out_dir {rt.out_dir}: {e}\n")
            return None
        _RUNTIME = rt
        try:
            rt.setup_faulthandler()
        except Exception as e:
            rt.error("faulthandler.register failed", e)
        try:
            rt.install()
        except Exception as e:
            rt.error("installing import hooks failed", e)
        rt.write_marker()
        rt.poll_arm(force=True)
        rt.start_thread()
        import atexit

        atexit.register(rt.flush)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=rt.after_fork)
            from . import _fork

            if _fork.wanted():  # opt-in (off by default): sglang's ranks forked from the launcher, see _fork
                try:
                    _fork.install(rt)  # registered after rt.after_fork: the runtime is re-made first in a child
                except Exception as e:
                    rt.error("installing the fork-ranks switch failed", e)
        return rt


def runtime() -> Optional[Runtime]:
    """The active Runtime of this process, or None."""
    return _RUNTIME
