"""Dump one process's Python stacks: py-spy (``--json``, then text), tried again while another tracer holds the
process, else the injector's faulthandler dump. Standard library only, so it is THE capture of every rank:
``repro.capture`` imports it, and ``repro.hosts.capture_remote`` sends this file's source to a rank's host over
stdin (``python3 - PID PY_SPY FAULTHANDLER_FILE SIGNAL TIMEOUT_S``), where :func:`main` prints one JSON object —
so a remote capture gets every fix the local one has (the tracer-held retry, the SigCgt check).

py-spy facts (0.4.3): ``py-spy dump --pid P [--json] [--native]``; a process has one tracer at a time, and while
another holds it py-spy fails with "Failed to suspend process: EPERM".
"""

from __future__ import annotations

import json
import os
import re
import signal as _signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

PTRACE_FIX = (
    "run the harness as root, or give the container CAP_SYS_PTRACE (docker run --cap-add SYS_PTRACE), "
    "or set kernel.yama.ptrace_scope=0 for same-user targets"
)
PYSPY_MISSING_FIX = "install py-spy into the harness environment (pip install py-spy; it is a project dependency)"
_NO_ANSWER = "py-spy did not answer within"  # a timed-out run's error starts so (never tried again)


def _classify_error(text: str) -> str:
    low = text.lower()
    if "permission denied" in low or "operation not permitted" in low or "eperm" in low or "ptrace" in low:
        return "ptrace"
    if "no such process" in low or "failed to open process" in low or "doesn't exist" in low:
        return "gone"
    if "python version" in low or "failed to find python" in low or "executable name" in low:
        return "not-python"
    return "other"


def _run_py_spy(cmd: list[str], pid: int, *, json_out: bool, native: bool, timeout_s: float) -> tuple[bool, str, str]:
    """Run one py-spy dump. Returns (ok, stdout, error message)."""
    argv = [*cmd, "dump", "--pid", str(pid)]
    if json_out:
        argv.append("--json")
    if native:
        argv.append("--native")
    try:
        env = dict(os.environ, RUST_BACKTRACE="0")
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, errors="replace", env=env)
    except subprocess.TimeoutExpired:
        return False, "", f"{_NO_ANSWER} {timeout_s:.1f} s (timeout_s)"
    except FileNotFoundError as e:
        return False, "", f"could not run py-spy: not found at {argv[0]} ({e}); {PYSPY_MISSING_FIX}"
    except OSError as e:
        return False, "", f"could not run py-spy ({e}); {PYSPY_MISSING_FIX}"
    if p.returncode != 0 or not p.stdout.strip():
        lines = [ln.strip() for ln in (p.stderr + "\n" + p.stdout).splitlines() if ln.strip()]
        errs = [ln for ln in lines if ln.lower().startswith("error") or "permission denied" in ln.lower()]
        msg = " ".join(errs[:2]) if errs else (lines[0] if lines else f"exit status {p.returncode}")
        causes = _error_causes(lines)
        return False, p.stdout, msg + (f" (caused by: {causes})" if causes else "")
    return True, p.stdout, ""


def _error_causes(lines: list[str]) -> str:
    """The numbered lines under py-spy's ``Caused by:`` (anyhow's chain: ``0: Failed to suspend process``,
    ``1: EPERM: Operation not permitted``), joined with ``: ``, repeats dropped; ``""`` when there are none."""
    try:
        start = next(i for i, ln in enumerate(lines) if ln.lower().startswith("caused by"))
    except StopIteration:
        return ""
    out: list[str] = []
    for ln in lines[start + 1:]:
        m = re.match(r"\d+:\s*(.+)", ln)
        if not m:
            break
        if m.group(1) not in out:
            out.append(m.group(1))
    return ": ".join(out)


def tracer_of(pid: int) -> int:
    """The pid that ptrace-holds ``pid`` now (``TracerPid`` in /proc/<pid>/status), 0 when none or unknown.

    A process has at most one tracer: while a debugger, ``strace`` or another ``py-spy dump`` holds a rank, py-spy
    cannot suspend it and fails with "Failed to suspend process: EPERM" (py-spy 0.4.3, measured here; the same
    error as benfred/py-spy#764).
    """
    v = _status_field(pid, "TracerPid")
    try:
        return int(v) if v is not None else 0
    except ValueError:
        return 0


def _transient(err: str) -> bool:
    """A py-spy failure worth one more try: the process could not be suspended (another tracer held it for a
    moment), or any failure that is not a refusal, a gone or non-Python process (py-spy reading a thread that
    exited mid-dump: "Failed to get stack traces", "Failed to copy PyCodeObject"). A timeout is not retried."""
    return "failed to suspend" in err.lower() or _classify_error(err) == "other"


def _run_py_spy_patiently(cmd: list[str], pid: int, *, json_out: bool, native: bool, timeout_s: float,
                          notes: list[str]) -> tuple[bool, str, str]:
    """:func:`_run_py_spy`, tried again when the failure is transient, within ``timeout_s`` seconds in all.

    Before a retry it waits (polling every 50 ms, at most what is left of ``timeout_s``) for a foreign tracer
    (:func:`tracer_of`) to detach; what it waited for goes into ``notes``. Up to 3 tries. A failure that is still
    due to a tracer names it: ``pid N is held by tracer pid M (<its command line>)``.
    """
    end = time.monotonic() + timeout_s
    ok, out, err = _run_py_spy(cmd, pid, json_out=json_out, native=native, timeout_s=timeout_s)
    for _ in range(2):
        if ok or err.startswith(_NO_ANSWER):
            break
        tracer = tracer_of(pid)
        if not tracer and not _transient(err):
            break
        t_wait = time.monotonic()
        while tracer and time.monotonic() < end:
            time.sleep(0.05)
            tracer = tracer_of(pid)
        if tracer:
            return False, out, (f"pid {pid} is held by tracer pid {tracer} ({_process_title(tracer) or '?'}): a "
                                f"debugger, strace or a second py-spy; it did not detach within {timeout_s:.1f} s "
                                f"(py-spy: {err})")
        waited = time.monotonic() - t_wait
        left = end - time.monotonic()
        if left < 0.2:
            break
        time.sleep(0.1)
        notes.append(f"py-spy failed once ({err}); " + (f"waited {waited:.2f} s for another tracer to detach, "
                     if waited >= 0.05 else "") + "then tried again")
        ok, out, err = _run_py_spy(cmd, pid, json_out=json_out, native=native, timeout_s=max(0.2, left - 0.1))
    return ok, out, err


def _status_field(pid: int, name: str) -> Optional[str]:
    """The first word of field ``name`` in /proc/<pid>/status (``TracerPid``, ``SigCgt``), None when unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return line.split()[1]
    except (OSError, IndexError):
        return None
    return None


def _signal_caught(pid: int, signum: int) -> Optional[bool]:
    """Whether ``pid`` has a handler for ``signum`` (``SigCgt`` in /proc), None when unknown."""
    v = _status_field(pid, "SigCgt")
    try:
        return bool(int(v, 16) >> (signum - 1) & 1) if v is not None else None
    except ValueError:
        return None


def _process_title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def faulthandler_dump(pid: int, fh_file: Path, *, signal_name: str = "SIGUSR2",
                      timeout_s: float = 5.0, settle_s: float = 0.15) -> tuple[bool, str, str]:
    """Ask ``pid`` for its in-process faulthandler dump and return ``(ok, text, error)``.

    Sends ``signal_name`` only when ``fh_file`` (the injector's ``faulthandler-<pid>.txt``,
    ``repro.evidence.Layout.faulthandler_file``) exists and /proc says the signal is caught (an uncaught SIGUSR2
    terminates the process); reads what was appended after the signal, waiting until the file stops growing for
    ``settle_s`` seconds or ``timeout_s`` seconds pass.
    """
    path = Path(fh_file)
    try:
        signum = int(getattr(_signal, signal_name))
    except (AttributeError, TypeError, ValueError):
        return False, "", f"unknown signal {signal_name!r}: expected a name such as SIGUSR2 (plan faulthandler_signal)"
    if not path.exists():
        return False, "", (f"no faulthandler file {path}: the injector did not register {signal_name} in pid {pid} "
                           "(is it loaded there?); signal not sent")
    if _signal_caught(pid, signum) is False:
        return False, "", (f"pid {pid} has no handler for {signal_name} (SigCgt in /proc/{pid}/status); "
                           "signal not sent, it would kill the process")
    start = path.stat().st_size
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return False, "", f"pid {pid} no longer exists"
    except PermissionError:
        return False, "", f"not allowed to signal pid {pid}; {PTRACE_FIX}"
    deadline = time.monotonic() + timeout_s
    last_size, stable_since = start, None
    while time.monotonic() < deadline:
        size = path.stat().st_size
        if size > start and size == last_size:
            if stable_since is None:
                stable_since = time.monotonic()
            elif time.monotonic() - stable_since >= settle_s:
                break
        else:
            stable_since = None
        last_size = size
        time.sleep(0.02)
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read().decode("utf-8", errors="replace")
    if not data.strip():
        return False, "", f"pid {pid} wrote no faulthandler dump to {path} within {timeout_s:.1f} s"
    return True, data, ""



def cpu_seconds(pid: int) -> Optional[float]:
    """User + system CPU seconds of ``pid`` from /proc/<pid>/stat, None when unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


CPU_WINDOW_S = 0.2  # the least time CPU use is read over: /proc counts in clock ticks (10 ms), so a 20 ms dump
# alone would read a sleeping rank as 0 % or 50 % of a core by chance (seen in CI: 50.58 % for time.sleep)


def dump_one(pid: int, py_spy: str, fh_file: str, signal_name: str, timeout_s: float,
             cpu_window_s: float = CPU_WINDOW_S) -> dict:
    """One rank's dump as a JSON-able dict (what :func:`main` prints): ``pid``, ``title``, ``t0``/``t1``
    (monotonic), ``cpu0``/``cpu1`` (CPU seconds), ``method``, ``tool_version``, then py-spy's ``json`` and
    ``text``, or ``faulthandler`` (the fallback when py-spy is missing or refused), or ``error``; ``notes`` says
    what a retry waited for. ``fh_file``: the injector's faulthandler file (``-``: no fallback).
    ``cpu_window_s``: the least seconds between ``t0`` and ``t1`` (the dump runs inside it; a quicker dump waits
    out the rest), so ``cpu1 - cpu0`` has a resolution of one clock tick per window (5 % of a core at 0.2 s),
    as ``repro.capture.capture_stacks``'s own window."""
    out: dict = {"pid": pid, "title": _process_title(pid), "t0": time.monotonic(), "cpu0": cpu_seconds(pid),
                 "method": "py-spy"}
    try:
        out["tool_version"] = subprocess.run([py_spy, "--version"], capture_output=True, text=True,
                                             timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001 - missing py-spy is reported by the dump below
        out["tool_version"] = ""
    notes: list = []
    ok, js, err = _run_py_spy_patiently([py_spy], pid, json_out=True, native=False, timeout_s=timeout_s, notes=notes)
    if ok:
        out["json"] = js
        ok2, txt, _ = _run_py_spy_patiently([py_spy], pid, json_out=False, native=False, timeout_s=timeout_s,
                                            notes=notes)
        out["text"] = txt if ok2 else ""
    else:
        out["error"] = err[-600:]
        refused = "could not run py-spy" in err or _classify_error(err) == "ptrace"
        if refused and fh_file != "-":
            fok, text, ferr = faulthandler_dump(pid, Path(fh_file), signal_name=signal_name, timeout_s=timeout_s)
            if fok:
                out["method"], out["faulthandler"] = "faulthandler", text
            else:
                out["error"] += "; faulthandler fallback: " + ferr
    if notes:
        out["notes"] = notes
    time.sleep(max(0.0, out["t0"] + cpu_window_s - time.monotonic()))
    out["cpu1"], out["t1"] = cpu_seconds(pid), time.monotonic()
    return out


def main(argv: Optional[list] = None) -> int:
    """``python3 - PID PY_SPY FAULTHANDLER_FILE SIGNAL TIMEOUT_S``: print :func:`dump_one`'s JSON object."""
    a = sys.argv[1:] if argv is None else argv
    print(json.dumps(dump_one(int(a[0]), a[1], a[2], a[3], float(a[4]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
