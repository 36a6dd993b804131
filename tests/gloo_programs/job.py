"""Start a multi-process gloo job (tests/gloo_programs/desync.py) and always end it by process group.

Used by tests (under the ``torch_python`` fixture) and benchmarks/capture_time.py. Each rank runs in its own
session (``start_new_session=True``), so ``os.killpg(pid, SIGKILL)`` ends exactly that rank and its children;
``stop()`` runs on success, failure and Ctrl-C (context manager ``__exit__``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional, Sequence

DESYNC = Path(__file__).resolve().parent / "desync.py"


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GlooJob:
    """``world_size`` processes of desync.py; ``pids`` maps rank → pid once started.

    Args:
        python: interpreter with torch.
        world_size: number of ranks.
        out_dir: folder for ready files, faulthandler files and rank logs.
        mode / extra_rank: see desync.py.
        fault_signal: register faulthandler on this signal (like the injector), or "" for none.
        lifetime_s: each rank exits by itself after this many seconds (orphan guard).
    """

    def __init__(self, python: str, world_size: int, out_dir: Path, *, mode: str = "extra-allreduce",
                 extra_rank: int = 0, fault_signal: str = "", lifetime_s: float = 180.0,
                 extra_args: Sequence[str] = ()) -> None:
        self.python = python
        self.world_size = world_size
        self.out_dir = Path(out_dir)
        self.mode = mode
        self.extra_rank = extra_rank
        self.fault_signal = fault_signal
        self.lifetime_s = lifetime_s
        self.extra_args = list(extra_args)
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items()}

    def start(self) -> "GlooJob":
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.out_dir.glob("ready-*"):
            stale.unlink()
        port = free_port()
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
        for r in range(self.world_size):
            argv = [self.python, str(DESYNC), str(r), str(self.world_size), str(port), str(self.out_dir),
                    "--mode", self.mode, "--extra-rank", str(self.extra_rank), "--lifetime-s", str(self.lifetime_s)]
            if self.fault_signal:
                argv += ["--fault-signal", self.fault_signal]
            argv += self.extra_args
            log = open(self.out_dir / f"rank{r}.log", "w")
            self.procs[r] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                             env=env)
            log.close()
        return self

    def wait_ready(self, timeout_s: float = 120.0, settle_s: float = 0.5) -> None:
        """Wait until every rank wrote its ready file (reached its hang point), then ``settle_s`` more seconds.

        Raises:
            RuntimeError: a rank exited or the job was not ready in ``timeout_s`` (message has the rank's log).
        """
        deadline = time.monotonic() + timeout_s
        restarts = 0
        while time.monotonic() < deadline:
            for r, p in list(self.procs.items()):
                if p.poll() is not None:
                    log = self.log(r)
                    if restarts < 2 and "address already in use" in log.lower():  # free_port() raced someone
                        restarts += 1
                        self.stop()
                        self.procs = {}
                        self.start()
                        break
                    logs = "\n".join(f"--- rank {k} (exit {q.poll()}):\n{self.log(k)[-1500:]}" for k, q in self.procs.items())
                    raise RuntimeError(f"rank {r} exited with {p.returncode}:\n{logs}")
            if all((self.out_dir / f"ready-{r}").exists() for r in self.procs):
                time.sleep(settle_s)
                return
            time.sleep(0.05)
        raise RuntimeError(f"gloo job not ready after {timeout_s} s; rank 0 log: {self.log(0)[-2000:]}")

    def log(self, rank: int) -> str:
        try:
            return (self.out_dir / f"rank{rank}.log").read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGKILL every rank's process group and reap it."""
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass

    def __enter__(self) -> "GlooJob":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> Optional[bool]:
        self.stop()
        return None
