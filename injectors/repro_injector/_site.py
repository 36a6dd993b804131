"""One injection of the plan in one process (:class:`Site`): its gate, occurrence counters (:class:`Counts`), the
action it runs around the patched call (``extra_collective``, ``skip``, ``return_value``, ``delay``, ``state``) and
its patch state. The environment nemeses (``delay``, ``stop``, ``clock``, ``fault``, ``pending``, ``miss``, ``fail``:
*natural*) live in ``_natural``. Created by :class:`repro_injector._runtime.Runtime`; on the hot path of every patched call.

The injector's frames in a py-spy dump include ``Site.run`` and ``Site._collective`` (file
``repro_injector/_site.py``)."""

from __future__ import annotations

import copy
import threading
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, List, Optional, Tuple

from . import _natural
from . import gate as _gate
from ._proc import _attr_path, _dist, _module_group, _wall
from .resolve import Target

if TYPE_CHECKING:
    from ._runtime import Runtime


class _Hold:
    """:meth:`Site.enter`'s answer for a pending action's later polls: answer not-done, write no fire event."""

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "HOLD"


HOLD = _Hold()


class Counts:
    """Per injection, per arming: entered / matched / fired and first/last times (epoch seconds)."""

    __slots__ = ("entered", "matched", "fired", "first_entered", "last_entered", "first_matched", "last_matched",
                 "first_fired", "last_fired", "entered_before_poll")

    def __init__(self) -> None:
        self.entered = self.matched = self.fired = 0
        self.entered_before_poll = 0  # calls between the arm file's write (mtime) and this process noticing it
        self.first_entered = self.last_entered = self.first_matched = self.last_matched = None
        self.first_fired = self.last_fired = None

    def as_dict(self) -> Dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


class Site:
    """One injection of the plan in this process: its gate, action, occurrence counters and patch state."""

    def __init__(self, rt: "Runtime", spec: Dict[str, Any]) -> None:
        self.rt = rt
        self.id: str = spec["id"]
        site = spec.get("site") or {}
        self.alternatives: List[str] = list(site.get("alternatives") or [])
        self.aliases: List[str] = list(site.get("aliases") or [])
        g = spec.get("gate") or {}
        self.gate = _gate.gate_from_plan(g)
        self.ranks = frozenset(int(r) for r in (g.get("ranks") or []))
        self.rank_group: Optional[str] = g.get("rank_group") or None
        occ = g.get("occurrence") or {}
        self.mode: str = occ.get("mode", "first")
        self.nth: int = int(occ.get("nth", 1))
        self.max_fires: int = int(occ.get("max_fires", 0))
        self.action: Dict[str, Any] = spec.get("action") or {"kind": "none"}
        self.kind: str = self.action.get("kind", "none")
        self.counts = Counts()
        # observe mode (action none + record_callers): one ``seen`` event per distinct (caller code, offset)
        self.record_callers: bool = self.kind == "none" and bool(self.action.get("record_callers"))
        self.seen_keys: set = set()
        self.recent: Deque[float] = deque(maxlen=256)  # times of calls made while disarmed (arm-window accounting)
        self.lock = threading.Lock()
        self.patched: Optional[Target] = None
        self.wrapper: Optional[Callable] = None
        self.original: Optional[Callable] = None
        self.error: Optional[str] = None
        self.tried: Dict[str, Dict[str, Any]] = {s: {"site": s, "status": "pending", "error": None} for s in self.alternatives}
        self.held: List[Tuple[Any, Any, int]] = []  # state action: (pool, slots taken, ledger tick when taken)
        self.nature: str = _natural.nature_of(self.action)  # natural / forced / observe / control (the plan's label)
        self.pending_left = 0  # pending action: polls still to answer not-done after the fire
        self.pending_held = 0
        self.pending_self: Optional[int] = None  # id() of the object whose poll fired (a method site): only its polls are held
        self.fault_thread: Optional[int] = None  # fault action: the thread that got the exception, and its later calls
        self.fault_reentries = 0

    def record(self) -> Dict[str, Any]:
        """The loaded marker's entry for this injection. An alternative whose module this process never imported
        stays ``pending`` (e.g. the HiRadixCache alternative on sglang >= 0.5.21, or any site in the detokenizer)."""
        return {
            "resolved": self.patched.site if self.patched else None,
            "patched": self.patched is not None,
            "error": self.error,
            "alternatives_tried": [dict(v) for v in self.tried.values()],
        }

    # ---- gate -------------------------------------------------------------------------------------------------

    def _rank_ok(self, self_obj: Any) -> bool:
        if not self.ranks:
            return True
        d = _dist()
        if d is None:
            return False
        if self.rank_group:
            if self_obj is None:
                raise RuntimeError(f"gate.rank_group {self.rank_group!r} needs a method site (no self)")
            r = d.get_rank(_attr_path(self_obj, self.rank_group))
        else:
            r = d.get_rank()
        return r in self.ranks

    def enter(self, self_obj: Any, caller: Any) -> bool:
        """Count the call and evaluate the gate and occurrence (one lock round). True = fire now."""
        now = _wall()
        ok = False
        fire = False
        try:
            ok = (not self.ranks or self._rank_ok(self_obj)) and self.gate.check(caller)
        finally:
            with self.lock:
                c = self.counts
                c.entered += 1
                if c.first_entered is None:
                    c.first_entered = now
                c.last_entered = now
                if ok:
                    fire = self._matched(c, now, self_obj)
            self.rt.dirty = True
        if ok and self.record_callers:
            self.rt.record_caller(self, caller)
        return fire

    def _matched(self, c: Counts, now: float, self_obj: Any = None) -> bool:
        c.matched += 1
        if c.first_matched is None:
            c.first_matched = now
        c.last_matched = now
        if self.kind == "none":
            return False
        if self.pending_left > 0:  # a pending action's later polls: held, not new fires
            if self.pending_self is not None and id(self_obj) != self.pending_self:
                return False  # another object's poll (another request's sender): its own answer
            self.pending_left -= 1
            return HOLD  # type: ignore[return-value]
        if self.max_fires and c.fired >= self.max_fires:
            return False
        if self.mode == "first":
            fire = c.matched == 1
        elif self.mode == "nth":
            fire = c.matched == self.nth
        else:
            fire = True
        if fire:
            c.fired += 1
            if c.first_fired is None:
                c.first_fired = now
            c.last_fired = now
        return fire

    # ---- action -----------------------------------------------------------------------------------------------

    def _collective(self, self_obj: Any) -> None:
        import torch
        import torch.distributed as dist

        a = self.action
        from_module = ":" in (a.get("group") or "")  # "module:attr.path" or "module:getter()": a module's group
        if self_obj is None and not from_module:
            raise RuntimeError(f"{self.id}: extra_collective needs a method site (group/method are read from self), "
                               "or a group given as 'module:attribute' / 'module:getter()'")
        t0 = torch.ones(1, dtype=torch.int32)
        if a.get("method"):
            fn = _attr_path(self_obj, a["method"])
            try:
                import inspect

                nparams = len([p for p in inspect.signature(fn).parameters.values()
                               if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)])
            except (TypeError, ValueError):
                nparams = 1
            red = getattr(dist.ReduceOp, a.get("reduce_op") or "MAX")
            fn(t0, red) if nparams >= 2 else fn(t0)
            return
        g = _module_group(a["group"]) if from_module else _attr_path(self_obj, a["group"])
        if not isinstance(g, dist.ProcessGroup) and hasattr(g, "cpu_group"):
            g = g.cpu_group  # an sglang GroupCoordinator: use its gloo group
        backend = str(dist.get_backend(g)).lower()
        t = t0
        if "gloo" not in backend and ("nccl" in backend or "cuda" in backend) and torch.cuda.is_available():
            t = t0.to(torch.device("cuda", torch.cuda.current_device()))
        op = a.get("op", "all_reduce")
        if op == "all_reduce":
            dist.all_reduce(t, op=getattr(dist.ReduceOp, a.get("reduce_op") or "SUM"), group=g)
        elif op == "broadcast":
            dist.broadcast(t, src=dist.get_global_rank(g, 0), group=g)
        elif op == "barrier":
            dist.barrier(group=g)
        elif op == "all_gather":
            outs = [torch.zeros_like(t) for _ in range(dist.get_world_size(g))]
            dist.all_gather(outs, t, group=g)
        else:
            raise ValueError(f"{self.id}: unknown collective op {op!r}")

    def run(self, self_obj: Any, call: Callable[[], Any], args: tuple = ()) -> Any:
        """Run the action around ``call`` (which calls the original); ``args``: the call's positional arguments."""
        kind = self.kind
        a = self.action
        if kind == "extra_collective":
            if a.get("when", "before") == "after":
                res = call()
                self._collective(self_obj)
                return res
            self._collective(self_obj)
            return call()
        if kind == "skip":
            if a.get("return_arg") is not None:  # a skipped in-place collective hands back its (unreduced) input
                return args[int(a["return_arg"])]
            return copy.deepcopy(a.get("value"))
        if kind == "return_value":
            if a.get("offset") is not None:  # drift: the original's result plus a number (e.g. -1, +3600 s)
                res = call()
                if isinstance(res, (int, float)):  # a bool too: True - 1 == 0
                    return res + a["offset"]
                # no number to drift (an enum, a batch object): the call returns unchanged and is no fire
                with self.lock:
                    self.counts.fired -= 1
                self.rt.dirty = True
                self.rt.event("fire_inapplicable", id=self.id, returned=type(res).__name__)
                self.rt.write_counts()
                return res
            if a.get("call_original", True):
                call()
            return copy.deepcopy(a.get("value"))
        if kind in _natural.NATURAL_KINDS:
            return _natural.run_natural(self, self_obj, call, args)
        if kind == "state":
            self.take(self_obj)
            return call()
        return call()

    # ---- state action: move real pool state on this rank ------------------------------------------------------

    def _tick(self) -> int:
        led = self.rt.ledger
        return int(led.tick) if led is not None else 0

    def take(self, self_obj: Any) -> None:
        """Take ``take`` slots (or all but ``leave`` free ones) of the pool at ``pool`` (attribute path from self,
        e.g. ``req_to_token_pool``) and keep them: a per-rank leak. sglang 0.5.23 ``ReqToTokenPool.alloc_rows(n)`` (rows with no Req bound), else the
        pool's ``alloc(n)`` (``token_to_kv_pool_allocator``). A pool without room: the call is no fire."""
        a = self.action
        pool = _attr_path(self_obj, str(a["pool"]))
        alloc = getattr(pool, "alloc_rows", None) or getattr(pool, "alloc")
        before = pool.available_size() if hasattr(pool, "available_size") else None
        if a.get("leave") is not None and before is not None:
            k = int(before) - int(a["leave"])
        else:
            k = int(a.get("take") or 1)
        slots = alloc(k) if k > 0 else None
        if slots is None:
            with self.lock:
                self.counts.fired -= 1
            self.rt.event("fire_inapplicable", id=self.id, returned="None (pool full)")
            self.rt.write_counts()
            return
        self.held.append((pool, slots, self._tick()))
        after = pool.available_size() if hasattr(pool, "available_size") else None
        self.rt.event("state_taken", id=self.id, pool=a["pool"], take=k, tick=self._tick(), available_before=before,
                      available_after=after)

    def release_due(self) -> bool:
        n = self.action.get("release_after_ticks")
        return n is not None and self._tick() - self.held[0][2] >= int(n)

    def release(self) -> None:
        """Give every held slot back (``free_rows`` / ``free``), ``release_after_ticks`` ticks after the take."""
        while self.held:
            pool, slots, _t = self.held.pop()
            try:
                free = getattr(pool, "free_rows", None) or getattr(pool, "free")
                free(slots)
                self.rt.event("state_released", id=self.id, pool=self.action.get("pool"), tick=self._tick())
            except Exception as e:
                self.rt.error(f"{self.id}: state release failed", e, self.id)
