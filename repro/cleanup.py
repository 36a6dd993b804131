"""End a server tree left behind by a harness that was SIGKILLed — and nothing else.

``repro cleanup FOLDER`` reads the ``processes.json`` the runner wrote, with the launcher's mark that the harness
itself started that tree (:meth:`repro.launcher.Server.launch_mark`: ``launched_by_repro``, the root's and the
harness's pid + start ticks). Rules, in order:

- a ``processes.json`` without that mark (e.g. one ``repro watch`` wrote about a server someone else runs, or an
  older harness's) is refused: its processes are never signalled, ``force`` does not change that, and the result
  names each recorded process left alone and why;
- a run whose harness is still alive (pid + start ticks of ``run.json`` / the mark) is refused unless ``force``;
- a live recorded process whose ``/proc/<pid>/environ`` lacks the run's launch token (``REPRO_LAUNCH_TOKEN``, set by
  :func:`repro.launcher.start_server`, its value in the mark's ``tokens``) makes cleanup refuse the whole folder:
  a hand-written or stale ``processes.json`` cannot make it signal an unrelated process (a process that rewrote its
  environ block with its title counts when it is in the session of a recorded root that carries the token). A
  folder an older harness wrote (no ``tokens`` in the mark) naming live processes is refused the same way: end
  those by hand;
- a server spanning hosts (``hosts`` in ``processes.json``, :func:`repro.multihost.cleanup_hosts`): refused
  without a token, before any host is contacted; a node's session is signalled only when one of its processes
  carries the token, and its workdir removed only when it holds the token file with that token;
- only recorded processes whose pid AND start ticks still match are signalled (:func:`repro.procs.stop_procs`): a
  reused pid is never touched;
- once the tree is gone, the server's temp folders (``owned_dirs.json``, only ``$TMPDIR/repro-*``) are removed, and a
  folder with no ``verdict.json`` gets a short one plus ``REPORT.md`` saying the harness was killed and cleaned up.

A hunt folder (``hunt.jsonl``), a hunt trial's folder (``session.json``) and an evidence root (scenario folders
holding run folders, ``watch-HOST-PORT`` folders) stand for the run folders they name or hold. The CLI parses,
calls :func:`cleanup` and renders the :class:`CleanupResult` list.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from repro import procs as _procs
from repro.evidence import Layout, read_json, write_json_atomic, write_text_atomic
from repro.paths import kind, nearest_existing
from repro.procs import ProcInfo

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_HARNESS_KILLED = 137  # verdict.json of a run whose harness was SIGKILLed: what a shell saw it end with


class CleanupError(Exception):
    """``FOLDER`` stands for no run folder at all; ``str()`` is one line naming what is expected."""


@dataclass(frozen=True)
class CleanupResult:
    """What cleanup did for one run folder.

    Attributes:
        folder: the run folder (it holds ``processes.json``).
        exit_code: 0 done (or nothing to do), 2 refused (not launched by repro, harness alive, bad file), 1 some
            process survived SIGKILL.
        message: one line for people saying what happened.
        stopped: recorded processes that were alive and are now gone.
        still_running: recorded processes still alive after SIGKILL.
        left_alone: ``(process, why)`` for every recorded process not signalled although it is alive.
        removed: temp folders removed.
        refused: True when nothing was signalled on purpose (exit 2).
        engine: whose leftover files were looked for: the run's engine, or ``any of: sglang, vllm`` (every
            registered adapter) when the folder does not say which.
        engine_from: where that came from (``env.json``, ``scenario.toml``, or ``assumed: …``).
    """

    folder: Path
    exit_code: int
    message: str
    stopped: list[ProcInfo] = field(default_factory=list)
    still_running: list[ProcInfo] = field(default_factory=list)
    left_alone: list[tuple[ProcInfo, str]] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    refused: bool = False
    engine: str = ""
    engine_from: str = ""

    def to_json(self) -> dict:
        """Plain JSON: folder, exit_code, message, refused, pids stopped / still running, left alone (pid, why),
        removed, engine and where it came from."""
        return {"folder": str(self.folder), "exit_code": self.exit_code, "message": self.message, "refused": self.refused,
                "stopped": [p.pid for p in self.stopped], "still_running": [p.pid for p in self.still_running],
                "left_alone": [{"pid": p.pid, "title": p.title, "why": why} for p, why in self.left_alone],
                "removed": list(self.removed), "engine": self.engine, "engine_from": self.engine_from}


def cleanup_targets(folder: Path) -> list[Path]:
    """Run folders (holding ``processes.json``) that ``folder`` stands for: itself; a hunt trial's session
    (``session.json``); a hunt's baseline and session (``hunt.jsonl``); else the run folders among its children
    and grandchildren (an evidence root holds scenario folders holding run folders). Symlinks (``latest``) are
    skipped."""
    folder = Path(folder)
    if Layout.PROCESSES.at(folder).is_file():
        return [folder]
    found: list[Path] = []
    sess = _json_or_none(Layout.SESSION.at(folder))
    if isinstance(sess, dict) and sess.get("session"):
        found.append(Path(sess["session"]))
    if Layout.HUNT_JSONL.at(folder).is_file():
        for line in Layout.HUNT_JSONL.at(folder).read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("event") in ("baseline", "session") and rec.get("evidence"):
                found.append(Path(rec["evidence"]))
    # a hunt's (or compare's) own run folders beside it, named in hunt.jsonl or not: killed during its baseline,
    # a hunt folder has run.json only (no hunt.jsonl yet), and the baseline's server is still running
    found.extend(_same_harness_runs(folder))
    if not found and folder.is_dir():
        for d in sorted(folder.iterdir()):
            if not d.is_dir() or d.is_symlink():
                continue
            if Layout.PROCESSES.at(d).is_file():
                found.append(d)
                continue
            found.extend(sorted(g for g in d.iterdir() if g.is_dir() and not g.is_symlink() and Layout.PROCESSES.at(g).is_file()))
    out: list[Path] = []
    for d in found:
        if Layout.PROCESSES.at(d).is_file() and d not in out:
            out.append(d)
    return out


def _json_or_none(path: Path) -> object:
    """The JSON in ``path``; None when it is missing, unreadable, truncated or not UTF-8 (an optional file)."""
    try:
        return read_json(path) if path.is_file() else None
    except (OSError, ValueError):
        return None


def _same_harness_runs(hunt: Path) -> list[Path]:
    """Run folders beside a hunt folder that the hunt's own harness made (``run.json``'s ``pid`` and
    ``harness_create_time`` equal the hunt's): its baseline or spare session, also when the harness was killed
    before hunt.jsonl named it (a ``kill -9`` during the baseline left that server running, and cleanup of the hunt
    folder said "processes.json not found")."""
    me = _json_or_none(Layout.RUN.at(hunt))
    if not isinstance(me, dict) or me.get("pid") is None or me.get("harness_create_time") is None:
        return []
    out = []
    for d in sorted(hunt.parent.iterdir()) if hunt.parent.is_dir() else []:
        if d == hunt or not d.is_dir() or d.is_symlink() or not Layout.PROCESSES.at(d).is_file():
            continue
        run = _json_or_none(Layout.RUN.at(d))
        if isinstance(run, dict) and (run.get("pid"), run.get("harness_create_time")) == (me["pid"], me["harness_create_time"]):
            out.append(d)
    return out


def _harness_alive(run: dict, mark: dict) -> Optional[int]:
    """The pid of the run's harness when it is still running (pid + start ticks, else create time), else None.

    A SIGKILLed harness its parent has not reaped yet is a zombie: not alive.
    """
    if run.get("status") != "running":
        return None
    h = mark.get("harness") or {}
    pid = run.get("pid") or h.get("pid")
    try:
        pid = int(pid)
    except (TypeError, ValueError):
        return None
    ticks = run.get("harness_start_ticks")
    if ticks is None and h.get("pid") == pid:
        ticks = h.get("start_ticks")
    ct = run.get("harness_create_time") or h.get("create_time")
    if ticks is None and ct is None:
        info = _procs.proc_info(pid)  # nothing to compare with: any live process with that pid counts
        return pid if info is not None else None
    me = ProcInfo(pid=pid, create_time=float(ct or 0.0), name="", start_ticks=int(ticks) if ticks is not None else None)
    return pid if _procs.alive(me) else None


def _not_ours(folder: Path, procs: list[ProcInfo]) -> CleanupResult:
    live = [p for p in procs if _procs.alive(p)]
    why = (f"not launched by repro (no launched_by_repro mark in {Layout.PROCESSES.name}: e.g. a server `repro watch` "
           "observed, or a folder written by an older harness)")
    lst = ", ".join(f"pid {p.pid} ({p.title[:60]})" for p in live) or "none of them is running"
    return CleanupResult(folder, EXIT_USAGE, f"refused: {folder} records processes {why}; cleanup only ends trees the "
                         f"harness itself launched, --force does not change that; left alone: {lst}",
                         left_alone=[(p, why) for p in live], refused=True)


def run_engine(folder: Path) -> tuple[Optional[str], str]:
    """Which engine a run folder's server was: ``(name, where it is written)`` from ``env.json``'s ``engine``, else
    the run's ``scenario.toml`` (``[server] adapter``, the registry's default when it names none); ``(None, why)``
    when the folder says neither (a folder a killed harness left before writing them)."""
    from repro.targets.registry import DEFAULT_ADAPTER

    env = _json_or_none(folder / Layout.ENV.name)  # truncated or binary: as if absent (scenario.toml, else every engine)
    if isinstance(env, dict) and env.get("engine"):
        return str(env["engine"]), Layout.ENV.name
    try:
        scen = tomllib.loads((folder / Layout.SCENARIO.name).read_text(encoding="utf-8"))
        return str((scen.get("server") or {}).get("adapter") or DEFAULT_ADAPTER), Layout.SCENARIO.name
    except (OSError, ValueError):
        return None, f"no {Layout.ENV.name} or {Layout.SCENARIO.name} names it"


def _engines(folder: Path) -> tuple[list, str, str]:
    """The adapters whose leftover files are looked for in ``folder``, and the engine line (name, from where)."""
    from repro.targets.registry import all_adapters

    adapters = all_adapters()
    name, where = run_engine(folder)
    if name in adapters:
        return [adapters[name]], name, where
    why = where if name is None else f"{where} names {name!r}, which is not registered"
    return list(adapters.values()), "any of: " + ", ".join(adapters), f"assumed ({why}): every registered engine"


def _remove_leftover_files(folder: Path, adapters: list) -> list[str]:
    """Files the run's servers left behind, found from their logs in ``folder`` by the run's adapter's
    ``leftover_files`` (every registered adapter's when the folder does not say which engine; vLLM:
    ``/dev/shm/vllm_dist_<id>-*``, ``/tmp/vllm_dist_<id>`` of the ids its log names)."""
    removed: list[str] = []
    logs = sorted(folder.glob("**/" + Layout.SERVER_LOG.name)) if folder.is_dir() else []
    for log in logs:
        for a in adapters:
            for f in a.leftover_files(log):
                try:
                    f.unlink()
                    removed.append(str(f))
                except OSError:
                    pass
    return removed


def _remove_owned_dirs(folder: Path, adapters: Optional[list] = None) -> list[str]:
    owned = _json_or_none(Layout.OWNED_DIRS.at(folder))  # unreadable: no temp folder is removed (never more)
    tmp = Path(tempfile.gettempdir())
    removed = _remove_leftover_files(folder, adapters if adapters is not None else _engines(folder)[0])
    for d in (Path(x) for x in (owned if isinstance(owned, list) else []) if isinstance(x, str)):
        if d.parent == tmp and d.name.startswith("repro-") and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
    return removed


def _write_killed_report(folder: Path, run: dict, stopped: list[ProcInfo], when: float) -> None:
    """A short verdict.json + REPORT.md for a run whose harness was killed before it wrote its own."""
    at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(when))
    started = run.get("time")
    reason = (f"the harness (pid {run.get('pid', '?')}) was killed before it finished; `repro cleanup` stopped the "
              f"server tree it left ({len(stopped)} processes) at {at}")
    notes = [f"`repro analyze {folder}` gives the ledger diagnosis and the rank states from what was recorded",
             f"{Layout.SERVER_LOG.name} and {Layout.REQUESTS.name} hold what happened up to the kill"]
    # the exit code the run ended with, as README promises: a harness that wrote no verdict of its own was SIGKILLed
    # (SIGINT/SIGTERM are handled and write one), and a shell reports a SIGKILLed process as 128 + 9
    notes.append("exit_code 137: the harness was SIGKILLed (128 + 9, as a shell reports it); it recorded no status")
    write_json_atomic(Layout.VERDICT.at(folder), {"verdict": "INCONCLUSIVE", "reason": reason, "notes": notes,
                                                "exit_code": EXIT_HARNESS_KILLED,
                                                "partial": True, "harness_killed": True, "cleaned_up_time": when,
                                                "run_started_time": started, "evidence": str(folder)})
    if not Layout.REPORT.at(folder).exists():
        write_text_atomic(Layout.REPORT.at(folder), "\n".join([
            f"# INCONCLUSIVE — harness killed, cleaned up at {at}", "",
            reason + ".", "",
            f"- For the ledger diagnosis and where each rank was: `repro analyze {folder}`",
            f"- What happened up to the kill: `{Layout.SERVER_LOG.name}`, `{Layout.REQUESTS.name}` (when the burst had "
            "started).",
            f"- Stopped: {', '.join(f'pid {p.pid} ({p.title[:50]})' for p in stopped) or '(nothing was running)'}", ""]))


def _ours(p: ProcInfo, tokens: list, mark: dict) -> bool:
    """A live recorded process belongs to the launched tree: its environment carries the launch token, or (a process
    that rewrote its environ block with its title, as sglang's ``setproctitle`` does) it is in the session of a
    recorded root (the mark's ``root``, and each role's in ``roots`` for a PD stack), and that root, while alive,
    carries the token. A pid used as a live session id is never reused, so a forged list cannot point that rule at
    an unrelated process."""
    if any(_procs.has_launch_token(p, t) for t in tokens):
        return True
    if not tokens:
        return False
    try:
        sid = os.getsid(p.pid)
    except OSError:
        return False
    roots = [mark.get("root") or {}] + [r for r in (mark.get("roots") or []) if isinstance(r, dict)]
    for root in roots:
        rpid = root.get("pid")
        if not isinstance(rpid, int) or rpid <= 0 or sid != rpid:
            continue
        rinfo = _procs.proc_info(rpid)
        if rinfo is not None and (root.get("start_ticks") is None or rinfo.start_ticks == root.get("start_ticks")):
            return any(_procs.has_launch_token(rinfo, t) for t in tokens)
        return True  # the root is gone: its session's members are what is left of the tree
    return False


def cleanup_run(folder: Path, force: bool = False) -> CleanupResult:
    """Stop one run folder's recorded server tree (only if the harness launched it) and tidy up after it.

    Args:
        folder: a run folder holding ``processes.json``.
        force: also when the run's harness is still alive (ends that live run's server). Never overrides the
            launched-by-repro check.
    Returns:
        A :class:`CleanupResult` (with the engine it assumed: :func:`run_engine`); never raises for a bad or foreign
        file (exit code 2 in the result).
    """
    import dataclasses

    folder = Path(folder)
    adapters, engine, where = _engines(folder)
    return dataclasses.replace(_cleanup_run(folder, force, adapters), engine=engine, engine_from=where)


def _cleanup_run(folder: Path, force: bool, adapters: list) -> CleanupResult:
    path = Layout.PROCESSES.at(folder)
    try:
        recorded = _procs.load_procs(path)
    except (OSError, ValueError) as e:
        return CleanupResult(folder, EXIT_USAGE, f"{path} is not a process list written by repro ({e}); nothing was stopped",
                             refused=True)
    mark = _procs.read_launch_mark(path)
    if mark is None:
        return _not_ours(folder, recorded)
    try:
        run = read_json(Layout.RUN.at(folder)) or {}
    except (OSError, ValueError) as e:  # truncated, binary: whether the harness still runs cannot be told from it
        if not force:
            return CleanupResult(folder, EXIT_USAGE, f"refused: {Layout.RUN.at(folder)} is not valid JSON ({e}), so "
                                 "whether the run's harness is still running cannot be told; nothing was stopped. If "
                                 "no repro command is running on this folder, pass --force to end its server anyway",
                                 refused=True, left_alone=[(p, f"{Layout.RUN.name} is unreadable") for p in recorded
                                                           if _procs.alive(p)])
        run = {}  # --force: go on; the unreadable run.json is left as it is (no status or verdict written from it)
    if not isinstance(run, dict):
        run = {}
    harness = _harness_alive(run, mark)
    if harness is not None and not force:
        return CleanupResult(folder, EXIT_USAGE, f"the run in {folder} is still in progress (harness pid {harness}); stop it "
                             "with Ctrl-C, or pass --force to end its server anyway", refused=True,
                             left_alone=[(p, f"its harness (pid {harness}) is still running") for p in recorded if _procs.alive(p)])
    hosts = (read_json(path) or {}).get("hosts") if not recorded else None
    if hosts:  # a server spanning hosts (repro/multihost.py): each node's session is ended through its host's runner
        from repro.multihost import cleanup_hosts

        rc, msg = cleanup_hosts(hosts, tokens=mark.get("tokens") or [])
        return CleanupResult(folder, {0: EXIT_OK, 2: EXIT_USAGE}.get(rc, EXIT_INTERNAL), msg, refused=rc == 2)
    live = [p for p in recorded if _procs.alive(p)]
    tokens = [t for t in (mark.get("tokens") or []) if isinstance(t, str) and t]
    foreign = [p for p in live if not _ours(p, tokens, mark)]
    if foreign:  # a forged or stale record: a live pid that is not of the launched tree is never signalled
        why = (f"its environment lacks the launch token recorded in {Layout.PROCESSES.name}" if tokens else
               f"{Layout.PROCESSES.name} carries no launch token (written by hand or by an older harness)")
        return CleanupResult(folder, EXIT_USAGE, f"refused: {Layout.PROCESSES.at(folder)} names live processes that repro did "
                             f"not launch for this run ({why}); nothing was stopped. End them yourself if they are yours: "
                             + ", ".join(f"pid {p.pid} ({p.title[:60]})" for p in foreign), refused=True,
                             left_alone=[(p, why) for p in foreign])
    gone = len(recorded) - len(live)
    keys = {p.key for p in recorded}  # + what the tree started after the record (a stop nemesis's SIGCONT helper)
    unrec = [p for p in _procs.token_carriers(tokens) if p.key not in keys]
    shm = _procs.shm_files_of(live)  # read before the tree is signalled (see repro.launcher.Server.stop)
    # + the names the tree registered with multiprocessing's resource tracker (mapped by none: see Server.stop)
    from repro.launcher import registered_shm_files

    shm |= registered_shm_files(Layout.INJECTOR.at(folder), {p.pid for p in live + unrec})
    left = _procs.stop_procs(live + unrec) if live or unrec else []
    stopped = [p for p in live if p not in left]
    extra = ("; also stopped " + ", ".join(f"pid {p.pid} ({p.title[:60]})" for p in unrec if p not in left)
             + ": not recorded, carrying this run's launch token") if [p for p in unrec if p not in left] else ""
    removed = _remove_owned_dirs(folder, adapters) if not left else []
    if live and not left:
        starts = [_procs.started_at(p.start_ticks) for p in live]
        removed += [str(f) for f in _procs.remove_shm_files(shm, min((t for t in starts if t is not None),
                                                                        default=float("inf")))]
    now = time.time()
    if live and run.get("status") == "running":
        write_json_atomic(Layout.RUN.at(folder), {**run, "status": "cleaned-up", "cleaned_up_time": now,
                                                "note": "the harness ended without tearing down; `repro cleanup` stopped the server"})
    if not Layout.VERDICT.at(folder).exists() and run.get("status") in ("running", "cleaned-up"):
        _write_killed_report(folder, run, stopped, now)
    rm = f"; removed {', '.join(removed)}" if removed else ""
    if not live:
        return CleanupResult(folder, EXIT_OK if not left else EXIT_INTERNAL, ("" if extra else "nothing to clean: ")
                             + f"none of the {len(recorded)} recorded processes is running"
                             + extra.replace("; also stopped", "; stopped", 1)
                             + (f"; still running: {[p.pid for p in left]}" if left else "") + rm, removed=removed,
                             still_running=left)
    msg = (f"stopped {len(stopped)} of {len(live)} live recorded processes"
           + (f" ({gone} recorded ones had already exited or their pid now belongs to another process: left alone)" if gone else "")
           + extra + (f"; still running: {[p.pid for p in left]}" if left else "") + rm)
    return CleanupResult(folder, EXIT_OK if not left else EXIT_INTERNAL, msg, stopped=stopped, still_running=left,
                         removed=removed)


def cleanup(folder: Path, force: bool = False) -> list[CleanupResult]:
    """Clean up every run folder ``folder`` stands for (:func:`cleanup_targets`).

    Returns:
        One result per run folder, in order.
    Raises:
        CleanupError: ``folder`` stands for no run folder (message names what is accepted).
    """
    targets = cleanup_targets(Path(folder))
    if not targets:
        p = Path(folder)
        accepted = (f"pass a run's evidence folder (it holds {Layout.PROCESSES.name}), a hunt folder, a hunt trial's "
                    "folder, or an evidence root")
        if p.exists() and not p.is_dir():
            what = "a file" if p.is_file() else kind(p.stat())
            raise CleanupError(f"{p} is {what}, not a folder: {accepted}")
        if not p.exists():
            up = nearest_existing(p)
            why = f" ({up} is a file, not a folder)" if up.exists() and not up.is_dir() else ""
            raise CleanupError(f"{p} does not exist{why}: {accepted}")
        raise CleanupError(f"{Layout.PROCESSES.at(p)} not found (nor a run folder under {p}): {accepted}")
    results = [cleanup_run(t, force) for t in targets]
    _mark_parent_cleaned(Path(folder), targets, results)
    return results


def _mark_parent_cleaned(folder: Path, targets: list[Path], results: list[CleanupResult]) -> None:
    """A hunt (or compare) folder whose harness was killed keeps ``run.json`` ``status: running`` for ever; once its
    run folders are clean and the harness is gone, say ``cleaned-up`` there too (as :func:`cleanup_run` does for a
    run folder)."""
    run = _json_or_none(Layout.RUN.at(folder))
    if folder in targets or not isinstance(run, dict) or run.get("status") != "running":
        return
    if any(r.still_running for r in results) or _harness_alive(run, {}) is not None:
        return
    write_json_atomic(Layout.RUN.at(folder), {**run, "status": "cleaned-up", "cleaned_up_time": time.time(),
                                            "note": "the harness ended without finishing; `repro cleanup` cleaned its runs"})


def exit_code(results: list[CleanupResult]) -> int:
    """The command's exit code: 2 when every folder was refused; else 1 when a process survived; else 0. Folders
    refused among others (a watch folder under an evidence root) are reported, not failed."""
    if all(r.refused for r in results):
        return EXIT_USAGE
    return max((r.exit_code for r in results if not r.refused), default=EXIT_OK)
