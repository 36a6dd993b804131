"""Measure which pairs of different collectives a torch.distributed backend completes, crashes on or leaves hanging.

Usage: python scripts/measure_pairing.py [--out repro/data/pairing_gloo.json] [--hang-s 2.0]
       (any interpreter with torch; the CPU testbed's works: ~/.cache/tp-deadlock-repro/testbed/sglang-0.5.23/venv)

Every case runs in two fresh worker processes (ranks 0 and 1, gloo over 127.0.0.1, file:// rendezvous): gloo
aborts the whole process on some mismatches (``terminate called after throwing gloo::EnforceNotMet``: a size
mismatch), so a case cannot share a process with the next one. In a case rank 0 issues
collective A and rank 1 collective B (or nothing: a *solo* case, one rank alone in a collective). Each rank runs its
call in a daemon thread and waits ``--hang-s`` seconds for it: ``returned``, ``raised: <message>`` or ``blocked``.
A case is ``pairs`` (both returned: a desync that completes, with wrong values), ``crash`` (a rank raised, e.g.
gloo's size check) or ``hangs`` (nobody raised and a rank is still blocked). A process that dies is a crash
(the message is its stderr's). Blocked threads stay blocked until the worker exits (``os._exit``); the process
group's timeout is far longer than the wait. 34 cases, ~250 s on 2 cores.

The output is data for ``repro.proof`` (``PairingTable``): per case the two sides (op, reduce op, element count,
dtype, broadcast source as rank in group), the outcome and what each rank saw. The table is looked up by the
*features* of a pair (which ops, same reduce op?, same element count?, same dtype?, same source?), so one measured
case stands for every pair with those features (e.g. all_reduce(SUM) [1] int32 against all_reduce(MAX) [1] int32
stands for any two same-shape all_reduces with different reduce ops).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# (A on rank 0, B on rank 1); a side is (op, red, numel, dtype, src) or None (the rank issues nothing)
I32, I64, F32, F16 = "int32", "int64", "float32", "float16"
CASES = [
    (("all_reduce", "SUM", 1, I32, None), ("all_reduce", "SUM", 1, I32, None)),
    (("all_reduce", "SUM", 1, I32, None), ("all_reduce", "MAX", 1, I32, None)),
    (("all_reduce", "MIN", 1, I32, None), ("all_reduce", "MAX", 1, I32, None)),
    (("all_reduce", "SUM", 4, F32, None), ("all_reduce", "PRODUCT", 4, F32, None)),
    (("all_reduce", "SUM", 1, I32, None), ("all_reduce", "SUM", 4, I32, None)),
    (("all_reduce", "SUM", 1, I32, None), ("all_reduce", "SUM", 1, I64, None)),
    (("all_reduce", "SUM", 2, I32, None), ("all_reduce", "SUM", 1, I64, None)),
    (("all_reduce", "SUM", 1, F32, None), ("all_reduce", "SUM", 1, I32, None)),
    # element counts that differ, by size: gloo's all_reduce hangs on tiny tensors but checks the sizes of larger
    # ones (its ring algorithm exchanges chunks with a preamble) and aborts the process; sglang's model forward
    # all_reduce (7 vs 8 tokens × 64 hidden, float16) is the last case
    (("all_reduce", "SUM", 4, F32, None), ("all_reduce", "SUM", 8, F32, None)),
    (("all_reduce", "SUM", 16, F32, None), ("all_reduce", "SUM", 32, F32, None)),
    (("all_reduce", "SUM", 64, F32, None), ("all_reduce", "SUM", 128, F32, None)),
    (("all_reduce", "SUM", 256, F32, None), ("all_reduce", "SUM", 512, F32, None)),
    (("all_reduce", "SUM", 4096, F32, None), ("all_reduce", "SUM", 8192, F32, None)),
    (("all_reduce", "SUM", 448, F16, None), ("all_reduce", "SUM", 512, F16, None)),
    (("broadcast", None, 1, I64, 0), ("all_reduce", "MAX", 1, I64, None)),
    (("all_reduce", "MAX", 1, I64, None), ("broadcast", None, 1, I64, 0)),
    (("broadcast", None, 1, I32, 0), ("all_reduce", "MAX", 1, I32, None)),
    (("broadcast", None, 1, I64, 0), ("broadcast", None, 1, I64, 0)),
    (("broadcast", None, 1, I64, 0), ("broadcast", None, 4, I64, 0)),
    (("broadcast", None, 1, I64, 0), ("broadcast", None, 1, I64, 1)),
    (("broadcast", None, 1, I64, 0), ("broadcast", None, 1, I32, 0)),
    (("all_gather", None, 1, I32, None), ("all_reduce", "SUM", 1, I32, None)),
    (("all_gather", None, 1, I32, None), ("all_gather", None, 4, I32, None)),
    (("all_gather", None, 1, I32, None), ("broadcast", None, 1, I32, 0)),
    (("all_gather_into_tensor", None, 1, I32, None), ("all_reduce", "SUM", 1, I32, None)),
    (("barrier", None, 0, None, None), ("all_reduce", "SUM", 1, I32, None)),
    (("barrier", None, 0, None, None), ("broadcast", None, 1, I64, 0)),
    (("barrier", None, 0, None, None), ("barrier", None, 0, None, None)),
    (("all_reduce", "SUM", 1, I32, None), None),
    (("all_reduce", "MAX", 1, I64, None), None),
    (("broadcast", None, 1, I64, 0), None),
    (None, ("broadcast", None, 1, I64, 0)),
    (("all_gather", None, 1, I32, None), None),
    (("barrier", None, 0, None, None), None),
]


def _run_side(side, group, dist, torch):
    op, red, numel, dtype, src = side
    world = dist.get_world_size(group)
    dt = getattr(torch, dtype) if dtype else None
    if op == "all_reduce":
        dist.all_reduce(torch.ones(numel, dtype=dt), op=getattr(dist.ReduceOp, red), group=group)
    elif op == "broadcast":
        dist.broadcast(torch.ones(numel, dtype=dt), src=dist.get_global_rank(group, src), group=group)
    elif op == "all_gather":
        t = torch.ones(numel, dtype=dt)
        dist.all_gather([torch.zeros_like(t) for _ in range(world)], t, group=group)
    elif op == "all_gather_into_tensor":
        t = torch.ones(numel, dtype=dt)
        dist.all_gather_into_tensor(torch.zeros(numel * world, dtype=dt), t, group=group)
    elif op == "barrier":
        dist.barrier(group=group)
    else:
        raise ValueError(op)


def worker(rank: int, case: int, init: str, out: str, hang_s: float) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))
    g = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=600))
    side = CASES[case][rank]
    box: dict = {}

    def call() -> None:
        try:
            _run_side(side, g, dist, torch)
            box["r"] = "returned"
        except Exception as e:  # noqa: BLE001 - the message is the measurement
            box["r"] = f"raised: {type(e).__name__}: {str(e).splitlines()[0][:200]}"

    if side is None:
        res = "idle"
        time.sleep(hang_s)
    else:
        th = threading.Thread(target=call, daemon=True, name=f"case-{case}")
        th.start()
        th.join(hang_s)
        res = box.get("r", "blocked")
    with open(out + ".tmp", "w") as f:
        json.dump({"rank": rank, "result": res, "torch": torch.__version__}, f)
    os.replace(out + ".tmp", out)
    time.sleep(hang_s)  # the peer may still be waiting on its own call: do not reset the connection under it
    os._exit(0)


def run_case(i: int, tmp: str, hang_s: float) -> tuple[str, str, str]:
    """Run case ``i`` in two fresh worker processes; (rank 0's result, rank 1's, torch version)."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    env.pop("REPRO_PLAN", None)
    env.pop("PYTHONPATH", None)
    outs, errs = [f"{tmp}/c{i}-r{r}.json" for r in (0, 1)], [f"{tmp}/c{i}-r{r}.err" for r in (0, 1)]
    procs = []
    for r in (0, 1):
        with open(errs[r], "w") as ef:
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(r), "--case", str(i),
                                           "--init", f"{tmp}/init-{i}", "--result", outs[r], "--hang-s", str(hang_s)],
                                          env=env, stderr=ef, stdout=subprocess.DEVNULL, start_new_session=True))
    try:
        for p in procs:
            try:
                p.wait(timeout=90 + 2 * hang_s)
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    got, ver = [], ""
    for r, p in enumerate(procs):
        if Path(outs[r]).exists():
            d = json.loads(Path(outs[r]).read_text())
            got.append(d["result"])
            ver = d["torch"]
        else:
            lines = [ln for ln in Path(errs[r]).read_text(errors="replace").splitlines() if ln.strip()]
            why = next((ln.strip() for ln in lines if "what()" in ln or "Error" in ln), lines[-1] if lines else "")
            got.append(f"raised: process died (exit {p.returncode}): {why[:200]}")
    return got[0], got[1], ver


def _side_json(s):
    if s is None:
        return None
    op, red, numel, dtype, src = s
    return {"op": op, "red": red, "numel": numel, "dtype": dtype, "src": src}


def classify(r0: str, r1: str) -> str:
    if r0.startswith("raised") or r1.startswith("raised"):
        return "crash"
    if "blocked" in (r0, r1):
        return "hangs"
    return "pairs"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "repro" / "data" / "pairing_gloo.json"))
    ap.add_argument("--hang-s", type=float, default=2.0)
    ap.add_argument("--worker", type=int, default=None)
    ap.add_argument("--case", type=int, default=0)
    ap.add_argument("--init", default="")
    ap.add_argument("--result", default="")
    a = ap.parse_args()
    if a.worker is not None:
        worker(a.worker, a.case, a.init, a.result, a.hang_s)
        return 0
    t0 = time.time()
    cases, ver = [], ""
    with tempfile.TemporaryDirectory(prefix="repro-pairing-") as tmp:
        for i, (sa, sb) in enumerate(CASES):
            r0, r1, v = run_case(i, tmp, a.hang_s)
            ver = v or ver
            solo = sa is None or sb is None
            cases.append({"a": _side_json(sa), "b": _side_json(sb),
                          "outcome": ("blocks" if "blocked" in (r0, r1) else "returns") if solo else classify(r0, r1),
                          "rank0": r0, "rank1": r1})
            print(f"{cases[-1]['outcome']:8} {sa} | {sb}  -> {r0} / {r1}", flush=True)
    data = {"backend": "gloo", "world_size": 2, "hang_s": a.hang_s,
            "measured": {"torch": ver, "date": time.strftime("%Y-%m-%d", time.gmtime()),
                         "by": "scripts/measure_pairing.py", "seconds": round(time.time() - t0, 1)},
            "note": "a: rank 0's call, b: rank 1's (null: that rank issues nothing in that group: a solo case); "
                    "src is the broadcast source's rank in the group",
            "cases": cases}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
