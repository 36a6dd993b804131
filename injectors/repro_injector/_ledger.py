"""The collective ledger: every collective this process enters and leaves, as JSON lines (``ledger-<pid>.jsonl``).

Enabled by the plan's ``ledger`` key (``{"enabled": bool, "max_records": int, "tick_function": "module:qualname",
"coordinators": [...], "alias_prefixes": [...], "comm_module_prefixes": [...]}``, ``repro.scenario.compile_plan``
with the engine adapter's injector profile); when disabled nothing is patched and nothing runs (zero cost).

Where collectives are recorded (checked against sglang 0.5.23 and torch 2.14):

- ``torch.distributed``: the package attributes ``all_reduce``, ``broadcast``, ``all_gather``,
  ``all_gather_into_tensor``, ``reduce_scatter``, ``reduce_scatter_tensor``, ``all_to_all_single``, ``barrier``,
  ``monitored_barrier``, ``gather``, ``broadcast_object_list``, ``all_gather_object``, ``send``, ``recv`` (and torch
  2.14's ``all_gather_single``, ``reduce_scatter_single``, recorded as their wire ops) are rebound to recording
  wrappers. sglang calls them as module attributes (``torch.distributed.all_reduce`` in
  ``distributed/parallel_state.py``, ``dist.broadcast`` in ``utils/common.py`` ``broadcast_pyobj``); copies made by
  ``from torch.distributed import all_reduce, barrier`` (``managers/scheduler_components/request_receiver.py``,
  ``managers/scheduler.py``) are rebound in every ``sglang.*`` module after it is imported (post-import hook). Calls
  inside torch itself (``broadcast_object_list`` → ``broadcast``) use ``distributed_c10d``'s own globals and are not
  seen twice.
- sglang's ``GroupCoordinator`` methods (``all_reduce``, ``broadcast``, ``all_gather``, ``all_gather_into_tensor``,
  ``reduce_scatter``, ``reduce_scatter_tensor``, ``broadcast_object``, ``broadcast_object_list``,
  ``all_gather_object``, ``broadcast_tensor_dict``, ``barrier``, ``gather`` — those present): the outer call is the
  record; the torch-level call it makes is not counted again (thread-local depth) but names the record's process
  group, wire op, reduce op and tensors. A coordinator call that reaches no torch.distributed function within
  ``PENDING_AFTER_S`` (pynccl, custom all-reduce, shm all-reduce, message-queue broadcaster; sglang #36802) is
  written by the writer thread (or at its return, if sooner) on the coordinator's ``device_group`` (``cpu_group``
  for the object ops and barrier), with ``"bypass": true`` and op = the coordinator method's name, so a hang
  inside pynccl is on disk too. ``GroupCoordinator.__init__`` is wrapped to name its groups (``tp/cpu``,
  ``tp/device``).
- The scheduler tick: each call of the plan's ``tick_function`` increments this process's tick counter; each record
  carries the tick in which it was entered.

File format (one JSON object per line; ``e`` says which; written by ``_ledger_file.LedgerFile``, which ``Ledger``
inherits):

- ``{"e": "header", "pid", "rank", "part", "dropped", "max_records", "time"}``: first line of every file part;
  ``dropped`` = enter records discarded so far by rotation.
- ``{"e": "group", "g", "name", "ranks", "backend", "label", "rank_in_group"}``: a process group, written before
  the first record on it (and again when its sglang label becomes known; read the last one). ``g`` is torch's group
  name, the same on every rank.
- ``{"e": "enter", "g", "seq", "op", "api", "red", "shapes", "dtypes", "site", "tick", "t", "inj", "thread",
  "bypass", "src"}``: ``seq`` counts collectives per group in this process from 1; ``op`` is the torch-level (wire) op;
  ``api`` the outermost API called (``GroupCoordinator.broadcast_object``, ``torch.distributed.all_reduce``);
  ``red`` the reduce op or null; ``shapes``/``dtypes`` of the tensors passed (a list of tensors counts as
  ``[n, *shape]``); ``src`` (broadcasts only, when given as an int: the global source rank); ``site`` up to 4 caller frames outside the communication layers (``module:qualname``, innermost
  first; an injected collective's first frame is the patched site); ``inj`` the injection id when the injector's
  own action issued it; ``t`` epoch seconds; ``in`` (last, only when recorded) the values of a small integer CPU
  tensor an ``all_reduce`` / ``broadcast`` carries, at entry (``_ledger_args.py``: ≤ 64 elements, never a device or
  float tensor).
- ``{"e": "exit", "g", "seq", "t", "err", "out"}``: the call returned (for ``async_op=True``, when the call returned,
  not when the work completed); ``out`` only where the enter record has ``in``: the tensor's values after the call.
- ``{"e": "state", "tick", "full", "v"}`` and ``{"e": "state_error", "tick", "probe", "err"}``: the lockstep state
  digest at a tick's start, when the plan's ``ledger.digest`` names probes (format in ``_digest.py``); written by
  the ticking thread with the tick's other records; each part after the first starts with a ``full`` one.

Timing: the hot path appends a tuple to a deque; the ticking thread writes the queue itself at the start of every
scheduler tick (it holds the GIL already: no hand-over to another thread). The tick is the same on every rank of the
TP group, so the ranks' writes happen together and their delays overlap: a rank that writes at a collective its
peer does not write at makes the peer wait for it at the next collective, so unaligned writes cost a step the sum
of the ranks' write times and aligned ones their maximum. Without a tick function the calling thread writes at a
collective's entry once the last write is ``FLUSH_INTERVAL_S`` (50 ms) old. The writer thread (``repro-ledger``)
wakes every ``WRITER_PERIOD_S`` (150 ms) while records are queued or a coordinator call is open and writes the queue
when no thread has for ``SELF_WRITE_S`` (100 ms: a rank blocked in a collective, or one between ticks that long) or a
coordinator call is due as a bypass record; so a blocked rank's last record is on disk within
``SELF_WRITE_S + WRITER_PERIOD_S`` (250 ms) of its last write. It sleeps (woken by the next record) while nothing is
queued: an idle process's writer does not wake (each hand-over of the GIL to it cost the rank's main thread a wait
for the writer to be scheduled: measured in benchmarks/RESULTS.md). A blocked gloo collective releases the GIL, so
the writer thread writes the record of the collective a rank hangs in (tests/test_ledger_gloo.py). Records keep a
tensor's shape and dtype, never the tensor (and the values of a small CPU one only). Bounded: the file rotates after ``max_records // 2`` enter records into
``ledger-<pid>.1.jsonl`` (replacing the previous part), so between ``max_records // 2`` and ``max_records`` of the
most recent records are kept (~250 bytes each: 20,000 records ≈ 5 MB per rank); the header's ``dropped`` says how
many were discarded. Two more parts are kept: the part current when the injector was last armed and the next
one, when rotation would replace them, move to ``ledger-<pid>.3.jsonl`` and ``.2.jsonl`` (a stall after the
nemesis fired ticks on and would rotate its own ticks away); their records are not counted as dropped, every rank
keeps the same parts (all read the arming), and a reader sees a gap of ticks between them and ``.1``.

The wrappers' code objects are named ``repro_ledger[torch.distributed.all_reduce]`` (and
``repro_tick[Scheduler.get_next_batch_to_run]``) so stack dumps show what they are; the stack gate and the harness's
stack analysis treat them as transparent.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from . import files as _files
from . import gate as _gate
from ._ledger_file import LedgerFile
from ._ledger_args import SRC_OPS, VALUE_OPS, _arg_index, _is_async, _meta, _src, _values

FLUSH_INTERVAL_S = 0.05  # the calling thread writes the queue itself at a collective's entry once it is this old
WRITER_PERIOD_S = 0.15  # the writer thread's period while records are queued or a coordinator call is open
IDLE_WAIT_S = 2.0  # the writer thread's longest sleep while nothing is queued (it is woken by the next record)
SELF_WRITE_S = 0.1  # the writer thread leaves the queue to a rank that wrote it itself less than this long ago
PENDING_AFTER_S = 0.05  # a coordinator call with no torch.distributed call yet is written after this long
SITE_FRAMES = 4
MAX_WALK = 40

# The torch.distributed functions the ledger wraps. The injector never imports the harness, so it keeps this copy;
# the harness' one op table is repro/diagnosis.py (COLLECTIVES), which names every op written here.
TORCH_OPS = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "all_to_all_single", "barrier", "monitored_barrier", "gather", "broadcast_object_list", "all_gather_object",
    "send", "recv", "all_gather_single", "reduce_scatter_single",
)
# Newer torch names of the same wire ops (torch 2.14 ``all_gather_single``, which sglang 0.5.23's
# ``distributed/utils.py`` imports for ``GroupCoordinator.all_gather`` on CPU): the record's ``op`` is the wire op,
# its ``api`` the name called, so the harness's tables (repro/diagnosis.py, repro/data/pairing_*.json) need no row.
WIRE_OPS = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}
# GroupCoordinator method -> the coordinator attribute holding the group used when no torch call is seen (0.5.23).
COORDINATOR_METHODS = {
    "all_reduce": "device_group", "broadcast": "device_group", "all_gather": "device_group",
    "all_gather_into_tensor": "device_group", "reduce_scatter": "device_group",
    "reduce_scatter_tensor": "device_group", "gather": "device_group", "broadcast_tensor_dict": "device_group",
    "broadcast_object": "cpu_group", "broadcast_object_list": "device_group", "all_gather_object": "cpu_group",
    "barrier": "cpu_group",
}
# The engine's part comes from the plan's ``ledger`` (``coordinators``, ``alias_prefixes``, ``comm_module_prefixes``:
# the adapter's InjectorProfile, repro/targets/); these are the fallbacks for a plan without them (sglang 0.5.23).
DEFAULT_COORDINATORS = ("sglang.srt.distributed.parallel_state:GroupCoordinator",)
ALIAS_PREFIXES = ("sglang.",)
ENGINE_COMM_MODULE_PREFIXES = ("sglang.srt.distributed",)
# Modules whose frames are never a call site: the communication layers, context-manager and nn.Module plumbing.
GENERIC_COMM_MODULE_PREFIXES = ("torch.distributed", "repro_injector", "torch.utils._contextlib", "torch.nn.modules.module",
                                "contextlib")
COMM_MODULE_PREFIXES = GENERIC_COMM_MODULE_PREFIXES[:1] + ENGINE_COMM_MODULE_PREFIXES + GENERIC_COMM_MODULE_PREFIXES[1:]

_wall = time.time
_pc = time.perf_counter


_sleep = time.sleep
_tls = threading.local()

# Code objects of the injector's site wrappers -> (injection id, patched site ``module:qualname``); filled by
# ``Runtime._make_wrapper`` so a collective issued by an injection names the site it was injected at.
INJECTED_CODES: Dict[Any, Tuple[str, str]] = {}
# Code objects of the injector's actions (``Site._collective``): a collective under one of them was issued by the
# injection whose wrapper is further out; one without is the site's own (original) collective.
ACTION_CODES: set = set()


class _Pending:
    """An outer (coordinator-level) call whose record is written at its first torch-level call, or by the writer
    thread once it has waited ``PENDING_AFTER_S`` without one (a pynccl / custom all-reduce call that may hang)."""

    __slots__ = ("api", "coord", "method", "attr", "objs", "tick", "site", "inj", "t", "key", "seq", "vals", "vout")

    def __init__(self, api: str, coord: Any, method: str, attr: str, objs: tuple, tick: int, site: Tuple[str, ...],
                 inj: Optional[str], t: float) -> None:
        self.api, self.coord, self.method, self.attr, self.objs, self.tick = api, coord, method, attr, objs, tick
        self.site, self.inj, self.t = site, inj, t
        self.key: Optional[str] = None
        self.seq = 0
        self.vals = False  # its record took a small CPU tensor's values in (``_ledger_args``): read them out after the call
        self.vout: Optional[list] = None


def _rename(fn: Callable, name: str) -> Callable:
    try:
        fn.__code__ = fn.__code__.replace(co_name=name, co_qualname=name)
    except (TypeError, ValueError, AttributeError):
        try:
            fn.__code__ = fn.__code__.replace(co_name=name)
        except Exception:
            pass
    _gate.OWN_CODES.add(fn.__code__)
    return fn


class Ledger(LedgerFile):
    """Per-process collective recorder (see the module docstring). Created by ``Runtime`` when the plan enables it.

    Args:
        rt: the process's ``_runtime.Runtime`` (for ``out_dir``, ``pid``, ``error`` and ``_watch``).
        spec: the plan's ``ledger`` dict.
    """

    def __init__(self, rt: Any, spec: Dict[str, Any]) -> None:
        self.rt = rt
        self.max_records = max(2, int(spec.get("max_records") or 20_000))
        self.tick_function: str = spec.get("tick_function") or ""
        dspec = spec.get("digest") or {}
        self.digest: Any = None  # _digest.Digest: the per-tick lockstep state (plan ``ledger.digest``)
        if dspec.get("enabled", True) and (dspec.get("probes") or dspec.get("releases")):
            from ._digest import Digest, probes_for_release

            probes, why = probes_for_release(dspec)
            if probes is not None:
                self.digest = Digest({**dspec, "probes": probes}, rt.out_dir, rt.pid)
            elif why:
                rt.event("state_digest_off", reason=why)
        self.coordinators: List[str] = list(spec.get("coordinators") or DEFAULT_COORDINATORS)
        self.alias_prefixes: Tuple[str, ...] = tuple(spec.get("alias_prefixes") or ALIAS_PREFIXES)
        engine_comm = tuple(spec.get("comm_module_prefixes") or ENGINE_COMM_MODULE_PREFIXES)
        self.comm_module_prefixes: Tuple[str, ...] = GENERIC_COMM_MODULE_PREFIXES[:1] + engine_comm + GENERIC_COMM_MODULE_PREFIXES[1:]
        self.tick = 0
        self.pending: Dict[int, _Pending] = {}  # thread ident -> its open coordinator call
        self.q: Deque[tuple] = deque()
        self.lock = threading.Lock()  # sequence numbers and group table
        self.seqs: Dict[str, int] = {}
        self.groups: Dict[int, Tuple[Any, Dict[str, Any]]] = {}  # id(pg) -> (pg, info)
        self.labels: Dict[int, List[str]] = {}
        self.originals: Dict[int, Tuple[Callable, Callable]] = {}  # id(original) -> (original, wrapper)
        self._names: Dict[int, Tuple[Any, str, int]] = {}  # id(code) -> (code, name, kind): 0 site, 1 skip, 2 injector wrapper, 3 injector action
        self.rank: Optional[int] = None
        self.fh: Any = None
        self.part = 0
        self.in_part = 0
        self.dropped = 0
        self.prev_part_records = 0
        self.pinned_records = 0  # enter records in the pinned parts (_ledger_file.PINNED_PARTS)
        self.pin_from: Optional[int] = None  # the part current at the latest arming (note_armed)
        self.total = 0
        self._thread: Optional[threading.Thread] = None
        self._wlock = threading.Lock()
        self._frags: Tuple[Dict[tuple, Any], ...] = ({}, {}, {})  # encoded parts of enter lines (enter_line)
        self.last_write = 0.0  # wall time of the last drain (by any thread)
        self.tick_writes = False  # the tick function is patched: the ticking thread writes at each tick's start
        self.idle = False  # the writer thread sleeps until woken: the hot path sets ``_wake`` when it queues a record
        self._wake = threading.Event()
        self.wakes = 0  # the writer thread's wake-ups (tests, benchmarks)
        self.writer_drains = 0  # the writer thread's writes of a non-empty queue (tests, benchmarks)
        # Benchmarks only (benchmarks/ledger_proof.py ``alternate``): > 0 records only in even windows of this many
        # wall seconds (int(t / w) even) and passes every collective straight through in odd ones, so one server
        # measures ledger on and off interleaved. The ranks' files then disagree at every window edge: never a proof.
        self.alternate_s = float(spec.get("bench_alternate_s") or 0.0)
        # Benchmarks only (benchmarks/digest_overhead.py ``alternate``): > 0 evaluates the state digest only in even
        # windows of this many wall seconds (the ledger records in both), so one server measures digest on against
        # ledger-only interleaved; every tick's start goes to ticks-<pid>.txt as with ``bench_alternate_s``. The
        # ranks' digests then skip values at window edges: the digest is not for diagnosis in such a run.
        self.digest_alternate_s = float(spec.get("bench_digest_alternate_s") or 0.0)
        self._ticks: List[tuple] = []  # log_tick's rows not yet in ticks-<pid>.txt (alternate_s only)
        self.hot_s = 0.0  # alternate_s only: time spent in the wrappers' own code (perf_counter), all threads
        self.writer_cpu_s = 0.0  # alternate_s only: the writer thread's CPU after its wake-ups
        self.gc_s = 0.0  # alternate_s only: time in the garbage collector (gc.callbacks), all threads
        self.gc_full = 0  # alternate_s only: full (generation 2) collections
        self._gc_t0 = 0.0
        if self.alternate_s or self.digest_alternate_s:
            import gc

            gc.callbacks.append(self._gc_event)

    # ---- install ----------------------------------------------------------------------------------------------

    def install(self) -> None:
        """Watch torch.distributed, the coordinator classes, the tick function and sglang modules (aliases)."""
        self.rt._watch("torch.distributed", self._patch_torch)
        for c in self.coordinators:
            mod, _, cls = c.partition(":")
            self.rt._watch(mod, lambda m, cls=cls: self._patch_coordinator(m, cls))
        if self.tick_function:
            mod, _, _q = self.tick_function.partition(":")
            self.rt._watch(mod, self._patch_tick)
        self.rt.watch_prefixes = tuple(self.rt.watch_prefixes) + self.alias_prefixes
        self.rt.prefix_callbacks.append(self._rebind_aliases)
        self.start_thread()

    def _patch_torch(self, dist: Any) -> None:
        for op in TORCH_OPS:
            orig = getattr(dist, op, None)
            if orig is None or id(orig) in self.originals or getattr(orig, "__repro_ledger__", False):
                continue
            w = self._torch_wrapper(op, orig)
            setattr(dist, op, w)
            self.originals[id(orig)] = (orig, w)
        for name, mod in list(sys.modules.items()):
            if name.startswith(self.alias_prefixes) and mod is not None:
                self._rebind_aliases(mod)

    def _rebind_aliases(self, module: Any) -> None:
        """Rebind ``from torch.distributed import all_reduce`` copies in one module to the recording wrappers."""
        if not self.originals:
            return
        try:
            items = list(vars(module).items())
        except TypeError:
            return
        for k, v in items:
            hit = self.originals.get(id(v))
            if hit is not None and hit[0] is v:
                try:
                    setattr(module, k, hit[1])
                except Exception:
                    pass

    def _patch_coordinator(self, module: Any, cls_name: str) -> None:
        cls = getattr(module, cls_name, None)
        if cls is None:
            self.rt.error(f"ledger: {module.__name__}:{cls_name} not found; coordinator-level records disabled")
            return
        for meth, attr in COORDINATOR_METHODS.items():
            orig = cls.__dict__.get(meth)
            if orig is None or not callable(orig) or getattr(orig, "__repro_ledger__", False):
                continue
            setattr(cls, meth, self._coord_wrapper(f"{cls_name}.{meth}", meth, attr, orig))
        init = cls.__dict__.get("__init__")
        if init is not None and not getattr(init, "__repro_ledger__", False):
            led = self

            def repro_ledger_init(coord: Any, *args: Any, **kwargs: Any) -> None:
                init(coord, *args, **kwargs)
                try:
                    led.name_groups(coord)
                except Exception as e:
                    led.rt.error("ledger: naming coordinator groups failed", e)

            repro_ledger_init.__repro_ledger__ = True  # type: ignore[attr-defined]
            repro_ledger_init.__wrapped__ = init  # type: ignore[attr-defined]
            setattr(cls, "__init__", _rename(repro_ledger_init, f"repro_ledger[{cls_name}.__init__]"))

    def _patch_tick(self, module: Any) -> None:
        from .resolve import resolve_in_module

        try:
            target = resolve_in_module(module, self.tick_function)
        except (AttributeError, TypeError) as e:
            self.rt.error(f"ledger: tick_function {self.tick_function} not found: {e}")
            return
        orig = target.raw
        if getattr(orig, "__repro_ledger__", False):
            return
        led = self

        def repro_tick(*args: Any, **kwargs: Any) -> Any:
            led.tick += 1
            if led.alternate_s or led.digest_alternate_s:
                led.log_tick()
            dg = led.digest
            if dg is not None and led.digest_alternate_s and int(_wall() / led.digest_alternate_s) & 1:
                dg = None  # benchmarks only: an odd window, ledger-only
            if dg is not None and args:  # the lockstep state at this tick's start (the receiver: the Scheduler)
                d0 = _pc() if led.digest_alternate_s else 0.0
                try:
                    for line in dg.tick(led.tick, args[0]):
                        led.q.append(("s", line))
                except Exception as e:
                    led.digest = None
                    led.rt.error("ledger: state digest disabled", e)
                if led.digest_alternate_s:
                    led.hot_s += _pc() - d0
            if led.q:  # the same tick on every rank of the group: the writes' delays overlap (module docstring)
                h0 = _pc()
                led.write_now()
                if led.alternate_s or led.digest_alternate_s:
                    led.hot_s += _pc() - h0
            return orig(*args, **kwargs)

        repro_tick.__repro_ledger__ = True  # type: ignore[attr-defined]
        repro_tick.__wrapped__ = orig  # type: ignore[attr-defined]
        short = self.tick_function.partition(":")[2]
        setattr(target.owner, target.name, _rename(repro_tick, f"repro_tick[{short}]"))
        self.tick_writes = True

    def name_groups(self, coord: Any) -> None:
        """Label a coordinator's process groups ``<group_name>/cpu`` and ``<group_name>/device``."""
        name = str(getattr(coord, "group_name", None) or getattr(coord, "unique_name", "group"))
        for attr, tag in (("cpu_group", "cpu"), ("device_group", "device")):
            pg = getattr(coord, attr, None)
            if pg is None:
                continue
            labels = self.labels.setdefault(id(pg), [])
            lab = f"{name}/{tag}"
            if lab not in labels:
                labels.append(lab)
                with self.lock:
                    hit = self.groups.get(id(pg))
                    if hit is not None and hit[0] is pg:
                        hit[1]["label"] = " = ".join(labels)
                        self.q.append(("g", dict(hit[1])))

    # ---- hot path ---------------------------------------------------------------------------------------------

    def _group(self, pg: Any) -> Tuple[str, Dict[str, Any]]:
        hit = self.groups.get(id(pg))
        if hit is not None and hit[0] is pg:
            return hit[1]["g"], hit[1]
        import torch.distributed as dist

        real = pg
        if real is None:
            real = dist.distributed_c10d._get_default_group()
        hit = self.groups.get(id(real))
        if hit is not None and hit[0] is real:
            info = hit[1]
        else:
            info = {"g": None, "name": None, "ranks": None, "backend": None, "label": None, "rank_in_group": None}
            try:
                info["name"] = dist.distributed_c10d._get_process_group_name(real)
            except Exception:
                info["name"] = getattr(real, "group_name", None)
            try:
                info["ranks"] = list(dist.get_process_group_ranks(real))
            except Exception:
                pass
            try:
                info["backend"] = str(dist.get_backend(real))
            except Exception:
                pass
            try:
                info["rank_in_group"] = int(dist.get_rank(real))
            except Exception:
                pass
            info["g"] = str(info["name"]) if info["name"] is not None else \
                f"ranks:{','.join(map(str, info['ranks'] or []))}|{info['backend']}"
            labels = self.labels.get(id(real))
            if labels:
                info["label"] = " = ".join(labels)
            with self.lock:
                self.groups[id(real)] = (real, info)
                self.q.append(("g", dict(info)))
            if self.rank is None:
                try:
                    self.rank = int(dist.get_rank())
                except Exception:
                    pass
        if pg is None:
            with self.lock:
                self.groups[id(pg)] = (pg, info)
        return info["g"], info

    def log_tick(self) -> None:
        """Benchmarks only (``bench_alternate_s``): every tick's start, ``<tick> <epoch s> <ticking thread's CPU s>
        <ledger hot-path s so far> <writer thread's CPU s so far> <writer wake-ups so far> <garbage collector s so
        far> <full collections so far>`` lines in
        ``ticks-<pid>.txt``, written by the ticking thread 50 at a time or at the first tick after a 0.3 s gap (the end
        of a burst), in recording and pass-through windows alike."""
        now = _wall()
        if self._ticks and (len(self._ticks) >= 50 or now - self._ticks[-1][1] > 0.3):  # 50 held, or an idle gap
            self.flush_ticks()
        self._ticks.append((self.tick, now, time.thread_time(), self.hot_s, self.writer_cpu_s, self.wakes, self.gc_s,
                            self.gc_full))

    def _gc_event(self, phase: str, info: Dict[str, Any]) -> None:
        if phase == "start":
            self._gc_t0 = _pc()
        else:
            self.gc_s += _pc() - self._gc_t0
            if info.get("generation") == 2:
                self.gc_full += 1

    def flush_ticks(self) -> None:
        try:
            with open(os.path.join(self.rt.out_dir, _files.ticks_file(os.getpid())), "a") as fh:
                fh.write("".join(" ".join(repr(x) for x in row) + "\n" for row in self._ticks))
        except Exception as e:
            self.rt.error("ledger tick log", e)
        self._ticks = []

    def _site(self, frame: Any) -> Tuple[Tuple[str, ...], Optional[str]]:
        """Up to SITE_FRAMES caller names outside the communication layers, and the injection id if injected."""
        out: List[str] = []
        inj: Optional[str] = None
        action = False
        f = frame
        n = 0
        names = self._names
        while f is not None and len(out) < SITE_FRAMES and n < MAX_WALK:
            n += 1
            code = f.f_code
            hit = names.get(id(code))
            if hit is None or hit[0] is not code:
                hit = self._classify(f)
            kind = hit[2]
            if kind == 0:
                out.append(hit[1])
            elif kind == 2:
                if action and not out:
                    inj = inj or INJECTED_CODES[code][0]
                    out.append(hit[1])
            elif kind == 3:
                action = True
                try:  # the action's own Site: its id (one wrapper serves every injection patched at a site)
                    inj = getattr(f.f_locals.get("self"), "id", None) or inj
                except Exception:
                    pass
            f = f.f_back
        return tuple(out), inj

    def _classify(self, f: Any) -> Tuple[Any, str, int]:
        code = f.f_code
        if code in INJECTED_CODES:
            res = (code, INJECTED_CODES[code][1], 2)
        elif code in ACTION_CODES:
            res = (code, "", 3)
        else:
            mod = f.f_globals.get("__name__", "?") or "?"
            if code in _gate.OWN_CODES or mod.startswith(self.comm_module_prefixes) or _gate.is_decorator_frame(f):
                res = (code, "", 1)
            else:
                res = (code, _gate.frame_name(f), 0)
        self._names[id(code)] = res
        return res

    def _next_seq(self, key: str) -> int:
        with self.lock:
            n = self.seqs.get(key, 0) + 1
            self.seqs[key] = n
            return n

    def _torch_wrapper(self, op: str, orig: Callable) -> Callable:
        led = self
        gi = _arg_index(orig, "group")
        ri = _arg_index(orig, "op") if op in ("all_reduce", "reduce_scatter", "reduce_scatter_tensor",
                                              "reduce_scatter_single") else -1
        si = _arg_index(orig, "src") if op in SRC_OPS else -1
        ai = _arg_index(orig, "async_op")
        vals = op in VALUE_OPS
        api = f"torch.distributed.{op}"
        op = WIRE_OPS.get(op, op)
        tls = _tls
        wall = _wall
        q = self.q

        def repro_ledger(*args: Any, **kwargs: Any) -> Any:
            if getattr(tls, "d", 0):
                p = getattr(tls, "p", None)
                if p is not None and p.key is None:
                    led._emit_pending(p, op, args, kwargs, gi, ri, si, vals)
                    if p.vals:
                        res = orig(*args, **kwargs)
                        if not _is_async(args, kwargs, ai):
                            p.vout = _values(args, kwargs)
                        return res
                return orig(*args, **kwargs)
            w = led.alternate_s
            if w:
                if int(wall() / w) & 1:
                    return orig(*args, **kwargs)
                h0 = _pc()
            tls.d = 1
            try:
                pg = kwargs.get("group") if "group" in kwargs else (args[gi] if 0 <= gi < len(args) else None)
                key, _info = led._group(pg)
                seq = led._next_seq(key)
                site, inj = led._site(sys._getframe(1))
                red = kwargs.get("op") if "op" in kwargs else (args[ri] if 0 <= ri < len(args) else None)
                if ri >= 0 and red is None:
                    red = "SUM"
                src = _src(op, args, kwargs, si)
                vin = _values(args, kwargs) if vals else None
                t = wall()
                q.append(("n", key, seq, op, api, red, _meta(args[:2]), site, led.tick, t, inj,
                          threading.current_thread().name, False, src, vin))
                if not led.tick_writes and t - led.last_write >= FLUSH_INTERVAL_S:
                    led.write_now()
                if q and led.idle:  # not written (by the tick, or another thread was writing): the writer thread will
                    led._wake.set()
                if w:
                    led.hot_s += _pc() - h0
                try:
                    res = orig(*args, **kwargs)
                except BaseException as e:
                    q.append(("x", key, seq, wall(), f"{type(e).__name__}: {e}"))
                    led.drain_on_error()  # a backend's mismatch check often ends the process right after this
                    raise
                if w:
                    h0 = _pc()
                q.append(("x", key, seq, wall(), None,
                          _values(args, kwargs) if vin is not None and not _is_async(args, kwargs, ai) else None))
                if led.idle:
                    led._wake.set()
                if w:
                    led.hot_s += _pc() - h0
                return res
            finally:
                tls.d = 0

        repro_ledger.__repro_ledger__ = True  # type: ignore[attr-defined]
        repro_ledger.__wrapped__ = orig  # type: ignore[attr-defined]
        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            try:
                setattr(repro_ledger, attr, getattr(orig, attr))
            except Exception:
                pass
        return _rename(repro_ledger, f"repro_ledger[{api}]")

    def _emit_pending(self, p: _Pending, op: str, args: tuple, kwargs: dict, gi: int, ri: int, si: int = -1,
                      vals: bool = False) -> None:
        pg = kwargs.get("group") if "group" in kwargs else (args[gi] if 0 <= gi < len(args) else None)
        key, _ = self._group(pg)
        red = kwargs.get("op") if "op" in kwargs else (args[ri] if 0 <= ri < len(args) else None)
        if ri >= 0 and red is None:
            red = "SUM"
        with self.lock:
            if p.key is not None:  # the writer thread already wrote it (a slow coordinator call)
                return
            n = self.seqs.get(key, 0) + 1
            self.seqs[key] = n
            p.key, p.seq = key, n
            vin = _values(args, kwargs) if vals else None
            p.vals = vin is not None
            self.q.append(("n", key, n, op, p.api, red, _meta(args[:2]), p.site, p.tick, p.t, p.inj,
                           threading.current_thread().name, False, _src(op, args, kwargs, si), vin))

    def _emit_bypass(self, p: _Pending, thread: str) -> None:
        """Write a coordinator call that has reached no torch.distributed call (yet), on its fallback group."""
        key, _ = self._group(getattr(p.coord, p.attr, None))
        with self.lock:
            if p.key is not None:
                return
            n = self.seqs.get(key, 0) + 1
            self.seqs[key] = n
            p.key, p.seq = key, n
            self.q.append(("n", key, n, p.method, p.api, "SUM" if p.method == "all_reduce" else None, p.objs,
                           p.site, p.tick, p.t, p.inj, thread, True, None))

    def _bypass_due(self) -> bool:
        """A coordinator call open for ``PENDING_AFTER_S`` with no torch.distributed call: its record is due."""
        now = _wall()
        return any(p.key is None and now - p.t >= PENDING_AFTER_S for p in list(self.pending.values()))

    def flush_pending(self, now: Optional[float] = None) -> None:
        """Writer thread: write coordinator calls open for ``PENDING_AFTER_S`` without a torch-level call."""
        now = _wall() if now is None else now
        for ident, p in list(self.pending.items()):
            if p.key is None and now - p.t >= PENDING_AFTER_S:
                try:
                    th = next((t.name for t in threading.enumerate() if t.ident == ident), str(ident))
                    self._emit_bypass(p, th)
                except Exception as e:
                    self.rt.error(f"ledger: {p.api} pending record failed", e)

    def _coord_wrapper(self, api: str, meth: str, attr: str, orig: Callable) -> Callable:
        led = self
        tls = _tls
        wall = _wall
        pending = self.pending

        def repro_ledger(coord: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(tls, "d", 0) or getattr(coord, "world_size", 2) == 1:
                return orig(coord, *args, **kwargs)
            w = led.alternate_s
            if w:
                if int(wall() / w) & 1:
                    return orig(coord, *args, **kwargs)
                h0 = _pc()
            site, inj = led._site(sys._getframe(1))
            p = _Pending(api, coord, meth, attr, _meta(args[:2]), led.tick, site, inj, wall())
            ident = threading.get_ident()
            tls.d = 1
            tls.p = p
            pending[ident] = p
            if led.idle:
                led._wake.set()
            if w:
                led.hot_s += _pc() - h0
            err: Optional[str] = None
            try:
                return orig(coord, *args, **kwargs)
            except BaseException as e:
                err = f"{type(e).__name__}: {e}"
                raise
            finally:
                if w:
                    h0 = _pc()
                tls.d = 0
                tls.p = None
                pending.pop(ident, None)
                if p.key is None:  # no torch.distributed call: pynccl / custom all-reduce / shm / mq broadcaster
                    try:
                        led._emit_bypass(p, threading.current_thread().name)
                    except Exception as e:
                        led.rt.error(f"ledger: {api} bypass record failed", e)
                if p.key is not None:
                    led.q.append(("x", p.key, p.seq, wall(), err, p.vout if err is None else None))
                    if led.idle and err is None:
                        led._wake.set()
                if err is not None:  # the failed call's records (enter and exit, or its bypass record) on disk now
                    led.drain_on_error()
                if w:
                    led.hot_s += _pc() - h0

        repro_ledger.__repro_ledger__ = True  # type: ignore[attr-defined]
        repro_ledger.__wrapped__ = orig  # type: ignore[attr-defined]
        for a in ("__module__", "__name__", "__qualname__", "__doc__"):
            try:
                setattr(repro_ledger, a, getattr(orig, a))
            except Exception:
                pass
        return _rename(repro_ledger, f"repro_ledger[{api}]")

    # ---- writer thread (the file itself: _ledger_file.LedgerFile) ---------------------------------------------

    def _loop(self) -> None:
        wake = self._wake
        while True:
            try:
                if not self.q and not self.pending:
                    self.idle = True
                    woken = True
                    if not self.q and not self.pending:  # re-checked after ``idle`` is published (no lost wake-up)
                        woken = wake.wait(IDLE_WAIT_S)
                    wake.clear()
                    self.idle = False
                    if not woken and not self.q and not self.pending:
                        continue  # the safety time-out, nothing queued: back to sleep
                _sleep(WRITER_PERIOD_S)
                self.wakes += 1
                # a rank that writes its own records (at its ticks or collectives) is left to it: the writer thread
                # writes only what waited WRITER_PERIOD_S since the last write (a rank blocked in a collective, an
                # idle one) or a coordinator call that reached no torch call (a bypass record)
                while self.q and not self._bypass_due() and _wall() - self.last_write < SELF_WRITE_S:
                    _sleep(WRITER_PERIOD_S)
                    self.wakes += 1
                bench = self.alternate_s or self.digest_alternate_s
                c0 = time.thread_time() if bench else 0.0
                if self.pending:
                    self.flush_pending()
                if self.q:
                    self.drain()
                    self.writer_drains += 1
                if bench:
                    self.writer_cpu_s += time.thread_time() - c0
            except Exception as e:
                self.idle = False
                self.rt.error("ledger writer", e)
                _sleep(1.0)

    def start_thread(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="repro-ledger", daemon=True)
        self._thread.start()

    def after_fork(self) -> None:
        """In a forked child: a fresh file and writer thread; sequence numbers carry over (same groups)."""
        self.fh = None
        self.part = self.in_part = self.dropped = self.prev_part_records = self.pinned_records = 0
        self.pin_from = None
        self.q.clear()
        self.pending.clear()  # the parent's other threads do not exist here (clear: the wrappers hold this dict)
        self._wlock = threading.Lock()
        self.lock = threading.Lock()
        self._wake = threading.Event()
        self.idle = False
        self.last_write = 0.0
        if self.digest is not None:
            self.digest.after_fork(self.rt.pid)
        self.start_thread()
