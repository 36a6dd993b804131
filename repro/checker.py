"""The checker's confirm step, shared by ``repro run``, ``repro watch`` and ``repro hunt``.

Capture every rank, wait ``confirm_gap_s``, capture again, measure each rank's CPU use across both captures,
analyse both and apply the DEADLOCKED rule (``repro.verdict.judge_stall``). Collection (``repro.capture``) never
imports analysis; this module is where the two meet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import psutil

from repro import evidence as ev
from repro.analysis import Analysis, analyze, frames_unchanged
from repro.capture import capture_ranks
from repro.stacks import RankCapture
from repro.verdict import StallJudgement, judge_stall

CONFIRM_GAP_S = 1.0  # seconds between the first capture and the confirming one


def cpu_seconds(pids: Mapping[int, int]) -> dict[int, float]:
    """rank -> user+system CPU seconds used so far by that rank's process; ranks whose process is gone are left out."""
    out: dict[int, float] = {}
    for rank, pid in pids.items():
        try:
            t = psutil.Process(pid).cpu_times()
            out[rank] = t.user + t.system
        except psutil.Error:
            pass
    return out


@dataclass(frozen=True)
class StallCheck:
    """Two captures of every rank ``confirm_gap_s`` apart, their analyses and the judgement on them.

    ``cpu_percent``: rank -> share of one core (percent) used between the start of the first capture and the end
    of the second.
    """

    first: Sequence[RankCapture]
    second: Sequence[RankCapture]
    first_analysis: Analysis
    second_analysis: Analysis
    unchanged: bool
    cpu_percent: Mapping[int, float]
    judgement: StallJudgement


class LocalRanks:
    """Where a server's ranks run, for :func:`check_stall`: this machine (CPU from /proc via psutil, stacks by
    ``repro.capture.capture_ranks``). ``repro.hosts.HostRanks`` is the same for ranks on other hosts.

    Args:
        rank_pids: rank -> pid of that rank's process.
    """

    def __init__(self, rank_pids: Mapping[int, int]) -> None:
        self.rank_pids = dict(rank_pids)

    def cpu_seconds(self) -> dict[int, tuple[float, float]]:
        """rank -> (clock time in seconds, user+system CPU seconds so far); a rank whose process is gone is left out."""
        cpu, t = cpu_seconds(self.rank_pids), time.time()
        return {k: (t, v) for k, v in cpu.items()}

    def capture(self, stacks_dir: Path, tag: str, **capture_kw: Any) -> list[RankCapture]:
        """One capture of every rank (``capture_kw``: timeout_s, native, injector_dir, fallback_signal)."""
        return capture_ranks(self.rank_pids, stacks_dir, tag=tag, **capture_kw)

    def capture_cpu(self, first: Sequence[RankCapture], second: Sequence[RankCapture]) -> dict[int, float]:
        """CPU percent per rank to use where the clock readings miss a rank: none here (a rank gone is left out)."""
        return {}

    def write_record(self, evd: Any) -> None:
        """Evidence of where the ranks ran: nothing for this machine (``processes.json`` says it)."""


def check_stall(
    rank_pids: Mapping[int, int],
    stacks_dir: Path,
    expected_ranks: Sequence[int],
    *,
    tag: str = "",
    second_tag: Optional[str] = None,
    confirm_gap_s: float = CONFIRM_GAP_S,
    where: Any = None,
    **capture_kw: Any,
) -> StallCheck:
    """THE stall check of every topology: capture all ranks twice and judge whether they are deadlocked
    (docs/pipeline.md). A PD stack runs it per server (:func:`check_groups`), a server spanning hosts with
    ``where`` = ``repro.hosts.HostRanks``.

    Args:
        rank_pids: rank -> pid of that rank's process (as its host sees it).
        stacks_dir: where ``rank<k>{tag}.txt|.json`` (first) and ``rank<k>{second_tag}.*`` (confirming) go.
        expected_ranks: every rank the job has (a rank missing from the captures blocks a DEADLOCKED call).
        tag / second_tag: file-name tags of the two captures (default second tag: ``tag + "b"``).
        confirm_gap_s: seconds between the two captures.
        where: where the ranks run (:class:`LocalRanks` of ``rank_pids`` when None; ``HostRanks``: on their hosts).
        capture_kw: passed to ``where.capture`` (timeout_s, native, injector_dir, fallback_signal).
    Returns:
        A StallCheck; ``judgement.deadlocked`` only when every rule holds. CPU percent per rank over the whole
        check (before the first capture to after the second), on each rank's own clock.
    Raises:
        OSError: ``stacks_dir`` cannot be written.
    """
    where = where if where is not None else LocalRanks(rank_pids)
    cpu0 = where.cpu_seconds()
    first = where.capture(stacks_dir, tag, **capture_kw)
    time.sleep(confirm_gap_s)
    second = where.capture(stacks_dir, tag + "b" if second_tag is None else second_tag, **capture_kw)
    cpu1 = where.cpu_seconds()
    cpu_pct = dict(where.capture_cpu(first, second))
    for k in set(cpu0) & set(cpu1):
        (ta, ca), (tb, cb) = cpu0[k], cpu1[k]
        cpu_pct[k] = 100.0 * (cb - ca) / max(1e-3, tb - ta)
    a1, a2 = analyze(first), analyze(second)
    unchanged = frames_unchanged(first, second)
    return StallCheck(first, second, a1, a2, unchanged, cpu_pct, judge_stall(a1, a2, unchanged, cpu_pct, expected_ranks))


@dataclass(frozen=True)
class RankGroup:
    """One TP group judged on its own by :func:`check_groups`.

    Attributes:
        name: the server's name in a stack (``prefill``), None for a topology of one server.
        where: where its ranks run (:class:`LocalRanks`, ``repro.hosts.HostRanks``).
        stacks_dir: where its two captures go.
        expected_ranks: every rank of the group.
    """

    name: Optional[str]
    where: Any
    stacks_dir: Path
    expected_ranks: Sequence[int]


@dataclass(frozen=True)
class GroupsCheck:
    """:func:`check_groups`' answer: group name -> StallCheck (a group whose capture raised is left out), the
    first group, in order, whose ranks are deadlocked (or None), and the group to report (that one, else the
    first checked)."""

    checks: Mapping[Optional[str], StallCheck]
    diverged: Optional[str]
    shown: Optional[str]

    def group_check(self) -> StallCheck:
        return self.checks[self.shown]


def check_groups(groups: Sequence[RankGroup], **check_kw: Any) -> GroupsCheck:
    """:func:`check_stall` on every group at once (one thread per group), each judged on its own: a PD stack's
    servers are two TP groups (``prefill TP0..3``, ``decode TP0``), and an idle server's normal shape (TP0 in its
    idle path, the others in the request broadcast) is a server that agrees with itself, not a divergence.

    Args:
        groups: the topology's groups (one for a single server or a server spanning hosts).
        check_kw: passed to :func:`check_stall` (``tag``, ``second_tag``, ``confirm_gap_s``, ``timeout_s``, ``native``).
    Raises:
        OSError: a stacks folder cannot be written and no group was checked.
    """
    from concurrent.futures import ThreadPoolExecutor

    def one(g: RankGroup) -> StallCheck:
        Path(g.stacks_dir).mkdir(parents=True, exist_ok=True)
        return check_stall(g.where.rank_pids, Path(g.stacks_dir), list(g.expected_ranks), where=g.where, **check_kw)

    todo = [g for g in groups if g.where.rank_pids]
    out: dict[Optional[str], StallCheck] = {}
    err: Optional[BaseException] = None
    with ThreadPoolExecutor(max_workers=max(1, len(todo))) as pool:
        futs = {g.name: pool.submit(one, g) for g in todo}
        for n, f in futs.items():
            try:
                out[n] = f.result()
            except OSError as e:
                err = err or e
    if err is not None and not out:
        raise err
    diverged = next((g.name for g in todo if g.name in out and out[g.name].judgement.deadlocked), None)
    shown = diverged if diverged is not None else next(iter(out), None)
    return GroupsCheck(out, diverged, shown)


# ------------------------------------------------------------------------------------------------------------
# rank death: a rank process that ends during a burst is named, never described as waiting

LOG_TAIL_LINES = 20


@dataclass(frozen=True)
class RankDeath:
    """A rank process found gone during a burst.

    Attributes:
        rank: the rank; pid: its process id.
        reason: why, from the server log (the exit code or signal the engine's parent logged, else the rank's own
            last error line, else that it left no error of its own: killed from outside, e.g. ``kill -9`` or the
            OOM killer).
        seen_t: ``time.time()`` when it was first seen gone.
    """

    rank: int
    pid: int
    reason: str
    seen_t: float

    def sentence(self) -> str:
        return f"rank {self.rank} (pid {self.pid}) died: {self.reason}"


def _signal_name(code: int) -> str:
    import signal as _signal

    try:
        return _signal.Signals(-code).name if code < 0 else ""
    except ValueError:
        return ""


_RECORD_START = ("[", "INFO", "WARNING", "ERROR", "DEBUG", "CRITICAL")  # a new log record ends a traceback


def _raised(lines: Sequence[str], at: int) -> str:
    """The exception a traceback that starts at line ``at`` ends with (``ValueError: req_to_token_pool memory leak
    detected!…``; the last one of a chained traceback), cut to 200 characters; "" when none is found before the
    next log record (a line starting with ``[`` or a level name) or 200 lines."""
    import re

    last = ""
    for ln in lines[at + 1:at + 201]:
        if ln.startswith(_RECORD_START):
            break
        if re.match(r"[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure)\b", ln):
            last = ln.strip()
    return last[:200]


def rank_error(log_text: str, rank: int) -> str:
    """Rank ``rank``'s last error line in a server log (lines tagged ``TP<rank>``: sglang's ``[… TP0]``, vLLM's
    ``(Worker_TP0 pid=…)``), cut to 300 characters; when it opens a traceback, with the exception the traceback ends
    with ("… Scheduler hit an exception: ValueError: req_to_token_pool memory leak detected!…"). "" when none."""
    import re

    tag = re.compile(rf"(?<![A-Za-z0-9])TP{rank}(?![A-Za-z0-9])")
    lines = log_text.splitlines()
    errs = [i for i, ln in enumerate(lines) if tag.search(ln) and re.search(r"Error|Exception|Traceback", ln)]
    if not errs:
        return ""
    line = lines[errs[-1]].strip()
    raised = _raised(lines, errs[-1]) if "Traceback (most recent call last)" in line else ""
    if raised:  # "Scheduler hit an exception: Traceback (…):" names nothing; the traceback's last line does
        line = line.split("Traceback (most recent call last)", 1)[0].rstrip() + " " + raised
    return line[:300]


def death_reason(log_text: str, rank: int, pid: int) -> str:
    """Why rank ``rank`` (process ``pid``) ended, read from the server log text.

    Looks for, in order: a line naming the pid with an exit code (sglang 0.5.23 ``utils/watchdog.py``
    ``SubprocessWatchdog``: "Subprocess … (pid=N) crashed with exit code -9"; ``entrypoints/engine.py``: "… N
    terminated with -9"), shown with the signal of a negative code; the rank's own last error line
    (:func:`rank_error`); an untagged C++ abort (``terminate called after throwing …`` with its ``what()``: gloo's
    size check aborts a rank so); else says it left no error of its own.
    """
    import re

    pat = re.compile(rf"(?:pid[= ]?{pid}\b|\b{pid}\b)[^\n]{{0,120}}?(?:exit ?code|exitcode|terminated with)[ =:]*(-?\d+)", re.I)
    hits = pat.findall(log_text)
    if hits:
        code = int(hits[-1])
        sig = _signal_name(code)
        return f"exit code {code}" + (f" ({sig})" if sig else "") + " per the server log"
    lines = log_text.splitlines()
    err = rank_error(log_text, rank)
    if err:
        return f"its last error in the server log: {err}"
    # a C++ exception nobody caught (gloo's size check: gloo::EnforceNotMet) aborts the process and writes untagged
    # lines: "terminate called after throwing an instance of 'X'" then "  what():  …"
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("terminate called after throwing"):
            what = next((ln.strip() for ln in lines[i + 1:i + 3] if ln.strip().startswith("what()")), "")
            return (f"it left no Python error of its own; the server log has an untagged C++ abort (the rank that "
                    f"wrote it is not named): {lines[i].strip()[:120]} {what[:300]}").rstrip()
    return ("it left no error of its own in the server log: it was ended from outside (e.g. kill -9, or the OOM "
            "killer: `dmesg -T | grep -i oom`)")


class RankWatch:
    """Which rank processes of a server are gone, by pid + start ticks (``repro.procs``): ranks are the harness's
    grandchildren, so there is no exit status to wait for, and a reused pid must not look alive.

    Args:
        rank_pids: rank -> pid, read while every rank was alive (e.g. at the start of a burst).
        log_path: the server log (``server.log``) the reasons are read from; None: no reasons.
    """

    def __init__(self, rank_pids: Mapping[int, int], log_path: Optional[Path] = None) -> None:
        from repro import procs as _procs

        self.log_path = Path(log_path) if log_path else None
        # a reason is what this server wrote after the ranks were seen alive: the log of a hunt's or test's session
        # is appended across restarts, and a rank of the previous server had the same TP tag
        try:
            self.log_start = self.log_path.stat().st_size if self.log_path else 0
        except OSError:
            self.log_start = 0
        self.procs = {}
        for rank, pid in rank_pids.items():
            info = _procs.proc_info(pid)
            if info is not None:
                self.procs[rank] = info
        self.deaths: dict[int, RankDeath] = {}

    def poll(self) -> list[RankDeath]:
        """Ranks newly found gone (cheap: one /proc read per rank). Reasons are read from the log at once."""
        from repro import procs as _procs

        now = time.time()
        gone = [k for k, p in sorted(self.procs.items()) if k not in self.deaths and not _procs.alive(p)]
        if not gone:
            return []
        text = self.log_text()
        new = [RankDeath(k, self.procs[k].pid, death_reason(text, k, self.procs[k].pid), now) for k in gone]
        for d in new:
            self.deaths[d.rank] = d
        return new

    def refresh_reasons(self) -> None:
        """Re-read the reasons from the log (the engine's parent may log the exit code a moment after)."""
        text = self.log_text()
        for k, d in list(self.deaths.items()):
            self.deaths[k] = RankDeath(d.rank, d.pid, death_reason(text, d.rank, d.pid), d.seen_t)

    def log_text(self) -> str:
        """What the server logged since the ranks were seen alive (the last 256 KiB of it); "" without a log."""
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, 2)
                end = f.tell()
                start = self.log_start if end >= self.log_start else 0  # a new, shorter log: all of it is this server's
                f.seek(max(start, end - 256 * 1024))
                return f.read().decode("utf-8", errors="replace")
        except OSError:
            return ""

    def verdict_reason(self) -> str:
        """One reason naming the ranks that died (first seen first; the others died after) and the log tail."""
        ds = sorted(self.deaths.values(), key=lambda d: (d.seen_t, d.rank))
        first = [d for d in ds if d.seen_t == ds[0].seen_t]
        later = [d for d in ds if d.seen_t != ds[0].seen_t]
        alive = sorted(set(self.procs) - set(self.deaths))
        text = "; ".join(d.sentence() for d in first)
        if later:
            text += "; then " + "; ".join(d.sentence() for d in later)
        if alive:
            text += f"; rank(s) {', '.join(map(str, alive))} still running"
        tail = "\n".join(self.log_text().splitlines()[-LOG_TAIL_LINES:])
        return f"{text} during the burst (a crash, not a deadlock); server log tail:\n{tail}"


class RankDeathDetector:
    """Detector (``repro.detect``): a rank process that ends during the burst decides the run INCONCLUSIVE, naming
    the rank, its pid and why (the server log), before the requests' errors or a stall could be blamed."""

    name = "rank-death"

    def __init__(self) -> None:
        self.watch: Optional[RankWatch] = None

    def start(self, ctx: Any) -> None:
        self.watch = RankWatch(ctx.rank_pids, getattr(ctx, "server_log", None))

    def poll(self, ctx: Any) -> Any:
        from repro.detect import Detection
        from repro.verdict import INCONCLUSIVE, Verdict

        if self.watch is None or not self.watch.poll():
            return None
        time.sleep(0.5)  # the engine's parent logs the exit code a moment later; other ranks may follow
        self.watch.poll()
        self.watch.refresh_reasons()
        reason = self.watch.verdict_reason()
        record = {"rank_deaths": self.records()}
        return Detection(self.name, True, Verdict(INCONCLUSIVE, reason), None, reason, record,
                         {ev.Layout.RANK_DEATHS: record["rank_deaths"]})

    def records(self) -> list[dict]:
        """``rank_deaths.json``: one ``{rank, pid, reason, time}`` per rank found gone."""
        return [{"rank": d.rank, "pid": d.pid, "reason": d.reason, "time": d.seen_t}
                for d in (self.watch.deaths.values() if self.watch is not None else ())]

    @property
    def deaths(self) -> list[RankDeath]:
        """Ranks found gone so far (the session is not usable after one)."""
        return list(self.watch.deaths.values()) if self.watch is not None else []

    def final_verdict(self, verdict: Any, ctx: Any = None) -> Any:
        """After the burst: when some rank died meanwhile (requests errored, or the server died, before a poll saw
        it), the verdict names that rank instead; a DEADLOCKED verdict keeps its word with a note."""
        from repro.verdict import DEADLOCKED, INCONCLUSIVE, Verdict

        if self.watch is None:
            return verdict
        self.watch.poll()
        if not self.watch.deaths:
            return self._with_rank_errors(verdict)
        self.watch.refresh_reasons()
        reason = self.watch.verdict_reason()
        try:  # the ledger diagnosis reads it: a dead rank's open record is where it died, not a wait
            ctx.run_dir.rank_deaths.write(self.records())
        except Exception:
            pass
        if verdict.verdict == DEADLOCKED:
            return Verdict(verdict.verdict, verdict.reason, (*verdict.notes, reason.split("; server log tail")[0]),
                           verdict.proof, verdict.desync)
        if verdict.verdict == "DESYNCED":  # the ledgers named the desync that made a rank abort: keep that word
            return Verdict(verdict.verdict, verdict.reason, (*verdict.notes, reason.split("; server log tail")[0]),
                           verdict.proof, verdict.desync)
        return Verdict(INCONCLUSIVE, reason, tuple(verdict.notes))

    def _with_rank_errors(self, verdict: Any) -> Any:
        """``requests errored`` with every rank alive (vLLM's worker catches its exception, reports it and lives):
        the reason gains each rank's last error in what the server logged since the burst began (:func:`rank_error`),
        e.g. "rank 0's last error in the server log: (Worker_TP0 pid=…) ERROR … RuntimeError: …"."""
        from dataclasses import replace

        from repro.verdict import INCONCLUSIVE, REQUESTS_ERRORED

        if self.watch is None or verdict.verdict != INCONCLUSIVE or not verdict.reason.startswith(REQUESTS_ERRORED):
            return verdict
        text = self.watch.log_text()
        errs = [f"rank {k}'s last error in the server log: {e}" for k in sorted(self.watch.procs)
                if (e := rank_error(text, k))]
        return replace(verdict, reason=f"{verdict.reason}; {'; '.join(errs)}") if errs else verdict

    def stop(self, ctx: Any) -> None:
        pass
