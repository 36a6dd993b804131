"""Process-tree bookkeeping: snapshot a server's tree, check liveness safely, stop it, persist it.

A process is identified by ``(pid, start_ticks)``: its start time in clock ticks since boot (``/proc/PID/stat``
field 22, what the injector's loaded markers record too). A pid alone can be reused by an unrelated process after
the original exits, so nothing here ever signals a pid whose start time differs from the snapshot's. The start
ticks are used rather than psutil's ``create_time()`` because psutil derives that from the boot time in
``/proc/stat``, which moves when the wall clock is stepped (NTP, live migration, suspend): after a 33 s step the
same process reads 33 s apart. ``create_time`` is still recorded for people, and compared (10 ms tolerance) only
for snapshots written before start ticks were recorded (old evidence files) or where /proc cannot be read. Titles are read
from ``/proc/PID/cmdline`` (sglang's children rename themselves with ``setproctitle``, e.g.
``sglang::scheduler_TP1``), the way sglang's own tooling maps pids to ranks.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

import psutil

from repro import shm_files as _shm
from repro.shm_files import SHM_DIR

# create_time from psutil is a float in seconds; two reads of the same process agree exactly, a reused pid
# almost never starts in the same 10 ms tick. Compare with this tolerance (seconds).
_CREATE_TIME_TOL_S = 0.01


def start_ticks(pid: int) -> Optional[int]:
    """The start time of ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22); None when unreadable.

    Immune to wall-clock steps (unlike ``psutil.Process.create_time()``). Fields after the command name are split
    after its closing parenthesis, since the name itself may hold spaces or parentheses.
    """
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as fh:
            stat = fh.read().decode("ascii", "replace")
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def started_at(ticks: Optional[int]) -> Optional[float]:
    """Wall-clock start time (seconds since the epoch) of a process that started ``ticks`` clock ticks after boot:
    now minus its age from ``/proc/uptime``, good to a clock tick (psutil's ``create_time`` adds the boot time of
    ``/proc/stat``, whole seconds, so it can read up to 1 s early). None when ``ticks`` is None or /proc is
    unreadable."""
    if ticks is None:
        return None
    try:
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


@dataclass(frozen=True)
class ProcInfo:
    """One process as seen at snapshot time.

    Attributes:
        pid: process id.
        create_time: start time in seconds since the epoch (``psutil.Process.create_time()``).
        name: short name (``comm``, at most 15 characters; a proctitle may change it).
        cmdline: argv as read from ``/proc/PID/cmdline`` (after ``setproctitle``: one element, the title).
        start_ticks: start time in clock ticks since boot (``/proc/PID/stat`` field 22): the identity checked
            before any signal. None in snapshots written before it was recorded (then ``create_time`` is compared).
    """

    pid: int
    create_time: float
    name: str
    cmdline: list[str] = field(default_factory=list, hash=False, compare=False)
    start_ticks: Optional[int] = None

    @property
    def key(self) -> tuple:
        """A hashable identity: ``(pid, start_ticks)``, or ``(pid, create_time to 10 ms)`` without start ticks."""
        return (self.pid, "ticks", self.start_ticks) if self.start_ticks is not None else (self.pid, "ct", round(self.create_time, 2))

    @property
    def title(self) -> str:
        """The process title: the command line joined by spaces (``sglang::scheduler_TP0`` for a scheduler)."""
        return " ".join(self.cmdline).strip() or self.name


def _info(p: psutil.Process) -> Optional[ProcInfo]:
    try:
        with p.oneshot():
            if p.status() == psutil.STATUS_ZOMBIE:  # exited, only its exit status is left: nothing to stop
                return None
            ct = p.create_time()
            name = p.name()
            try:
                cmd = p.cmdline()
            except (psutil.AccessDenied, psutil.ZombieProcess):
                cmd = []
        return ProcInfo(pid=p.pid, create_time=ct, name=name, cmdline=list(cmd), start_ticks=start_ticks(p.pid))
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return None


def proc_info(pid: int) -> Optional[ProcInfo]:
    """Snapshot one pid; None when it does not exist or has exited (zombie)."""
    try:
        return _info(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return None


def snapshot_tree(root_pid: int) -> list[ProcInfo]:
    """Snapshot ``root_pid`` and all its live descendants (root first, then by pid); zombies are left out.

    Returns an empty list when the root no longer exists (or is a zombie). Orphans already re-parented away from the tree are not
    found here: take snapshots while the tree is intact (the launcher snapshots before every stop).
    """
    try:
        root = psutil.Process(root_pid)
    except psutil.NoSuchProcess:
        return []
    out: list[ProcInfo] = []
    r = _info(root)
    if r is None:
        return []
    out.append(r)
    try:
        kids = root.children(recursive=True)
    except psutil.NoSuchProcess:
        kids = []
    for k in sorted(kids, key=lambda c: c.pid):
        i = _info(k)
        if i is not None:
            out.append(i)
    return out


def session_members(sid: int, not_before_ticks: Optional[int]) -> list[ProcInfo]:
    """Live processes of session ``sid`` that started at or after ``not_before_ticks`` (clock ticks since boot).

    The launcher starts each server in a session of its own (``start_new_session=True``: session id = root pid), so
    these are the server's processes even after its root died and they were re-parented away from the tree, where
    :func:`snapshot_tree` no longer finds them (a root killed while it was still forking its first children, before
    any snapshot saw them). Linux does not hand out a pid that is still a live session's id, so while one member
    lives the id is ours; the start-tick bound keeps out anything older than the root. Zombies are left out.

    Args:
        sid: the session id (the root's pid).
        not_before_ticks: the root's start time in clock ticks since boot (:func:`start_ticks`); None finds nothing.
    Returns:
        The members by pid, each a :class:`ProcInfo`; [] when ``/proc`` cannot be read.
    """
    if not_before_ticks is None:
        return []
    out: list[ProcInfo] = []
    try:
        pids = sorted(int(d) for d in os.listdir("/proc") if d.isdigit())
    except OSError:
        return []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                fields = fh.read().decode("ascii", "replace").rsplit(")", 1)[1].split()
            if int(fields[3]) != sid or int(fields[19]) < not_before_ticks:
                continue
        except (OSError, IndexError, ValueError):
            continue
        info = proc_info(pid)
        if info is not None and info.start_ticks is not None and info.start_ticks >= not_before_ticks:
            out.append(info)
    return out


def same_start(p: ProcInfo) -> bool:
    """True iff the process now holding ``p.pid`` started when ``p`` did (False when no such pid).

    Compares start ticks (a clock step cannot change them); falls back to ``create_time`` within 10 ms only when
    ``p`` has no start ticks (a snapshot written by an older harness) or /proc cannot be read.
    Raises:
        psutil.AccessDenied: only from the fallback, when the process is not ours to inspect.
    """
    if p.start_ticks is not None:
        now = start_ticks(p.pid)
        if now is not None:
            return now == p.start_ticks
        if not psutil.pid_exists(p.pid):
            return False
    try:
        return abs(psutil.Process(p.pid).create_time() - p.create_time) <= _CREATE_TIME_TOL_S
    except psutil.NoSuchProcess:
        return False


def alive(p: ProcInfo) -> bool:
    """True iff a process with ``p.pid`` exists, is not a zombie, AND started when ``p`` did (:func:`same_start`).

    A reused pid (same number, different start time) counts as not alive: it is another process.
    """
    try:
        if not same_start(p):
            return False
        return psutil.Process(p.pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:  # exists but not ours to inspect: treat as alive (do not claim it is gone)
        return True


def shm_files_of(procs: Iterable[ProcInfo], shm_dir: Path = SHM_DIR) -> set[Path]:
    """Files under ``shm_dir`` that the live processes among ``procs`` map or hold open (:func:`repro.shm_files.mapped_by`:
    POSIX shared memory such as SGLang's ``sgl_shm_mq_<pid>_<hex>`` message queues and ``sglang_loads_*.shm`` load
    snapshots, Python's ``psm_*`` segments, ``sem.*`` named semaphores). Only processes that are still the recorded
    ones (:func:`alive`) are read, so a reused pid never adds another process's files; one that cannot be read adds
    nothing.

    Returns:
        Paths directly under ``shm_dir`` (a `` (deleted)`` mapping, already unlinked, is not returned).
    """
    out: set[Path] = set()
    for p in procs:
        if alive(p):
            out |= _shm.mapped_by(p.pid, shm_dir)
    return out


def remove_shm_files(files: Iterable[Path], created_after: float) -> list[Path]:
    """Unlink each of ``files`` that still exists and whose status changed at or after ``created_after`` (seconds
    since the epoch, the launch time of the tree that mapped them): a segment that existed before the tree started
    is someone else's and is kept. Call only once every process of the tree is gone (:func:`repro.shm_files.remove`).

    Returns:
        The files removed.
    """
    return _shm.remove(files, created_after)


def _signal(p: ProcInfo, sig: int) -> None:
    """Send ``sig`` to ``p`` (and its process group if it leads one), only if it is still the same process."""
    if not alive(p):
        return
    try:
        if os.getpgid(p.pid) == p.pid and p.pid != os.getpgrp():
            os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    # Re-check identity right before the direct signal: the group signal may have ended it and the pid could in
    # principle be reused in between.
    if alive(p):
        try:
            os.kill(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _reap(procs: Iterable[ProcInfo]) -> None:
    """Collect exit status of any of ``procs`` that are our own children (so they do not linger as zombies)."""
    for p in procs:
        try:
            os.waitpid(p.pid, os.WNOHANG)
        except (ChildProcessError, OSError):
            pass


def _wait_gone(procs: list[ProcInfo], timeout_s: float) -> list[ProcInfo]:
    deadline = time.monotonic() + timeout_s
    left = [p for p in procs if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        _reap(left)
        left = [p for p in left if alive(p)]
    return left


def stop_procs(procs: Iterable[ProcInfo], grace_s: float = 10.0, kill_wait_s: float = 5.0) -> list[ProcInfo]:
    """Stop every process in ``procs``: SIGTERM (to its process group where it leads one), wait, SIGKILL the rest.

    Only processes whose pid AND start time (ticks since boot) still match are signalled; a reused pid is never touched. Children
    of the calling process are reaped so they do not stay as zombies.

    Args:
        procs: snapshot of the processes to end (e.g. from :func:`snapshot_tree` or :func:`load_procs`).
        grace_s: seconds to wait after SIGTERM before SIGKILL; 0 (or less): no SIGTERM at all, SIGKILL at once (a
            wedged tree: a rank blocked in a collective never runs its SIGTERM handler, issue 36).
        kill_wait_s: seconds to wait after SIGKILL for the processes to disappear.
    Returns:
        The processes still alive at the end (should be empty; e.g. uninterruptible sleep in the kernel).
    """
    procs = list(procs)
    todo = [p for p in procs if alive(p)]
    if not todo:
        _reap(procs)
        return []
    left = todo
    if grace_s > 0:
        # Children first, root last, so a parent that restarts workers does not see them die one by one first.
        for p in reversed(todo):
            _signal(p, signal.SIGTERM)
        left = _wait_gone(todo, grace_s)
    for p in left:
        _signal(p, signal.SIGKILL)
    still = _wait_gone(left, kill_wait_s)
    # Reap every ended process that is our child: orphans re-parented to us (e.g. when the caller is a child
    # subreaper, as the test session is) would otherwise stay as zombies until we exit.
    _reap(procs)
    return still


def save_procs(path: Union[str, Path], procs: Iterable[ProcInfo], launch: Optional[dict] = None) -> None:
    """Write a snapshot as JSON (a list of ``{pid, create_time, name, cmdline, start_ticks}``), atomically via rename.

    Args:
        launch: when the snapshot is of a tree the harness itself started (:meth:`repro.launcher.Server.launch_mark`),
            the mark that lets ``repro cleanup`` end it: the file becomes ``{"launched_by_repro": true, "root": {pid,
            start_ticks, create_time}, "harness": {...}, "processes": [...]}``. Without it (e.g. a watched server)
            the file is a plain list and cleanup never signals what it lists.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    rows = [asdict(p) for p in procs]
    data: Any = {**launch, "processes": rows} if launch else rows
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    os.replace(tmp, path)


# Environment variable holding the per-launch token (repro.launcher.start_server sets it; repro.cleanup checks it)
LAUNCH_TOKEN_ENV = "REPRO_LAUNCH_TOKEN"


def has_launch_token(p: ProcInfo, token: str) -> bool:
    """True when the live process ``p`` has ``REPRO_LAUNCH_TOKEN=<token>`` in ``/proc/<pid>/environ`` (its environment
    at exec, inherited by every process of a tree the launcher started). False when unreadable or absent."""
    try:
        raw = Path(f"/proc/{p.pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{LAUNCH_TOKEN_ENV}={token}".encode() in raw.split(b"\0")


def token_carriers(tokens: Sequence[str]) -> list[ProcInfo]:
    """Every live process (zombies left out) whose environment carries ``REPRO_LAUNCH_TOKEN=<one of tokens>``: what a
    launched tree left running that its ``processes.json`` never recorded — a child a rank started after the record,
    in its own session (the ``stop`` nemesis's SIGCONT helper, ``injectors/repro_injector/_natural.py``), or an
    orphan re-parented away. One pass over ``/proc/*/environ``; this process itself is never listed."""
    needles = {f"{LAUNCH_TOKEN_ENV}={t}".encode() for t in tokens if t}
    out: list[ProcInfo] = []
    if not needles:
        return out
    me = os.getpid()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            raw = (d / "environ").read_bytes()
        except OSError:
            continue
        if needles & set(raw.split(b"\0")):
            info = proc_info(int(d.name))
            if info is not None:
                out.append(info)
    return out


def launch_mark(root: Optional[ProcInfo], root_pid: Optional[int] = None, tokens: Sequence[str] = ()) -> dict:
    """The mark that says this harness process itself started the tree under ``root`` (see :func:`save_procs`):
    ``{"launched_by_repro": true, "root": {pid, start_ticks, create_time}, "harness": {pid, start_ticks,
    create_time}, "tokens": [...]}``; start ticks are clock ticks since boot. ``root_pid`` is used when ``root`` could
    not be read. ``tokens``: the launch tokens (:data:`LAUNCH_TOKEN_ENV`) the tree's processes carry in their
    environment; ``repro cleanup`` signals a recorded process only when ``/proc/<pid>/environ`` has one of them."""
    me = proc_info(os.getpid())
    return {
        "launched_by_repro": True,
        "root": {"pid": root.pid if root else root_pid, "start_ticks": root.start_ticks if root else None,
                 "create_time": root.create_time if root else None},
        "harness": {"pid": os.getpid(), "start_ticks": me.start_ticks if me else None,
                    "create_time": me.create_time if me else None},
        **({"tokens": list(tokens)} if tokens else {}),
    }


def read_launch_mark(path: Union[str, Path]) -> Optional[dict]:
    """The launch mark of a snapshot file (see :func:`save_procs`), or None when it has none (not launched by repro,
    or written before the mark existed). Never raises for a missing or unreadable file (None)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if isinstance(data, dict) and data.get("launched_by_repro") is True and isinstance(data.get("root"), dict):
        return {k: v for k, v in data.items() if k != "processes"}
    return None


def load_procs(path: Union[str, Path]) -> list[ProcInfo]:
    """Read a snapshot written by :func:`save_procs` (a list, or the launch-marked object holding ``processes``).

    Rows without ``start_ticks`` (written by an older harness) load with ``start_ticks=None``: their identity is
    then checked by ``create_time`` (see :func:`same_start`).

    Raises:
        ValueError: the file is not such a snapshot (message names the file and the expected shape).
        FileNotFoundError: the file does not exist.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and "processes" in data:
            data = data["processes"]
        if not isinstance(data, list):
            raise TypeError(f"a JSON {type(data).__name__}")
        return [
            ProcInfo(pid=int(d["pid"]), create_time=float(d["create_time"]), name=str(d.get("name", "")),
                     cmdline=[str(a) for a in d.get("cmdline", [])],
                     start_ticks=int(d["start_ticks"]) if d.get("start_ticks") is not None else None)
            for d in data
        ]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"{path}: not a process snapshot (expected a JSON list of {{pid, create_time, name, cmdline}} "
            f"written by repro): {e}"
        ) from None


def processes_mentioning(root: Union[str, Path]) -> list[str]:
    """Live processes whose command line or environment mentions ``root`` (e.g. an evidence folder: every server
    process started for it carries the plan path under it in ``REPRO_PLAN``), excluding this process and its
    ancestors. Returns ``"<pid> <command line, cut>"`` lines; used to check that nothing was left running.
    """
    out = []
    me = psutil.Process()
    skip = {me.pid, *(a.pid for a in me.parents())}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if proc.pid in skip:
            continue
        try:
            text = " ".join(proc.info["cmdline"] or [])
            if str(root) in text or any(str(root) in v for v in proc.environ().values()):
                out.append(f"{proc.pid} {text[:120]}")
        except (psutil.Error, OSError):
            continue
    return out
