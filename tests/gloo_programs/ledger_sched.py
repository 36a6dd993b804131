"""A scheduler-shaped gloo job for the collective ledger (run under the injector with the ledger enabled).

Usage: python ledger_sched.py RANK WORLD_SIZE INIT_FILE OUT_DIR [--mode ok|extra|inject|mismatch-red]
                                                              [--ticks N] [--odd-rank K] [--lifetime-s S]

Shaped like SGLang 0.5.23's TP scheduler, without SGLang: ``GroupCoordinator`` (a small stand-in for
``sglang.srt.distributed.parallel_state.GroupCoordinator``: a named coordinator whose methods call
``torch.distributed`` on its ``cpu_group``/``device_group``, so the ledger's nested-call rule is exercised),
``broadcast_pyobj`` (two ``dist.broadcast`` calls like ``sglang.srt.utils.common.broadcast_pyobj``) and
``Scheduler.get_next_batch_to_run`` (the tick function) which per tick broadcasts the requests, all_reduces a
4-float tensor through the coordinator and, every third tick, all_gathers an object. Modes:

- ``ok``: ``--ticks`` ticks, then ``OUT_DIR/done-<rank>`` and a clean exit.
- ``values``: like ``ok``, and each tick also MIN-reduces a per-rank 0-d int (``10 * (rank + 1) + tick``), SUMs 32
  floats, 2 ints with ``async_op=True``, 2 floats and 65 ints on the CPU group, and MAX-reduces ``[rank, 1]``
  through the coordinator (the ledger's recorded values).
- ``extra``: after the ticks rank ``--odd-rank`` calls ``check_prefetch_progress`` (a MAX all_reduce on the CPU
  group) and everyone starts the next tick: the job hangs (rank K in all_reduce, the others in broadcast).
- ``inject``: like ``extra`` but the extra all_reduce comes from the repro injector at ``Scheduler.run_batch``
  (the plan holds the injection; this program does nothing odd itself).
- ``mismatch-red``: at tick 2 rank K all_reduces with MIN while the others use SUM; gloo pairs them, the job ends.
- ``mismatch-dtype``: at tick 2 rank K all_reduces 4 float64 while the others pass 4 float32; gloo's size check
  aborts a rank (``Received data size doesn't match expected size``).
- ``bypass-hang``: rank K calls ``GroupCoordinator.barrier``, which here blocks forever without calling
  torch.distributed (like a hung pynccl call); the others start the next tick.

Before blocking each rank writes ``OUT_DIR/ready-<rank>``. A daemon thread ends the process after
``--lifetime-s``; tests still end every rank by process group.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import threading
import time

import torch
import torch.distributed as dist


class GroupCoordinator:
    def __init__(self, group_name: str) -> None:
        self.group_name = group_name
        self.cpu_group = dist.new_group(backend="gloo")
        self.device_group = dist.new_group(backend="gloo")
        self.world_size = dist.get_world_size()

    def all_reduce(self, t: torch.Tensor, op=None) -> torch.Tensor:
        if op is None:
            dist.all_reduce(t, group=self.device_group)
        else:
            dist.all_reduce(t, op=op, group=self.device_group)
        return t

    def barrier(self) -> None:
        # stands in for a device communicator (pynccl) call that never returns and never reaches torch.distributed
        threading.Event().wait()

    def all_gather_object(self, obj):
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out


def broadcast_pyobj(data: list, rank: int, group) -> list:
    size = torch.tensor([len(data) if rank == 0 else 0], dtype=torch.long)
    dist.broadcast(size, src=0, group=group)
    if int(size.item()) == 0:
        return []
    buf = torch.tensor(data if rank == 0 else [0] * int(size.item()), dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=group)
    return buf.tolist()


class ReqToTokenPool:
    """Stands in for sglang 0.5.23 ``mem_cache/memory_pool.py`` ReqToTokenPool's free-slot list (state digest)."""

    def __init__(self, size: int) -> None:
        self.free_slots = list(range(1, size + 1))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc_rows(self, n: int):
        if n > len(self.free_slots):
            return None
        out = self.free_slots[-n:]
        del self.free_slots[-n:]
        return out

    def free_rows(self, rows) -> None:
        self.free_slots.extend(rows)


class Req:
    def __init__(self, rid: str) -> None:
        self.rid = rid


class Scheduler:
    def __init__(self, rank: int, args: argparse.Namespace) -> None:
        self.rank = rank
        self.args = args
        self.tp_group = GroupCoordinator("tp")
        self.tp_cpu_group = self.tp_group.cpu_group
        self.ticks = 0
        self.req_to_token_pool = ReqToTokenPool(8)  # lockstep state for the digest (the same on every rank)
        self.waiting_queue: list = []

    def explode(self) -> int:
        raise RuntimeError("a probe that fails")

    def recv_requests(self) -> list:
        return broadcast_pyobj([1, 2, 3], self.rank, self.tp_cpu_group)

    def run_batch(self, reqs: list) -> None:
        x = torch.ones(4, dtype=torch.float32)
        op = None
        if self.args.mode == "mismatch-red" and self.ticks == 2 and self.rank == self.args.odd_rank:
            op = dist.ReduceOp.MIN
        if self.args.mode == "mismatch-dtype" and self.ticks == 2:
            time.sleep(0.3)  # like a long-running server: every earlier record reached the ledger file
            if self.rank == self.args.odd_rank:
                x = torch.ones(4, dtype=torch.float64)  # twice the bytes: gloo's size check aborts a rank
        self.tp_group.all_reduce(x, op)
        if self.args.mode == "values":
            # a per-rank answer MIN-reduced like sglang 0.5.23's _sync_prefetch_hit_query (a 0-d int tensor), a tensor
            # too large for the ledger's values, and an async reduction (its values after the call are not read)
            hits = torch.tensor(10 * (self.rank + 1) + self.ticks, dtype=torch.int32)
            dist.all_reduce(hits, op=dist.ReduceOp.MIN, group=self.tp_cpu_group)
            dist.all_reduce(torch.ones(32), group=self.tp_cpu_group)
            dist.all_reduce(torch.ones(2, dtype=torch.int64), group=self.tp_cpu_group, async_op=True).wait()
            dist.all_reduce(torch.ones(2), group=self.tp_cpu_group)  # floats (activations): no values
            self.tp_group.all_reduce(torch.tensor([self.rank, 1]), dist.ReduceOp.MAX)  # nested in the coordinator
            dist.all_reduce(torch.zeros(65, dtype=torch.int32), group=self.tp_cpu_group)  # over 64 elements: none
        if self.ticks % 3 == 0:
            self.tp_group.all_gather_object({"rank": self.rank})

    def get_next_batch_to_run(self) -> list:
        self.ticks += 1
        self.waiting_queue.append(Req(f"r{self.ticks}"))  # one arrival per tick, at most two waiting
        if len(self.waiting_queue) > 2:
            self.waiting_queue.pop(0)
        return self.recv_requests()

    def event_loop_normal(self, n: int) -> None:
        for _ in range(n):
            reqs = self.get_next_batch_to_run()
            self.run_batch(reqs)


def check_prefetch_progress(group) -> None:
    flag = torch.zeros(1, dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)


def _touch(out_dir: str, name: str) -> None:
    path = os.path.join(out_dir, name)
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("rank", type=int)
    p.add_argument("world_size", type=int)
    p.add_argument("init_file")
    p.add_argument("out_dir")
    p.add_argument("--mode", default="ok", choices=["ok", "values", "extra", "inject", "mismatch-red", "mismatch-dtype", "bypass-hang"])
    p.add_argument("--ticks", type=int, default=5)
    p.add_argument("--odd-rank", type=int, default=0)
    p.add_argument("--lifetime-s", type=float, default=120.0)
    args = p.parse_args()

    def guard() -> None:
        time.sleep(args.lifetime_s)
        os._exit(7)

    threading.Thread(target=guard, name="lifetime-guard", daemon=True).start()
    dist.init_process_group("gloo", init_method=f"file://{args.init_file}", rank=args.rank,
                            world_size=args.world_size, timeout=datetime.timedelta(seconds=args.lifetime_s))
    s = Scheduler(args.rank, args)
    s.event_loop_normal(args.ticks)
    if args.mode in ("ok", "values", "mismatch-red"):
        _touch(args.out_dir, f"done-{args.rank}")
        # every rank is past its last collective before any tears its gloo pairs down: a rank that destroys while
        # its peer still reads a pair aborted in C++ at exit ("terminate called without an active exception",
        # seen once in a clean-clone CI run)
        dist.barrier()
        dist.destroy_process_group()
        sys.exit(0)
    _touch(args.out_dir, f"ready-{args.rank}")
    if args.mode == "bypass-hang" and args.rank == args.odd_rank:
        s.tp_group.barrier()
    if args.mode == "extra" and args.rank == args.odd_rank:
        check_prefetch_progress(s.tp_cpu_group)
    if args.mode == "inject":
        reqs = s.get_next_batch_to_run()
        s.run_batch(reqs)  # the injector's extra all_reduce fires here on the odd rank
    s.event_loop_normal(1)


if __name__ == "__main__":
    # run from the importable module so the plan's ``ledger_sched:...`` names (tick function, coordinator) resolve
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import ledger_sched

    ledger_sched.main()
