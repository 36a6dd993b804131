"""The io-aux fault fix (scenarios/sglang/patches/sglang-0.5.23-hicache-io-aux-fault-acks.patch,
docs/findings/hicache-io-aux-fault-stall.md) applies to the testbed's sglang 0.5.23 with no fuzz, and with it
sglang's own HiCacheController / HybridCacheController io-aux worker, whose `_page_transfer` raises, lives on and
puts as many per-batch PrefetchAcks as a rank whose transfer did not raise (one per STORAGE_BATCH_SIZE pages, plus
Hybrid's sidecar ack, then completed_req) — the count the peers' MIN reductions pair on. The real classes run in the
testbed interpreter; nothing of sglang is mocked but the transfer, which raises as the injected fault does.

The unpatched code fails the second test: the worker dies at the first raise and puts only `completed_req`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from repro import refs
from tests.patch_fixtures import LOC, assert_applies_without_fuzz, sglang_of_testbed

REPO = Path(__file__).resolve().parent.parent
PATCH = REPO / "scenarios" / "sglang" / "patches" / "sglang-0.5.23-hicache-io-aux-fault-acks.patch"
STUB = REPO / "scripts" / "cpu_testbed" / "stub"

PROG = r'''
import json, logging, queue, sys, threading, time
logging.disable(logging.CRITICAL)
from sglang.srt.managers import cache_controller as cc
from sglang.srt.mem_cache.hybrid_cache import hybrid_cache_controller as hc
out = {}
for name, cls, make in (
    ("base", cc.HiCacheController, lambda rid, n: cc.PrefetchOperation(rid, list(range(n)))),
    ("hybrid", hc.HybridCacheController,
     lambda rid, n: hc.PrefetchOperation(type("Handle", (), {"rid": rid})(), list(range(n)), pool_transfers=[])),
):
    c = object.__new__(cls)
    c.storage_stop_event, c.prefetch_buffer, c.prefetch_sync_queue = threading.Event(), queue.Queue(), queue.Queue()
    def boom(self, operation):
        raise OSError("the environment's read error")
    cls._page_transfer = boom
    ops = [make("r1", 2 * 300), make("r2", 2)]
    ops[0].hash_value, ops[1].hash_value = ["h"] * 300, ["h"]
    for op in ops:
        c.prefetch_buffer.put(op)
    t = threading.Thread(target=c.prefetch_io_aux_func, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while c.prefetch_sync_queue.qsize() < 2 and time.monotonic() < deadline and t.is_alive():
        time.sleep(0.05)
    time.sleep(0.3)
    out[name] = {"alive": t.is_alive(), "batch": cc.STORAGE_BATCH_SIZE,
                 "acks": [[a.rid, a.completed_tokens, a.pool_hits, a.completed_req] for a in list(c.prefetch_sync_queue.queue)]}
    c.storage_stop_event.set()
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def installed() -> tuple[str, Path]:
    return sglang_of_testbed()


def test_the_patch_applies_to_the_testbeds_sglang_without_fuzz(installed: tuple[str, Path], tmp_path: Path) -> None:
    assert_applies_without_fuzz(PATCH, installed[1], tmp_path)


def test_a_raising_transfer_leaves_the_worker_alive_and_the_ack_count_paired(installed: tuple[str, Path],
                                                                              tmp_path: Path) -> None:
    py, package = installed
    text = PATCH.read_text(encoding="utf-8")
    overlay = refs.make_overlay(package, PATCH, text, refs.patch_strip(PATCH, text, LOC), tmp_path, LOC)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{overlay}:{STUB}", "SGLANG_USE_CPU_ENGINE": "1",
           "HOME": str(tmp_path)}
    r = subprocess.run([py, "-c", PROG], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for name, sidecar in (("base", 0), ("hybrid", 1)):
        res, batches = out[name], -(-300 // out[name]["batch"])
        assert res["alive"], (name, res)
        r1 = [a for a in res["acks"] if a[0] == "r1"]
        # what a peer whose transfer did not raise puts: one ack per batch, the sidecar ack (Hybrid), completed_req
        assert [a[1] for a in r1[:batches]] == [0] * batches, (name, r1)
        assert len(r1) == batches + sidecar + 1 and r1[-1][3] is True, (name, r1)
        assert [a for a in res["acks"] if a[0] == "r2"][-1][3] is True, (name, res)  # the next operation ran too
