"""A small gloo job that hangs on purpose, shaped like an SGLang scheduler desync.

Usage: python desync.py RANK WORLD_SIZE PORT OUT_DIR [--mode MODE] [--extra-rank K] [--ticks N]
                                                   [--fault-signal SIGUSR2] [--lifetime-s S]
                                                   [--master-addr ADDR] [--title TITLE]

``--master-addr``: rank 0's address for the rendezvous (default 127.0.0.1; ranks on several hosts: rank 0's data
address, with ``GLOO_SOCKET_IFNAME`` set). ``--title``: the process title (setproctitle, as SGLang titles its
schedulers ``sglang::scheduler_TP{k}``), when setproctitle is installed.

Every rank runs ``scheduler_loop``: each tick, rank 0 "receives requests" and broadcasts them to the TP group
(``broadcast`` on a 1-element tensor, like ``broadcast_pyobj`` → ``dist.broadcast``). Modes:

- ``extra-allreduce`` (default): after ``--ticks`` normal ticks, rank ``--extra-rank`` makes one extra
  ``all_reduce`` from ``check_prefetch_progress`` (the shape of sglang #30760); the others wait in the next
  tick's ``broadcast``. The job hangs: the ranks sit in different collectives.
- ``idle``: no extra collective; rank 0 never sends the next tick's broadcast (it waits in a ``queue.get`` for
  work that never comes), so ranks >0 wait in ``broadcast`` — the healthy idle shape.
- ``thread-allreduce``: rank ``--extra-rank`` runs its extra ``all_reduce`` in a worker thread named
  ``forward-thread`` while its main thread waits in ``Thread.join``: a collective held by a non-main thread.
- ``busy``: rank ``--extra-rank`` spins on the CPU in ``busy_forward`` forever; the others wait in ``broadcast``.

Before blocking, each rank writes ``OUT_DIR/ready-<rank>`` (so a test knows the job reached its hang point)
and, when ``--fault-signal`` is given, registers ``faulthandler.register(sig, file=OUT_DIR/faulthandler-<pid>.txt,
all_threads=True)`` exactly like the injector does. A daemon thread ends the process after ``--lifetime-s``
(default 300 s) so an orphan can never outlive a crashed test; tests still end every rank by process group.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import os
import queue
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist


def _lifetime_guard(seconds: float) -> None:
    def _guard() -> None:
        time.sleep(seconds)
        os._exit(7)

    threading.Thread(target=_guard, name="lifetime-guard", daemon=True).start()


def _ready(out_dir: str, rank: int) -> None:
    path = os.path.join(out_dir, f"ready-{rank}")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


def check_prefetch_progress() -> None:
    flag = torch.zeros(1, dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)


def busy_forward() -> None:
    x = 0
    while True:
        x = (x * 31 + 7) % 1_000_003


def recv_requests(rank: int, work: "queue.Queue[int]", last: bool) -> None:
    reqs = torch.zeros(4, dtype=torch.int64)
    if rank == 0 and last:
        work.get()  # idle: wait for work that never comes (queue get)
    dist.broadcast(reqs, src=0)


def scheduler_loop(args: argparse.Namespace) -> None:
    rank = args.rank
    work: "queue.Queue[int]" = queue.Queue()
    for _ in range(args.ticks):
        recv_requests(rank, work, last=False)
    _ready(args.out_dir, rank)
    if rank == args.extra_rank and args.mode == "extra-allreduce":
        check_prefetch_progress()
    elif rank == args.extra_rank and args.mode == "thread-allreduce":
        t = threading.Thread(target=check_prefetch_progress, name="forward-thread")
        t.start()
        t.join()
    elif rank == args.extra_rank and args.mode == "busy":
        busy_forward()
    recv_requests(rank, work, last=args.mode == "idle")
    recv_requests(rank, work, last=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("rank", type=int)
    p.add_argument("world_size", type=int)
    p.add_argument("port", type=int)
    p.add_argument("out_dir")
    p.add_argument("--mode", default="extra-allreduce", choices=["extra-allreduce", "idle", "thread-allreduce", "busy"])
    p.add_argument("--extra-rank", type=int, default=0)
    p.add_argument("--ticks", type=int, default=3)
    p.add_argument("--fault-signal", default="")
    p.add_argument("--lifetime-s", type=float, default=300.0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--title", default="")
    args = p.parse_args()
    _lifetime_guard(args.lifetime_s)
    if args.title:
        import setproctitle

        setproctitle.setproctitle(args.title)
    if args.fault_signal:
        sig = getattr(signal, args.fault_signal)
        fh = open(os.path.join(args.out_dir, f"faulthandler-{os.getpid()}.txt"), "a")
        faulthandler.register(sig, file=fh, all_threads=True)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master_addr}:{args.port}",
        rank=args.rank,
        world_size=args.world_size,
        timeout=datetime.timedelta(seconds=args.lifetime_s),
    )
    scheduler_loop(args)
    sys.exit(0)


if __name__ == "__main__":
    main()
