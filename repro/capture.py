"""Capture every rank's stacks at once: py-spy (``--json`` and text) per pid in parallel, faulthandler fallback.

Collection only: this module never imports :mod:`repro.analysis` (two captures are compared there:
``repro.analysis.frames_unchanged``).

py-spy facts used (py-spy 0.4.3): ``py-spy dump --pid P [--json] [--native]``; ``--json`` ignores
``--subprocesses``, so each pid is dumped on its own; a dump pauses the target for milliseconds (ptrace), so two
py-spy runs on one pid are made one after the other (JSON first, it is what the analysis reads; then text, for
people); ``--native`` is slow (~0.8 s per process alone, ~2.5 s with three in parallel on 2 cores) and can
fail: it is retried without, and with it the text file is rendered from the JSON dump (one ptrace session). py-spy needs ptrace
(root, or CAP_SYS_PTRACE in a container, or ``kernel.yama.ptrace_scope`` 0 for a same-user target). A process has
one tracer at a time: while strace, a debugger or another py-spy (an operator's, or a second harness) holds a rank,
py-spy fails with "Failed to suspend process: EPERM"; the dump then waits for ``TracerPid`` to clear and tries
again (within its ``timeout_s``), and a rank still held names its tracer instead of a permission fix.

Fallback: when py-spy is missing or ptrace is refused and ``injector_dir`` is given, the injector's in-process
dump is used. The injector registers ``faulthandler.register(sig, file=<injector_dir>/faulthandler-<pid>.txt,
all_threads=True)`` at start-up; we check in ``/proc/<pid>/status`` (``SigCgt``) that the signal is caught (an
uncaught SIGUSR2 would kill the rank), send it, and read what the handler appended to that file.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal as _signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

import psutil

from repro.evidence import Layout

from repro.stacks import RankCapture, parse_faulthandler, parse_pyspy_json, parse_pyspy_text, render_pyspy_text

from repro.capture_helper import PTRACE_FIX, PYSPY_MISSING_FIX, _NO_ANSWER  # noqa: E402,F401 - re-exported

PySpy = Union[str, Sequence[str], None]


def find_py_spy(py_spy: PySpy = "py-spy") -> Optional[list[str]]:
    """The py-spy command to run, or None when it cannot be found.

    ``py_spy`` may be a program name/path (looked up on PATH and next to this interpreter, where pip puts it in a
    venv whose ``bin`` is not on PATH), an argv prefix (e.g. ``["runuser", "-u", "nobody", "--", "/x/py-spy"]``),
    or None to skip py-spy entirely.
    """
    if py_spy is None:
        return None
    if not isinstance(py_spy, str):
        return list(py_spy) if py_spy else None
    found = shutil.which(py_spy)
    if found is None and os.sep not in py_spy:
        cand = Path(sys.executable).parent / py_spy
        if cand.exists() and os.access(cand, os.X_OK):
            found = str(cand)
    return [found] if found else None


@functools.lru_cache(maxsize=8)
def _py_spy_version(cmd: tuple[str, ...]) -> str:
    try:
        out = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=10)
        return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr).strip() else ""
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return ""


def py_spy_version(py_spy: PySpy = "py-spy") -> str:
    """``py-spy 0.4.3`` (what ``py-spy --version`` prints), or ``""`` when py-spy cannot be run."""
    cmd = find_py_spy(py_spy)
    return _py_spy_version(tuple(cmd)) if cmd else ""


def py_spy_described(py_spy: PySpy = "py-spy") -> Optional[str]:
    """What ``env.json``'s ``py_spy`` says: ``py-spy 0.4.3 (/root/.pyenv/shims/py-spy)`` (the version
    ``py-spy --version`` prints, then the program found, as :func:`find_py_spy` finds it); ``unknown version (PATH)``
    when it is found but does not answer ``--version``; None when py-spy is not found."""
    cmd = find_py_spy(py_spy)
    if not cmd:
        return None
    return f"{_py_spy_version(tuple(cmd)) or 'unknown version'} ({' '.join(cmd)})"


# the dump of one process (py-spy, the tracer-held retry, the faulthandler fallback) is repro.capture_helper's: one
# stdlib-only implementation, run here and sent to the ranks' hosts (repro.hosts.capture_remote)
from repro.capture_helper import (  # noqa: E402
    CPU_WINDOW_S, _classify_error, _error_causes, _process_title, _run_py_spy, _run_py_spy_patiently, _signal_caught,
    _status_field, _transient, faulthandler_dump, tracer_of,
)


def _capture_one(rank: Optional[int], label: str, pid: int, out_dir: Path, *, timeout_s: float, native: bool,
                 tag: str, injector_dir: Optional[Path], fallback_signal: str, cmd: Optional[list[str]],
                 version: str) -> dict:
    t0 = time.monotonic()
    res: dict = {"rank": rank, "pid": pid, "label": label, "title": _process_title(pid), "tool_version": version}
    errors: list[str] = []
    refused = False
    if cmd is None:
        errors.append(f"py-spy not found; {PYSPY_MISSING_FIX}")
        refused = True
    else:
        used_native = native
        notes: list[str] = []
        ok, out, err = _run_py_spy_patiently(cmd, pid, json_out=True, native=native, timeout_s=timeout_s, notes=notes)
        if not ok and native and _classify_error(err) not in ("ptrace", "gone"):
            errors.append(f"py-spy --native failed ({err}); retried without --native")
            used_native = False
            ok, out, err = _run_py_spy_patiently(cmd, pid, json_out=True, native=False, timeout_s=timeout_s,
                                                 notes=notes)
        if ok:
            dumps = parse_pyspy_json(out)
            res.update(method="py-spy", native=used_native, json=out, threads=dumps[0].threads,
                       warnings=[*notes, *(w for d in dumps for w in d.warnings)])
            if used_native:  # a second --native run would double a slow capture: render the text from the JSON
                ok_t, text, err_t = False, "", ""
            else:
                ok_t, text, err_t = _run_py_spy_patiently(cmd, pid, json_out=False, native=False, timeout_s=timeout_s,
                                                          notes=res["warnings"])
            if ok_t:
                res["text"] = text
                tdumps = parse_pyspy_text(text)
                if tdumps and tdumps[0].title:
                    res["title"] = tdumps[0].title
            else:
                res["text"] = render_pyspy_text(dumps[0].threads, pid, res["title"])
                if err_t:
                    res["warnings"].append(f"py-spy text dump failed ({err_t}); text rendered from the JSON dump")
            res.update(ok=bool(res["threads"]), error="" if res["threads"] else "py-spy returned no threads")
            res["duration_s"] = round(time.monotonic() - t0, 4)
            return res
        kind = _classify_error(err)
        if "is held by tracer pid" in err:  # the in-process dump still answers while another tracer holds it
            refused = True
            errors.append(err)
        elif kind == "ptrace":
            refused = True
            errors.append(f"py-spy refused by ptrace on pid {pid} ({err}); {PTRACE_FIX}")
        elif kind == "gone":
            errors.append(f"pid {pid} is gone ({err})")
        elif kind == "not-python":
            errors.append(f"pid {pid} does not look like a Python process to py-spy ({err})")
        else:
            errors.append(f"py-spy failed on pid {pid}: {err}")
    if refused and injector_dir is not None:
        ok, text, err = faulthandler_dump(pid, injector_dir / Layout.faulthandler_file(pid), signal_name=fallback_signal,
                                          timeout_s=timeout_s)
        if ok:
            dumps = parse_faulthandler(text, pid=pid, title=res["title"])
            header = f"Process {pid}: {res['title']}\n# faulthandler dump ({fallback_signal}); {errors[0]}\n"
            res.update(method="faulthandler", native=False, text=header + text, threads=dumps[0].threads,
                       warnings=dumps[0].warnings, ok=bool(dumps[0].threads), tool_version="faulthandler (CPython)",
                       notice=errors[0] + "; fell back to the injector's faulthandler dump",
                       error="" if dumps[0].threads else "faulthandler dump had no threads")
            res["duration_s"] = round(time.monotonic() - t0, 4)
            return res
        errors.append(f"faulthandler fallback failed: {err}")
    elif refused:
        errors.append("no faulthandler fallback (injector_dir not given)")
    res.update(method="py-spy" if cmd else "faulthandler", ok=False, error="; ".join(errors), threads=[],
               text="", warnings=[], native=False)
    res["duration_s"] = round(time.monotonic() - t0, 4)
    return res


def _safe_stem(label: str) -> str:
    """A file-name stem from a label: path separators and spaces replaced, at most 60 characters."""
    return re.sub(r"[^\w.:+-]+", "_", label).strip("._")[:60] or "process"


def _cpu_times(pid: int) -> Optional[float]:
    try:
        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)
    except (psutil.Error, OSError):
        return None


def capture_pids(pids: Mapping[str, int], out_dir: Union[str, Path], *, timeout_s: float = 5.0,
                 native: bool = False, tag: str = "", injector_dir: Optional[Union[str, Path]] = None,
                 fallback_signal: str = "SIGUSR2", py_spy: PySpy = "py-spy", cpu_window_s: float = CPU_WINDOW_S,
                 ranks: Optional[Mapping[str, Optional[int]]] = None) -> list[RankCapture]:
    """Dump the stacks of several processes at once (one thread per pid), each with its own timeout.

    Args:
        pids: label → pid; the label is the file stem (``rank0``, ``detokenizer``).
        out_dir: evidence sub-folder; writes ``<label><tag>.txt`` (py-spy text, or ``Process`` header +
            faulthandler text), ``<label><tag>.json`` (py-spy ``--json``, when py-spy worked) and
            ``capture<tag>.json`` (per-process metadata: method, ok, error, cpu_percent, duration_s, version).
        timeout_s: seconds per py-spy run (JSON and text are two runs; a ``--native`` retry is a third); a process
            that does not answer is reported with ``ok=False``, not waited for.
        native: ask py-spy for native frames too (retried without on failure).
        tag: file-name suffix for a second capture (``"-2"`` → ``rank0-2.txt``).
        injector_dir: the injector's output folder; enables the faulthandler fallback.
        fallback_signal: signal the injector registered faulthandler on (the plan's ``faulthandler_signal``).
        py_spy: py-spy program or argv prefix; None forces the faulthandler path.
        cpu_window_s: minimum seconds over which CPU use is measured (the dumps run inside this window).
        ranks: label → rank (None for non-rank processes); default None for every label.
    Returns:
        One :class:`RankCapture` per label, in the order given. Never raises for a process that cannot be dumped:
        its capture has ``ok=False`` and ``error`` names the cause and the fix.
    Raises:
        OSError: ``out_dir`` cannot be created or written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cmd = find_py_spy(py_spy)
    version = _py_spy_version(tuple(cmd)) if cmd else ""
    inj = Path(injector_dir) if injector_dir is not None else None
    labels = list(pids)
    t0 = time.monotonic()
    cpu0 = {lab: _cpu_times(pids[lab]) for lab in labels}
    with ThreadPoolExecutor(max_workers=max(1, len(labels))) as ex:
        futs = [
            ex.submit(_capture_one, (ranks or {}).get(lab), lab, pids[lab], out, timeout_s=timeout_s, native=native,
                      tag=tag, injector_dir=inj, fallback_signal=fallback_signal, cmd=cmd, version=version)
            for lab in labels
        ]
        results = [f.result() for f in futs]
    remaining = cpu_window_s - (time.monotonic() - t0)
    if remaining > 0:
        time.sleep(remaining)
    wall = time.monotonic() - t0
    caps: list[RankCapture] = []
    meta = []
    for lab, res in zip(labels, results):
        c1 = _cpu_times(pids[lab])
        c0 = cpu0[lab]
        cpu = round(100.0 * (c1 - c0) / wall, 2) if c0 is not None and c1 is not None and wall > 0 else None
        text = res.get("text", "")
        stem = _safe_stem(lab) + tag
        if text:
            (out / f"{stem}.txt").write_text(text)
        if res.get("json"):
            (out / f"{stem}.json").write_text(res["json"])
        cap = RankCapture(
            rank=res["rank"], pid=res["pid"], label=lab, ok=res["ok"], method=res["method"], error=res["error"],
            notice=res.get("notice", ""), text=text, threads=res["threads"], cpu_percent=cpu, title=res["title"],
            tool_version=res.get("tool_version", ""), native=res.get("native", False),
            duration_s=res.get("duration_s"), warnings=res.get("warnings", []),
        )
        caps.append(cap)
        meta.append(cap.model_dump(exclude={"text", "threads"}))
    (out / Layout.capture_meta(tag)).write_text(json.dumps(
        {"py_spy": version, "window_s": round(wall, 4), "tag": tag, "processes": meta}, indent=2))
    return caps


def capture_ranks(pids: Mapping[int, int], out_dir: Union[str, Path], *, timeout_s: float = 5.0,
                  native: bool = False, tag: str = "", injector_dir: Optional[Union[str, Path]] = None,
                  fallback_signal: str = "SIGUSR2", py_spy: PySpy = "py-spy",
                  cpu_window_s: float = CPU_WINDOW_S) -> list[RankCapture]:
    """Dump every rank's Python stacks at once with py-spy (faulthandler fallback).

    Args:
        pids: rank → pid of that rank's scheduler process.
        out_dir: evidence sub-folder; writes ``rank<k><tag>.txt`` and ``rank<k><tag>.json`` (+ ``capture<tag>.json``).
        timeout_s: per-py-spy-run bound in seconds; a rank that does not answer in time is reported, not waited for.
        native: include native frames (``--native``), retried without on failure.
        tag: suffix for a second capture's files.
        injector_dir: the injector's output folder (holds ``faulthandler-<pid>.txt``); enables the fallback when
            py-spy is missing or ptrace is refused.
        fallback_signal: the plan's ``faulthandler_signal`` (default SIGUSR2).
        py_spy: py-spy program or argv prefix; None forces the faulthandler path.
        cpu_window_s: minimum CPU-measurement window in seconds.
    Returns:
        One :class:`RankCapture` per rank, in rank order, with ``ok=False`` and the reason (and fix) where both
        py-spy and the fallback failed; ``notice`` says when the fallback was used.
    Raises:
        OSError: ``out_dir`` cannot be created or written.
    """
    order = sorted(pids)
    return capture_pids({Layout.stack_label(r): pids[r] for r in order}, out_dir, timeout_s=timeout_s, native=native, tag=tag,
                        injector_dir=injector_dir, fallback_signal=fallback_signal, py_spy=py_spy,
                        cpu_window_s=cpu_window_s, ranks={Layout.stack_label(r): r for r in order})


def capture_notice(captures: Sequence[RankCapture]) -> str:
    """The one line to show the user about how capture went (ptrace refused, py-spy missing…), or ``""``."""
    for c in captures:
        if c.notice:
            return c.notice
    for c in captures:
        if not c.ok and ("ptrace" in c.error or "py-spy not found" in c.error):
            return c.error
    return ""
