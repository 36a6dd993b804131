"""The PD transfer-worker fault fix (scenarios/sglang/patches/sglang-0.5.23-pd-transfer-worker-fault.patch,
docs/findings/pd-transfer-worker-fault-stall.md) applies to the testbed's sglang 0.5.23 with no fuzz, and with it
sglang's own ``MooncakeKVManager.transfer_worker``, whose chunk processing raises, fails that one room
(``conclude_failure``) and keeps serving its queue until the ``None`` sentinel stops it. The real method runs in the
testbed interpreter on a manager built with ``object.__new__``; nothing of sglang is mocked but the room-status read,
which raises as the injected fault does, and ``conclude_failure``, which records the room.

The unpatched code fails the second test: the worker re-raises ("Transfer thread failed … is dead") and dies at the
first raise, failing no room."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from repro import refs, testbed
from repro.targets.sglang import SGLangAdapter

REPO = Path(__file__).resolve().parent.parent
PATCH = REPO / "scenarios" / "sglang" / "patches" / "sglang-0.5.23-pd-transfer-worker-fault.patch"
STUB = REPO / "scripts" / "cpu_testbed" / "stub"
LOC = SGLangAdapter().ref_location

PROG = r'''
import collections, json, logging, threading, time, types
logging.disable(logging.CRITICAL)
from sglang.srt.disaggregation.common.utils import FastQueue
from sglang.srt.disaggregation.mooncake import conn as mc
m = object.__new__(mc.MooncakeKVManager)
m.enable_trace = False
m._staging_outstanding = collections.defaultdict(int)
m.request_status = {7: 2, 8: 2}
m._deferred_ack_targets, m._deferred_ack_poisoned_rooms = {}, set()
failed = []
def check_status(room):
    raise OSError("the environment's transfer error")
m.check_status = check_status
m.conclude_failure = lambda **kw: failed.append(kw["bootstrap_room"])
q = FastQueue()
for room in (7, 8):
    q.put(types.SimpleNamespace(room=room, staging_counted=False, wait_event=None, indices_event=None,
                                prefill_kv_indices=[0], trace_ctx=None))
t = threading.Thread(target=m.transfer_worker, args=(q, None), daemon=True)
t.start()
time.sleep(1.0)
alive = t.is_alive()
q.put(None)
t.join(10)
print(json.dumps({"alive": alive, "failed": failed, "stopped": not t.is_alive(),
                  "poisoned": sorted(m._deferred_ack_poisoned_rooms)}))
'''


@pytest.fixture(scope="module")
def installed() -> tuple[str, Path]:
    py = testbed.testbed_python()
    if py is None:
        pytest.fail("the CPU testbed is not set up: run `bash scripts/cpu_testbed/setup.sh` (README, Set up)")
    return str(py), refs.package_location(str(py), loc=LOC)


def test_the_patch_applies_to_the_testbeds_sglang_without_fuzz(installed: tuple[str, Path], tmp_path: Path) -> None:
    text = PATCH.read_text(encoding="utf-8")
    strip = refs.patch_strip(PATCH, text, LOC)
    assert strip == 2
    for f in refs.patch_files(text):
        rel = Path(*f.split("/")[strip:])
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(installed[1].parent / rel, tmp_path / rel)
    refs.check_patch_applies(PATCH, tmp_path, strip, LOC)


def _run(py: str, pythonpath: str, tmp_path: Path) -> dict:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": pythonpath, "SGLANG_USE_CPU_ENGINE": "1", "HOME": str(tmp_path)}
    r = subprocess.run([py, "-c", PROG], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_raising_chunk_fails_its_room_and_the_worker_serves_the_next(installed: tuple[str, Path], tmp_path: Path) -> None:
    py, package = installed
    text = PATCH.read_text(encoding="utf-8")
    overlay = refs.make_overlay(package, PATCH, text, refs.patch_strip(PATCH, text, LOC), tmp_path, LOC)
    out = _run(py, f"{overlay}:{STUB}", tmp_path)
    assert out == {"alive": True, "failed": [7, 8], "stopped": True, "poisoned": [7, 8]}, out


def test_unpatched_the_worker_dies_at_the_first_raise(installed: tuple[str, Path], tmp_path: Path) -> None:
    """What the finding shows, in sglang's own method: the thread ends, no room is failed (the stall's cause)."""
    py, _ = installed
    out = _run(py, str(STUB), tmp_path)
    assert out["alive"] is False and out["failed"] == [] and out["poisoned"] == [7], out
