"""A launcher-shaped program for the injector's fork-ranks opt-in (``repro_injector._fork``), without SGLang.

Usage: python fork_ranks.py RESULT_DIR ARM_FILE [--caller engine|other] [--method spawn|forkserver] [--device cpu|cuda]

Does what SGLang 0.5.23's launcher does before its ranks exist, in miniature: imports the module that holds a
patched site (``fork_target``, imported before the start-method call, as the launcher imports the scheduler),
installs a SIGQUIT handler (sglang's ``launch_phase_sigquit_handler``), then calls
``mp.set_start_method(METHOD, force=True)`` from a function named ``_set_envs_and_config`` whose module is named
``sglang.srt.entrypoints.engine`` (``--caller engine``: the two lines of sglang's call, compiled under that module
name so the injector's caller check sees what it sees in the real launcher; ``--caller other``: from ``main``),
and starts one ``mp.Process`` (the rank) with the default context. A daemon thread runs in the parent meanwhile
(like the launcher's other threads).

The rank writes ``RESULT_DIR/rank.json``: its pid and parent, ``mp.get_start_method()``, whether SIGQUIT's handler is
the default, how many injector wrappers ``Worker.step`` carries (1 = patched once), its Python threads, the
resource trackers (pid, parent) of the parent and of itself once it created a shared-memory segment; then it
writes ``ARM_FILE`` (the plan's) and waits (≤ 10 s each) until its own ``fires-<pid>.jsonl`` has an ``armed`` event
(the injector's polling thread runs in it) and, after one gloo all_reduce (world size 1), until its own
``ledger-<pid>.jsonl`` has the collective's ``exit`` line without this program draining anything (the ledger's
writer thread runs in it). The parent writes ``RESULT_DIR/parent.json`` (start method, the rank's exit code).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import types
from pathlib import Path

import fork_target  # the module with the plan's site, imported (and patched) before the start-method call

ENGINE_SRC = """
import multiprocessing as mp

def _set_envs_and_config(server_args, method):
    # Set mp start method
    mp.set_start_method(method, force=True)
"""


def _wait_for(path: Path, needle: str, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if needle in path.read_text():
                return True
        except OSError:
            pass
        time.sleep(0.05)
    return False


def _trackers(parents: set) -> list:
    """[pid, ppid] of the multiprocessing resource trackers whose parent is in ``parents``."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes()
            ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"resource_tracker" in cmd and ppid in parents:
            out.append([int(d), ppid])
    return out


def rank(result_dir: str, arm_file: str, out_dir: str) -> None:
    res: dict = {"pid": os.getpid(), "ppid": os.getppid(), "start_method": mp.get_start_method(allow_none=True),
                 "sigquit_default": signal.getsignal(signal.SIGQUIT) == signal.SIG_DFL,
                 "sigquit": repr(signal.getsignal(signal.SIGQUIT)),  # what it is when it is not the default
                 "threads": sorted(t.name for t in threading.enumerate())}
    step, depth = fork_target.Worker.step, 0
    while getattr(step, "__repro_injection__", None):
        depth += 1
        step = step.__wrapped__
    res["wrappers"] = depth
    res["step"] = fork_target.Worker().step(3)
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(create=True, size=64)  # registers with a resource tracker (starts one if none)
    res["trackers"] = _trackers({os.getppid(), os.getpid()})
    shm.close()
    shm.unlink()
    out = Path(out_dir)
    Path(arm_file).write_text("noop\n")
    res["armed_seen"] = _wait_for(out / f"fires-{os.getpid()}.jsonl", '"event": "armed"')
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{result_dir}/gloo-init", rank=0, world_size=1)
    t = torch.ones(2)
    dist.all_reduce(t)
    res["ledger_written"] = _wait_for(out / f"ledger-{os.getpid()}.jsonl", '"e":"exit"')
    dist.destroy_process_group()
    Path(result_dir, "rank.json").write_text(json.dumps(res))


def main() -> int:
    result_dir, arm_file = sys.argv[1], sys.argv[2]
    opts = dict(zip(sys.argv[3::2], sys.argv[4::2]))
    caller, method, device = opts.get("--caller", "engine"), opts.get("--method", "spawn"), opts.get("--device", "cpu")
    out_dir = json.loads(Path(os.environ["REPRO_PLAN"]).read_text())["out_dir"]
    signal.signal(signal.SIGQUIT, lambda s, f: os._exit(9))
    stop = threading.Event()
    threading.Thread(target=stop.wait, name="launcher-side-thread", daemon=True).start()
    if caller == "engine":
        engine = types.ModuleType("sglang.srt.entrypoints.engine")
        exec(compile(ENGINE_SRC, "<sglang engine.py stand-in>", "exec"), engine.__dict__)
        engine._set_envs_and_config(types.SimpleNamespace(device=device), method)
    else:
        mp.set_start_method(method, force=True)
    used = mp.get_start_method()
    p = mp.Process(target=rank, args=(result_dir, arm_file, out_dir))
    p.start()
    p.join(60)
    Path(result_dir, "parent.json").write_text(json.dumps({"start_method": used, "exitcode": p.exitcode,
                                                            "pid": os.getpid(), "child": p.pid}))
    if p.exitcode is None:
        p.kill()
    return 0 if p.exitcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
