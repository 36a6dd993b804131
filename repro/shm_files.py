"""The shared-memory files a server's process tree leaves in /dev/shm, found and removed by exact name.

Two kinds of files, two readers:

- *mapped or open*: what a live process maps (``/proc/PID/maps``) or holds open (``/proc/PID/fd``): SGLang's
  ``sgl_shm_mq_<pid>_<hex>`` message queues and ``sglang_loads_*.shm`` load snapshots, Python's ``psm_*`` segments,
  ``sem.*`` semaphores — :func:`mapped_by`;
- *registered*: the names a process gave multiprocessing's resource tracker, which the injector writes to
  ``mpnames-<pid>.txt`` (injectors/repro_injector/_proc.py ``record_mp_names``; ``semaphore /mp-x`` →
  ``sem.mp-x``, ``shared_memory /psm_x`` → ``psm_x``); closed and mapped by nobody once created, they are left
  when sglang 0.5.23's launcher SIGKILLs the tracker — :func:`registered_in`.

Standard library only, so it is the one reader for every topology: ``repro.procs`` / ``repro.launcher`` call it
for a local tree, and ``repro.multihost`` sends this file's source to each host over stdin, where :func:`main`
prints one JSON object (``python3 - list SID`` / ``python3 - remove SINCE MPNAMES_GLOB [PATH ...]``).
A file is removed only when its status changed at or after the tree's start (:func:`remove`): a segment that
existed before the tree is someone else's.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path
from typing import Iterable, Optional

SHM_DIR = Path("/dev/shm")


def mapped_by(pid: int, shm_dir: Path = SHM_DIR) -> set[Path]:
    """Files directly under ``shm_dir`` that process ``pid`` maps or holds open (a `` (deleted)`` one, already
    unlinked, is left out); empty when the process cannot be read. The caller checks that ``pid`` is still the
    process it means (``repro.procs.alive``)."""
    prefix = str(shm_dir).rstrip("/") + "/"
    out: set[Path] = set()
    try:
        with open(f"/proc/{int(pid)}/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                i = line.find(prefix)
                if i >= 0 and not line.rstrip().endswith("(deleted)"):
                    out.add(Path(line[i:].rstrip("\n")))
    except OSError:
        pass
    try:
        for fd in os.listdir(f"/proc/{int(pid)}/fd"):
            try:
                target = os.readlink(f"/proc/{int(pid)}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(prefix) and not target.endswith("(deleted)"):
                out.add(Path(target))
    except OSError:
        pass
    return {f for f in out if f.parent == shm_dir}


def registered_in(text: str, shm_dir: Path = SHM_DIR) -> set[Path]:
    """The ``shm_dir`` files named by the ``<rtype> <name>`` lines of an ``mpnames-<pid>.txt`` record: ``semaphore``
    → ``sem.<name>``, ``shared_memory`` → ``<name>``; other types, empty names and names with a ``/`` inside add
    nothing."""
    out: set[Path] = set()
    for line in text.splitlines():
        rtype, _, name = line.strip().partition(" ")
        name = name.strip().lstrip("/")
        if not name or "/" in name or name in (".", ".."):
            continue
        if rtype == "semaphore":
            out.add(shm_dir / f"sem.{name}")
        elif rtype == "shared_memory":
            out.add(shm_dir / name)
    return out


def remove(files: Iterable[Path], created_after: float) -> list[Path]:
    """Unlink each of ``files`` that still exists and whose status changed at or after ``created_after`` (seconds
    since the epoch, the start of the tree that made them); call only once every process of the tree is gone.
    Returns the files removed."""
    removed = []
    for f in sorted(set(files)):
        try:
            if f.stat().st_ctime < created_after:
                continue
            f.unlink()
            removed.append(f)
        except OSError:
            pass
    return removed


def session_pids(sid: int) -> list[int]:
    """Every process in session ``sid`` (``/proc/PID/stat`` field 6), the leader included."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as fh:
                fields = fh.read().decode("ascii", "replace").rsplit(")", 1)[1].split()
            if int(fields[3]) == int(sid):
                out.append(int(d))
        except (OSError, IndexError, ValueError):
            continue
    return sorted(out)


def start_epoch(pid: int) -> Optional[float]:
    """When ``pid`` started, in seconds since the epoch on this host's clock (boot time + start ticks); None when
    unreadable."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as fh:
            ticks = int(fh.read().decode("ascii", "replace").rsplit(")", 1)[1].split()[19])
        with open("/proc/stat", encoding="ascii", errors="replace") as fh:
            btime = next(int(line.split()[1]) for line in fh if line.startswith("btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, StopIteration):
        return None


def main(argv: Optional[list] = None) -> int:
    """``list SID``: ``{"since": <the session leader's start, epoch s, or null>, "files": [...]}`` — the files the
    session's processes map or hold open now. ``remove SINCE MPNAMES_GLOB [PATH ...]``: unlink the given paths and
    those the matching ``mpnames-*.txt`` records name (:func:`remove`); prints ``{"removed": [...]}``."""
    a = sys.argv[1:] if argv is None else argv
    if a and a[0] == "list" and len(a) == 2:
        files: set[Path] = set()
        for pid in session_pids(int(a[1])):
            files |= mapped_by(pid)
        print(json.dumps({"since": start_epoch(int(a[1])), "files": sorted(map(str, files))}))
        return 0
    if a and a[0] == "remove" and len(a) >= 3:
        paths = {Path(p) for p in a[3:] if Path(p).parent == SHM_DIR}
        for rec in glob.glob(a[2]):
            try:
                paths |= registered_in(Path(rec).read_text(encoding="utf-8", errors="replace"))
            except OSError:
                pass
        print(json.dumps({"removed": [str(p) for p in remove(paths, float(a[1]))]}))
        return 0
    print("usage: python3 - list SID | remove SINCE MPNAMES_GLOB [PATH ...]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
