"""Per-tick cost of the lockstep state digest (``injectors/repro_injector/_digest.py``), in the ticking thread.

The probes are sglang 0.5.23's file (``[state]`` of ``repro/targets/sglang/releases/0.5.23.toml``), evaluated on a
Scheduler-shaped object (no SGLang: pools with ``available_size()``, a tree cache with ``evictable_size()`` /
``protected_size()``, a HiCache controller with a host pool and the in-flight dicts, ``waiting_queue`` of Req
objects with a 32-hex ``rid``, ``running_batch.reqs``). Two cases per waiting-queue size:

- ``steady``: nothing changes between ticks (an idle or steadily decoding server): every probe is read and compared,
  nothing is written;
- ``moving``: every tick one waiting request leaves and one arrives and the pool count moves (worst case: the set's
  member list differs, so it is sorted and hashed, a ledger line and a ring line are encoded).

Reported: the ticking thread's CPU time per tick (``time.thread_time``), median and p99 over ``--ticks`` ticks, in
microseconds. Ledger lines are encoded but not written (the ledger's writer does that with the tick's other records);
the ring file is written (to a temp folder).

Usage: ``python benchmarks/digest_overhead.py [--ticks 5000] [--sizes 8,1000]`` (stdlib + the injector + tomllib).

``--alternate [--bursts 20] [--window-s 1.0] [--requests 16] [--max-new-tokens 64]``: instead, digest on vs
ledger-only on ONE real server (the CPU testbed's smoke server, ``control`` bursts), alternating every
``--window-s`` wall seconds inside every burst: the injector's benchmark-only ``bench_digest_alternate_s`` takes the
digest only at ticks that start in even windows, the ledger records in both, every tick's start is logged. The
method, the step classification and the summary are ``benchmarks/ledger_proof.py alternate``'s (its ``on`` arm is
digest + ledger, ``off`` ledger only; ``hot_path_ms`` per step there is the digest's evaluation plus the ticking
thread's ledger writes). Starts a real server: run it under the shared lock. ≈ one start-up + bursts × ~8 s on a
quiet box (21–27 s per burst with both cores busy). ``--summarize EVIDENCE_DIR``: the same summary from the files of
an earlier ``--alternate --evidence-dir EVIDENCE_DIR`` (one an outer timeout cut short: its bursts so far).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import tomllib
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "injectors"))

from repro_injector._digest import Digest  # noqa: E402

PROBE_FILE = REPO / "repro" / "targets" / "sglang" / "releases" / "0.5.23.toml"


class _Pool:
    def __init__(self, n: int) -> None:
        self.n = n

    def available_size(self) -> int:
        return self.n


class _Req:
    __slots__ = ("rid",)

    def __init__(self) -> None:
        self.rid = uuid.uuid4().hex


class _NS:
    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)


class _Tree:
    def __init__(self) -> None:
        self.cache_controller = _NS(mem_pool_host=_Pool(4096))
        self.ongoing_prefetch = {}
        self.ongoing_write_through = {}
        self.ongoing_load_back = {}
        self.ongoing_backup = {}

    def evictable_size(self) -> int:
        return 100

    def protected_size(self) -> int:
        return 20


def scheduler(waiting: int) -> _NS:
    return _NS(req_to_token_pool=_Pool(64), token_to_kv_pool_allocator=_Pool(8192), tree_cache=_Tree(),
               waiting_queue=[_Req() for _ in range(waiting)], running_batch=_NS(reqs=[_Req() for _ in range(8)]),
               disagg_prefill_bootstrap_queue=None, disagg_prefill_inflight_queue=None,
               disagg_decode_prealloc_queue=None, disagg_decode_transfer_queue=None)


def measure(waiting: int, ticks: int, moving: bool, out_dir: str) -> dict:
    probes = tomllib.loads(PROBE_FILE.read_text())["state"]["probe"]
    d = Digest({"probes": probes, "ring": 2000}, out_dir, 1)
    s = scheduler(waiting)
    d.tick(0, s)  # the full first digest
    costs = []
    tt = time.thread_time
    for t in range(1, ticks + 1):
        if moving:
            s.waiting_queue.pop(0)
            s.waiting_queue.append(_Req())
            s.req_to_token_pool.n = 64 - (t & 7)
        t0 = tt()
        d.tick(t, s)
        costs.append(tt() - t0)
    costs.sort()
    return {"waiting": waiting, "case": "moving" if moving else "steady", "ticks": ticks,
            "median_us": round(statistics.median(costs) * 1e6, 1),
            "p99_us": round(costs[int(0.99 * (len(costs) - 1))] * 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ticks", type=int, default=5000)
    ap.add_argument("--sizes", default="8,1000")
    ap.add_argument("--alternate", action="store_true", help="digest on vs ledger-only on one real server (docstring)")
    ap.add_argument("--bursts", type=int, default=20)
    ap.add_argument("--window-s", type=float, default=1.0)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--evidence-dir", default="")
    ap.add_argument("--summarize", default="", metavar="EVIDENCE_DIR",
                    help="the --alternate summary from an earlier run's --evidence-dir (e.g. one cut short by a timeout)")
    args = ap.parse_args()
    if args.summarize:
        sys.path.insert(0, str(REPO))
        sys.path.insert(0, str(REPO / "benchmarks"))
        import ledger_proof

        root = Path(args.summarize)
        session = next(root.glob("*/*-alternate"))
        bursts = []
        for d in sorted(root.glob("*/*-alt-[0-9]*"), key=lambda d: int(d.name.rsplit("-", 1)[1])):
            ev = [json.loads(x) for x in (d / "requests.jsonl").read_text().splitlines() if x.strip()]
            ts = [e["t"] for e in ev if e.get("event") in ("sent", "done")]
            if ts:  # a burst the timeout cut counts up to its last answer
                bursts.append((d.name.rsplit("-", 1)[1], min(ts), max(ts)))
        window_s = json.loads((session / "plan.json").read_text())["ledger"]["bench_digest_alternate_s"]
        print(json.dumps({"summary": ledger_proof.alternate_summary(session / "injector", window_s, bursts,
                                                                    "bench_digest_alternate_s")}))
        return
    if args.alternate:
        import signal

        sys.path.insert(0, str(REPO))
        sys.path.insert(0, str(REPO / "benchmarks"))
        import ledger_proof

        def _term(signum, frame):  # SIGTERM (an outer `timeout`) tears the server down like Ctrl-C
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, _term)
        args.knob = "bench_digest_alternate_s"
        root = Path(args.evidence_dir) if args.evidence_dir else Path(tempfile.mkdtemp(prefix="repro-bench-digest-"))
        ledger_proof.alternate(args, root)
        return
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.sizes.split(",")):
            for moving in (False, True):
                print(json.dumps(measure(n, args.ticks, moving, tmp)))


if __name__ == "__main__":
    main()
