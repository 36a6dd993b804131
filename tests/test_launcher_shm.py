"""A server tree's named semaphores are gone after its stop, even when the tree killed the resource tracker that
would have unlinked them (sglang 0.5.23's launcher answers SIGTERM with ``kill_process_tree``: SIGKILL to its
children, the tracker among them; every stop left two ``/dev/shm/sem.mp-*`` files, mapped by no process).

A stand-in server (not SGLang) under the real injector: it registers a spawn-style semaphore name with
multiprocessing's resource tracker, closes it (as sglang's are: no process maps it), and on SIGTERM SIGKILLs the
tracker and exits. The injector records the name (``mpnames-<pid>.txt``); ``Server.stop`` unlinks its file.
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

from repro.launcher import registered_shm_files, start_server
from repro.procs import SHM_DIR, alive
from repro.targets.base import LaunchSpec
from repro.targets.sglang import SGLangAdapter

REPO = Path(__file__).resolve().parent.parent

SERVER = textwrap.dedent('''
    import _multiprocessing, os, signal, sys
    import multiprocessing.synchronize as syn
    from multiprocessing import resource_tracker
    port = int(sys.argv[1])
    sl = _multiprocessing.SemLock(syn.SEMAPHORE, 1, 1, "/mp-reprotest%d" % os.getpid(), False)
    resource_tracker.register(sl.name, "semaphore")  # what SemLock does in a spawn context
    del sl  # closed: no process maps it; only the tracker would unlink it, at its shutdown
    def term(*a):  # like sglang's kill_process_tree: SIGKILL the children (the tracker), then exit
        os.kill(resource_tracker._resource_tracker._pid, signal.SIGKILL)
        os._exit(0)
    signal.signal(signal.SIGTERM, term)
    sys.path.insert(0, FAKE_SERVERS)
    from health_ok import serve
    serve(port)
''').replace("FAKE_SERVERS", repr(str(Path(__file__).resolve().parent / "fake_servers")))


class _StandIn(SGLangAdapter):
    def __init__(self, script: Path):
        self.script = script

    def launch_command(self, spec: LaunchSpec) -> list[str]:
        return [sys.executable, str(self.script), str(spec.port)]


def test_a_stopped_tree_leaves_no_semaphore_its_killed_tracker_would_have_unlinked(tmp_path: Path) -> None:
    script, out = tmp_path / "server.py", tmp_path / "injector"
    script.write_text(SERVER)
    out.mkdir()
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "scenario": "shm", "variant": "v", "out_dir": str(out),
                                "arm_file": str(tmp_path / "ARM"), "arm_poll_s": 0.5, "injections": []}))
    spec = LaunchSpec(python=sys.executable, model="unused", tp_size=1,
                      env={"REPRO_PLAN": str(plan), "PYTHONPATH": str(REPO / "injectors")})
    server = start_server(_StandIn(script), spec, tmp_path / "server.log")
    sem = SHM_DIR / f"sem.mp-reprotest{server.pid}"
    try:
        server.wait_healthy(30)
        assert sem.exists(), "the stand-in did not create its semaphore"
        assert registered_shm_files(out, [server.pid]) == {sem}  # the injector recorded the name
        assert server.stop() == []
        assert not sem.exists(), "the stopped tree left its semaphore in /dev/shm"
    finally:
        server.stop()
        sem.unlink(missing_ok=True)


RANK_DIES = textwrap.dedent('''
    import subprocess, sys
    port, name, die = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    RANK = (  # like a scheduler's load-snapshot writer: create and map a /dev/shm file, never unlink it
        "import mmap, os, sys, time\\n"
        "fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600); os.ftruncate(fd, 4096)\\n"
        "m = mmap.mmap(fd, 4096); print('mapped', flush=True)\\n"
        "while not os.path.exists(sys.argv[2]): time.sleep(0.05)\\n"
        "os._exit(1)\\n")
    rank = subprocess.Popen([sys.executable, "-c", RANK, name, die], stdout=subprocess.PIPE, text=True)
    rank.stdout.readline()  # healthy only once the rank mapped its file
    sys.path.insert(0, FAKE_SERVERS)
    from health_ok import serve
    serve(port)
''').replace("FAKE_SERVERS", repr(str(Path(__file__).resolve().parent / "fake_servers")))


class _RankDies(_StandIn):
    def __init__(self, script: Path, name: Path, die: Path):
        super().__init__(script)
        self.name, self.die = name, die

    def launch_command(self, spec: LaunchSpec) -> list[str]:
        return [sys.executable, str(self.script), str(spec.port), str(self.name), str(self.die)]


def test_a_rank_dead_before_the_stop_leaves_no_shm_file_it_mapped(tmp_path: Path) -> None:
    """A rank that maps a /dev/shm file and dies while its server runs (SGLang's ``sglang_loads_*.shm``, written by
    each scheduler; the rank-death test kills one): at the stop no live process maps the file, so only what
    ``wait_healthy`` read once the tree was healthy names it. The old code (read at stop only) left it."""
    script, die = tmp_path / "server.py", tmp_path / "DIE"
    script.write_text(RANK_DIES)
    name = SHM_DIR / f"reprotest_loads_{tmp_path.name}.shm"
    server = start_server(_RankDies(script, name, die), LaunchSpec(python=sys.executable, model="unused", tp_size=1),
                          tmp_path / "server.log")
    try:
        server.wait_healthy(30)
        rank = [p for p in server.procs() if p.pid != server.pid]
        assert len(rank) == 1 and name.exists(), (rank, name)
        die.touch()
        for _ in range(200):
            if not any(alive(p) for p in rank):
                break
            time.sleep(0.05)
        assert not any(alive(p) for p in rank), "the stand-in rank did not exit"
        assert server.stop() == []
        assert not name.exists(), "the stopped tree left the dead rank's shm file in /dev/shm"
    finally:
        server.stop()
        name.unlink(missing_ok=True)
