"""Start a server in its own session / process group, wait until it is healthy, and stop its whole tree.

``start_server`` picks free ports when the spec says 0, checks given ports are free, starts the adapter's command
with ``start_new_session=True`` (the server leads its own process group, so Ctrl-C in the terminal does not reach it
directly and the harness decides when it ends) and writes its stdout+stderr to a log file. ``Server.stop`` first
snapshots the tree with start times (clock ticks since boot, :mod:`repro.procs`), then SIGTERM / grace / SIGKILL,
then verifies every snapshotted process is gone. It is idempotent and is called on context-manager exit, including
KeyboardInterrupt. While the root is our own unreaped child (``Popen.poll()`` is None) its pid cannot have been
reused, so it is always treated as ours — a check of its identity can never make the harness skip stopping it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, TypeVar

import requests

from repro import evidence as ev
from repro import procs as _procs
from repro.procs import ProcInfo
from repro.shm_files import registered_in
from repro.targets.base import Adapter, LaunchSpec, flag_value

LOG_TAIL_LINES = 30
# A start-up log line saying a port the harness picked as free was bound by another process first (uvicorn's
# "[Errno 98] error while attempting to bind on address …: address already in use", torch's TCPStore "EADDRINUSE",
# a metrics exporter's "Address already in use"). The process may stay alive after it (sglang's HTTP server did:
# the stack then waited out its whole start-up time-out), so the wait stops at once on such a line.
PORT_LOST_RE = re.compile(r"address already in use|EADDRINUSE", re.IGNORECASE)
PORT_CHECK_S = 2.0  # seconds between two looks at the start-up log for PORT_LOST_RE
PORT_RACE_ATTEMPTS = 3  # starts in all when each start loses a port it picked free (start_retrying_port_races)


class LaunchError(Exception):
    """The server could not be started or did not become healthy; ``str()`` is one line naming the fix."""


def port_free(host: str, port: int) -> bool:
    """True iff a TCP socket can bind ``host:port`` right now (no SO_REUSEADDR, so TIME_WAIT counts as in use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def pick_free_port(host: str = "127.0.0.1", exclude: tuple[int, ...] = ()) -> int:
    """A port the OS reports free on ``host`` (bind to 0), not in ``exclude``, and whose +1 is also free.

    The +1 check leaves room for sglang's rendezvous helpers that use neighbouring ports. The port is free when
    returned; another process could still take it before the server binds (then start-up fails with a clear error).

    Raises:
        LaunchError: no free port found after 50 tries.
    """
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port in exclude or port + 1 in exclude or port + 1 > 65535:
            continue
        if port_free(host, port + 1):
            return port
    raise LaunchError(f"no free TCP port found on {host}; free some ports or pass --port/--nccl-port explicitly")


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


def _last_line(tail: str) -> str:
    """The last non-empty line of a log tail, cut to 200 characters."""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def port_lost_error(who: str, line: str, log_path: Path, tail: str) -> LaunchError:
    """The LaunchError for a start-up that lost a port it was given (``port_race``: the log line, ``log_tail`` set):
    the caller starts again on new ports when it picked them (``repro.run.session``, ``repro.pd``)."""
    err = LaunchError(f"{who} lost a port during start-up, another process bound it after it was picked as free: "
                      f"{line!r} (full log: {log_path}; start again, or pass ports nothing else uses)")
    err.port_race = line  # type: ignore[attr-defined]
    err.log_tail = tail  # type: ignore[attr-defined]
    return err


def lost_port_line(err: Exception, server: Optional["Server"] = None) -> Optional[str]:
    """The log line saying a start-up lost a port (:data:`PORT_LOST_RE`): from a :func:`port_lost_error`, else from
    the error's text and log tail, else from ``server``'s log since its launch; None when the start failed otherwise."""
    line = getattr(err, "port_race", None)
    if isinstance(line, str) and line:
        return line
    for ln in f"{err}\n{getattr(err, 'log_tail', '')}".splitlines():
        if PORT_LOST_RE.search(ln):
            return ln.strip()[:300]
    return server.port_lost() if server is not None else None


_T = TypeVar("_T")


def start_retrying_port_races(start: Callable[[int], _T], wait: Callable[[_T], float], stop: Callable[[_T], None],
                              lost: Callable[[LaunchError, _T], Optional[str]] = lambda e, _it: lost_port_line(e),
                              observe: Optional[Callable[[str, dict], Any]] = None) -> tuple[_T, float]:
    """Start something and wait until it is healthy; when the wait fails because it lost a port (``lost`` names the
    log line, :func:`lost_port_line` by default), stop it and start again, up to :data:`PORT_RACE_ATTEMPTS` starts
    in all. The one loop of the one-server session (``repro.run.session``) and of a PD stack (``repro.pd``).

    Args:
        start: ``start(attempt)`` → the started thing (attempt counts from 1; a LaunchError it raises propagates);
        wait: seconds it took to become healthy, LaunchError when it did not; stop: ends one that lost a port;
        lost: the lost-port log line of a failed wait, None when it failed otherwise (then no retry);
        observe: ``observe("relaunch", {"attempt", "why"})`` before each new start.
    Returns:
        ``(the healthy thing, seconds its wait took)``.
    Raises:
        LaunchError: a start or a wait failed for another reason, or the last start lost a port too; the failed thing
            is not stopped (the caller, which saw it from ``start``, stops it).
    """
    for attempt in range(1, PORT_RACE_ATTEMPTS + 1):
        it = start(attempt)
        try:
            return it, wait(it)
        except LaunchError as e:
            line = lost(e, it)
            if not line or attempt == PORT_RACE_ATTEMPTS:
                raise
            stop(it)
            if observe is not None:
                observe("relaunch", {"attempt": attempt + 1, "why": f"port taken during start-up ({line})"})
    raise AssertionError("unreachable")  # the loop returns or raises


def registered_shm_files(folder: Path, pids: Iterable[int], shm_dir: Path = _procs.SHM_DIR) -> set[Path]:
    """The ``shm_dir`` files of the names processes ``pids`` registered with multiprocessing's resource tracker, from
    the injector's ``mpnames-<pid>.txt`` in ``folder`` (injectors/repro_injector/_proc.py ``record_mp_names``):
    ``semaphore /mp-x`` → ``sem.mp-x``, ``shared_memory /psm_x`` → ``psm_x``. Such a name is closed and mapped by
    no process once created, so ``repro.procs.shm_files_of`` cannot see it; it is left behind when the tracker is killed
    (sglang 0.5.23's launcher SIGKILLs its children on SIGTERM). Unreadable files and other lines add nothing
    (:func:`repro.shm_files.registered_in`)."""
    out: set[Path] = set()
    for pid in set(pids):
        try:
            text = (Path(folder) / ev.Layout.mp_names_file(pid)).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        out |= registered_in(text, shm_dir)
    return out


def _last_error_line(tail: str) -> str:
    """The most telling line of a log tail: the last exception line if any, else the last non-empty line."""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "Exception" in ln or ln.startswith("AssertionError"):
            return ln[:300]
    return lines[-1][:300] if lines else "(empty log)"


class Server:
    """A running server started by :func:`start_server`.

    Attributes:
        spec: the launch spec with concrete ports.
        command: argv it was started with.
        env: full environment it was started with.
        log_path: file receiving its stdout and stderr.
        popen: the ``subprocess.Popen`` of the root (HTTP server) process.
        root: snapshot of the root process (pid + create time).
    """

    def __init__(self, adapter: Adapter, spec: LaunchSpec, command: list[str], env: dict[str, str],
                 log_path: Path, popen: subprocess.Popen, log_file) -> None:
        self.adapter = adapter
        self.spec = spec
        self.command = command
        self.env = env
        self.log_path = log_path
        self.popen = popen
        self._log_file = log_file
        self.root: Optional[ProcInfo] = _procs.proc_info(popen.pid)
        self._known: dict[tuple, ProcInfo] = {}
        if self.root is not None:
            self._known[self.root.key] = self.root
        self._stopped = False
        self._leftover: list[ProcInfo] = []
        self._owned_dirs: list[Path] = list(adapter.owned_dirs(env))
        self.launched_at = time.time()  # shm segments changed before this are not the tree's (remove_shm_files)
        self._shm: set[Path] = set()
        self.log_start = 0  # the log's size when this launch started writing to it (the log keeps earlier attempts)

    # ---- info ------------------------------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        """pid of the root (HTTP server) process, which leads the server's process group."""
        return self.popen.pid

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:30123``."""
        host = "127.0.0.1" if self.spec.host in ("0.0.0.0", "") else self.spec.host
        return f"http://{host}:{self.spec.port}"

    @property
    def owned_dirs(self) -> list[Path]:
        """Folders this server owns and removes at stop (the adapter's :meth:`owned_dirs`, e.g. a HiCache temp folder)."""
        return list(self._owned_dirs)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """Last ``lines`` lines of the server log."""
        return _tail(self.log_path, lines)

    def port_lost(self) -> Optional[str]:
        """The first line this launch wrote to its log that says a port was taken (:data:`PORT_LOST_RE`), cut to
        300 characters; None when there is none (earlier attempts' lines in the same log are not read)."""
        try:
            with open(self.log_path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(self.log_start, size - 256 * 1024))
                data = f.read().decode("utf-8", errors="replace")
        except OSError:
            return None
        for ln in data.splitlines():
            if PORT_LOST_RE.search(ln):
                return ln.strip()[:300]
        return None

    def _root_is_ours(self) -> bool:
        """True while the root is our unreaped child (its pid cannot be reused), or it is still the same process."""
        if self.popen.poll() is None:
            return True
        return self.root is not None and _procs.alive(self.root)

    def procs(self) -> list[ProcInfo]:
        """Live snapshot of the server tree (root + descendants); also remembered for :meth:`stop`."""
        if not self._root_is_ours():
            return []
        snap = _procs.snapshot_tree(self.pid)
        for p in snap:
            self._known[p.key] = p
        return snap

    def launch_mark(self) -> dict:
        """The mark that says the harness itself started this tree, for ``processes.json`` (``repro cleanup`` ends
        only trees carrying it); see :func:`repro.procs.launch_mark`."""
        return _procs.launch_mark(self.root, self.pid, tokens=[t for t in [self.env.get(_procs.LAUNCH_TOKEN_ENV)] if t])

    def rank_pids(self) -> dict[int, int]:
        """rank → pid of the scheduler processes, from their titles (``adapter.rank_pids``)."""
        return self.adapter.rank_pids(self.procs())

    def is_running(self) -> bool:
        """True while the root process has not exited."""
        return self.popen.poll() is None

    # ---- health ----------------------------------------------------------------------------------------------
    def health_ok(self, timeout_s: float = 2.0) -> bool:
        """One health probe: True iff ``GET <url><health_path>`` answers 200 within ``timeout_s`` seconds."""
        try:
            r = requests.get(self.url + self.adapter.health_path, timeout=timeout_s)
            return r.status_code == 200
        except requests.RequestException:
            return False

    def note_healthy(self) -> None:
        """The tree answered its health check: remember the shared-memory files it maps now, for :meth:`stop`. A
        rank that dies before the stop (a test kills one; an engine crash; sglang's idle invariant check) maps
        nothing by then, and nobody unlinks its files (SGLang's ``sglang_loads_*.shm`` load snapshots, created by each
        scheduler at start-up). Called by :meth:`wait_healthy` and by a PD stack's wait (``repro.pd.Stack``)."""
        self._shm |= _procs.shm_files_of(self.procs())

    def wait_healthy(self, timeout_s: float, poll_s: float = 0.5,
                     progress: Optional[Callable[[float, str], None]] = None, progress_every_s: float = 15.0) -> float:
        """Poll health until it answers 200; returns the seconds waited.

        ``progress(waited_s, last_log_line)`` is called every ``progress_every_s`` seconds while it waits (for a
        start-up that takes 30–100 s on CPU, so a user sees it is still loading). Once healthy, the shared-memory
        files the tree maps are remembered for :meth:`stop` (a rank that dies before the stop maps nothing then).

        Raises:
            LaunchError: the server process exited (message: exit code + the log's last error line + log path), or
                ``timeout_s`` passed (message: how long, the log path, the last log line). The log tail is in
                ``err.log_tail``.
        """
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        next_progress = t0 + progress_every_s
        next_port_check = t0 + PORT_CHECK_S
        while True:
            if progress is not None and time.monotonic() >= next_progress:
                next_progress += progress_every_s
                progress(time.monotonic() - t0, _last_line(self.log_tail(5)))
            self.procs()  # remember every process seen, so stop() ends children even if the root dies first
            rc = self.popen.poll()
            if rc is not None:
                tail = self.log_tail()
                err = LaunchError(
                    f"server exited with code {rc} during start-up: {_last_error_line(tail)} "
                    f"(full log: {self.log_path}; fix the cause above, or check the interpreter with --python)"
                )
                err.log_tail = tail  # type: ignore[attr-defined]
                raise err
            if self.health_ok(timeout_s=min(2.0, max(0.1, deadline - time.monotonic()))):
                self.note_healthy()
                return time.monotonic() - t0
            if time.monotonic() >= next_port_check:
                next_port_check = time.monotonic() + PORT_CHECK_S
                lost = self.port_lost()
                if lost:
                    raise port_lost_error("server", lost, self.log_path, self.log_tail())
            if time.monotonic() >= deadline:
                tail = self.log_tail()
                err = LaunchError(
                    f"server not healthy after {timeout_s:.0f} s at {self.url}{self.adapter.health_path}: last log line "
                    f"{_last_error_line(tail)!r} (full log: {self.log_path}; raise startup_timeout_s if it was still loading)"
                )
                err.log_tail = tail  # type: ignore[attr-defined]
                raise err
            time.sleep(poll_s)

    # ---- stop ------------------------------------------------------------------------------------------------
    def stop(self, grace_s: float = 10.0) -> list[ProcInfo]:
        """End the whole tree and verify it is gone. Idempotent.

        Snapshots the tree (with create times) before signalling, adds every process seen by earlier
        :meth:`procs` calls and the live members of the server's own session (children re-parented away, also
        those of a root that died before any snapshot saw them, are still ended), SIGTERMs the process group then each
        process, waits ``grace_s`` seconds, SIGKILLs what is left, reaps the root and closes the log file. Removes
        folders the adapter says the server owned (e.g. a temporary HiCache storage folder) and, once nothing of
        the tree is left, the files the adapter finds it left behind (``leftover_files``: vLLM's shm segments).

        Returns:
            Processes still alive after SIGKILL (should be empty; the same list on repeated calls).
        """
        if self._stopped:
            self._leftover = [p for p in self._leftover if _procs.alive(p)]
            return list(self._leftover)
        try:
            self.procs()
            if self.root is not None:  # members of the server's own session that left the tree (root died first)
                for p in _procs.session_members(self.pid, self.root.start_ticks):
                    self._known.setdefault(p.key, p)
            snap = [p for p in self._known.values()]
            # Root first in the list so stop_procs signals it last (it signals in reverse order).
            snap.sort(key=lambda p: (p.pid != self.pid, p.pid))
            # the shared-memory files the tree maps, read before it is signalled: SIGKILLed processes never unlink
            # them (SGLang's sgl_shm_mq_* message queues, its load snapshots, Python's psm_* and sem.* files)
            self._shm |= _procs.shm_files_of(snap)
            left = _procs.stop_procs(snap, grace_s=grace_s)
            if self.popen.poll() is None:
                # Still our unreaped child although stop_procs saw no live match (its identity could not be read):
                # its pid is ours for sure, so end its group and it directly.
                self._kill_own_root()
            try:
                self.popen.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
            self._leftover = left
            self._stopped = True  # only once the whole stop ran: an interrupted stop is retried by the next call
        finally:
            if self._stopped:
                try:
                    self._log_file.close()
                except OSError:
                    pass
                for d in self._owned_dirs:
                    shutil.rmtree(d, ignore_errors=True)
                if not self._leftover:  # files the engine leaves behind (vLLM's shm segments, file store)
                    self._shm |= self._registered_shm()
                    _procs.remove_shm_files(self._shm, self.launched_at)
                    for f in self.adapter.leftover_files(self.log_path):
                        try:
                            f.unlink()
                        except OSError:
                            pass
        return list(self._leftover)

    def _registered_shm(self) -> set[Path]:
        """/dev/shm files of the names this tree's processes registered with multiprocessing's resource tracker (the
        injector's ``mpnames-<pid>.txt`` in the plan's ``out_dir``; :func:`registered_shm_files`); none without a plan."""
        plan = self.env.get("REPRO_PLAN")  # repro.scenario.PLAN_ENV (a layer above this one)
        try:
            out_dir = json.loads(Path(plan).read_text(encoding="utf-8"))["out_dir"] if plan else None
        except (OSError, ValueError, KeyError, TypeError):
            out_dir = None
        if not out_dir:
            return set()
        return registered_shm_files(Path(out_dir), {p.pid for p in self._known.values()})

    def _kill_own_root(self) -> None:
        """SIGKILL the root's process group and the root itself; only called while ``Popen.poll()`` is None."""
        import signal

        for fn in (lambda: os.killpg(self.pid, signal.SIGKILL), self.popen.kill):
            try:
                fn()
            except (ProcessLookupError, PermissionError, OSError):
                pass

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


FORK_RANKS_ENV = "REPRO_FORK_RANKS"  # read by the injector in the launcher (injectors/repro_injector/_fork.py)
# the harness's opt-ins a server reads from its environment: a local launch inherits them with os.environ; a launch
# whose environment starts empty (a multi-host node over ssh, repro.multihost) must carry them (harness_opt_ins)
HARNESS_OPT_INS = (FORK_RANKS_ENV,)


def harness_opt_ins(env: Mapping[str, str]) -> dict[str, str]:
    """The harness opt-ins set in ``env`` (``HARNESS_OPT_INS``: ``REPRO_FORK_RANKS``), as a launch environment's base
    for a server that does not inherit the harness's environment (a node started over ssh or a command template)."""
    return {k: env[k] for k in HARNESS_OPT_INS if k in env}


def check_fork_ranks(env: dict[str, str], args: list[str], forks: bool = True) -> None:
    """Check the fork-ranks opt-in before a launch: ``REPRO_FORK_RANKS`` unset, ``0`` or ``1``, and ``1`` only with
    ``--device cpu`` in the server's ``args`` (the injector forks SGLang's ranks instead of spawning them; after
    CUDA/NCCL initialisation that is unsafe, so a GPU launch must keep spawn).

    Args:
        forks: whether the server's adapter declares a call the injector may switch (``InjectorProfile.fork_plan``);
            False (a PD stack's router, an engine without one): the opt-in does not apply to it, only its value is
            checked.
    Raises:
        LaunchError: another value, or ``1`` without ``--device cpu`` (the message names the fix).
    """
    v = env.get(FORK_RANKS_ENV, "")
    if v not in ("", "0", "1"):
        raise LaunchError(f"{FORK_RANKS_ENV}={v!r}: expected 1 (fork the ranks) or 0 / unset (spawn them, the default)")
    if v == "1" and forks and flag_value(args, "--device") != "cpu":
        raise LaunchError(f"{FORK_RANKS_ENV}=1 is for CPU servers only (this launch has --device "
                          f"{flag_value(args, '--device')!r}): forking ranks after CUDA/NCCL initialisation is unsafe; "
                          f"unset {FORK_RANKS_ENV}")


def start_server(adapter: Adapter, spec: LaunchSpec, log_path: Path) -> Server:
    """Start ``spec`` through ``adapter`` in a new session, stdout+stderr appended to ``log_path``.

    Ports equal to 0 are replaced by free ones (HTTP port and rendezvous port distinct); given ports are checked.
    Does not wait for health: call :meth:`Server.wait_healthy`. Use as a context manager (or call
    :meth:`Server.stop` in ``finally``) so the tree ends on every path.

    Returns:
        The :class:`Server` (``server.spec`` has the concrete ports).
    Raises:
        LaunchError: a given port is in use (names the port and ``--port`` / ``--nccl-port``), the interpreter
            does not exist, the fork-ranks opt-in is malformed or asked for off a CPU device
            (:func:`check_fork_ranks`), or the process could not be started.
    """
    if not Path(spec.python).exists() and shutil.which(spec.python) is None:
        raise LaunchError(
            f"server interpreter {spec.python} does not exist; pass --python PATH or run scripts/cpu_testbed/setup.sh"
        )
    for name, flag in (("port", "--port"), ("nccl_port", "--nccl-port")):
        v = getattr(spec, name)
        if v and not port_free(spec.host if name == "port" else "127.0.0.1", v):
            raise LaunchError(f"{name.replace('_', ' ')} {v} is already in use; pass another {flag} (or 0 to pick a free one)")
    if spec.port and spec.nccl_port and spec.port == spec.nccl_port:
        raise LaunchError(f"--port and --nccl-port are both {spec.port}; pass two different ports")
    port = spec.port or pick_free_port(spec.host, exclude=(spec.nccl_port,))
    nccl_port = spec.nccl_port or pick_free_port("127.0.0.1", exclude=(port, port + 1))
    spec = replace(spec, port=port, nccl_port=nccl_port)

    command = adapter.launch_command(spec)
    env = adapter.launch_env(spec, dict(os.environ))
    check_fork_ranks(env, spec.args, forks=bool(adapter.injector_profile.fork_plan()))
    # a per-launch secret every process of the tree inherits: `repro cleanup` signals a recorded pid only when its
    # /proc/<pid>/environ carries it (a hand-written processes.json cannot name it for an unrelated process)
    env[_procs.LAUNCH_TOKEN_ENV] = secrets.token_hex(16)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(log_path, "ab", buffering=0)
    log_file.write(f"# repro launch: {' '.join(command)}\n".encode())
    log_start = log_file.tell()
    try:
        launched_at = time.time()
        popen = subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True,
        )
    except OSError as e:
        log_file.close()
        raise LaunchError(f"could not start {command[0]}: {e.strerror}; check --python") from None
    server = Server(adapter, spec, command, env, log_path, popen, log_file)
    server.launched_at = launched_at
    server.log_start = log_start
    return server
