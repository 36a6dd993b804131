"""The lockstep state check of clean real runs (issue 32, Done-when 3): no new servers, it reads the runs the suite
already makes.

After every test marked ``sglang`` / ``hang`` / ``pd`` / ``multihost`` (wired in tests/conftest.py), every evidence
folder that appeared since the session started (a ``verdict.json`` under the session's temp folder or an
``evidence/`` folder) is checked once by :func:`check_run`. A run is **clean** when its verdict is ALL REQUESTS
SUCCEEDED, it is not partial, and no injection fired during it. For a clean run with a digest:

- the state digest (``repro.state_digest.diagnose_state`` over ``repro.ledger.load_ledgers`` of the run's rank
  pids: the product's readers) reports no divergence;
- every probe resolved on every rank: no ``state_error`` recorded for it on any rank, and every rank recorded it;
- at least one probe value changed on every rank during the burst: the burst's ticks are those of the collective
  records entered between the first and the last line of ``requests.jsonl`` (plus the tick after, whose start shows
  the last tick's effect); a state line inside them that differs from the value in force before counts.

A run with no ledger, with the digest off in its plan (``[ledger] digest = false``) or whose release has no probe
file is **skipped** with a reason (never failed); a ledger from before the digest reads "no digest recorded" (never
"equal"). A release that has a probe file but recorded no digest on some rank is a failure. On a shared server a
run folder holds a copy of the whole session's injector folder, so fires count from the run's ``session.json``
(written when the run began) and the burst window is the run's own. A PD server's folder (``servers/<role>/``) is
checked on its own ledgers, with its run folder's ``requests.jsonl`` and ``session.json``.

Cost: one read of each ledger file (collective records and state lines), bounded by the ledger's own rotation;
the check of a run folder is timed (``RunCheck.seconds``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from repro import evidence as ev
from repro.injection_records import read_injector_dir
from repro.ledger import load_ledgers, rank_pids_of
from repro.state_digest import RankState, StateStatus, diagnose_state, read_rank_states
from repro.verdict import SUCCEEDED

REAL_SERVER_MARKS = ("sglang", "hang", "pd", "multihost", "release")


class Outcome:
    """What :func:`check_run` decided for one run folder."""

    OK = "ok"  # clean, digest recorded, every rule held
    FAILED = "failed"  # clean, and some rule did not hold (``problems``)
    SKIPPED = "skipped"  # clean, but nothing to check (no ledger, digest off, no probe file): ``reason``
    NOT_CLEAN = "not-clean"  # not held to the rules (a hang, an injection fired, partial): ``reason``


@dataclass
class RunCheck:
    """One run folder's result: ``outcome`` (:class:`Outcome`), ``reason`` (one line), ``problems`` (one line
    each, naming the folder, the probe and the rank), ``seconds`` the check took."""

    folder: Path
    outcome: str
    reason: str = ""
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def line(self) -> str:
        return f"{self.outcome}: {self.folder}" + (f" ({self.reason})" if self.reason else "") + \
            f" [{self.seconds:.2f} s]"


def _run_of(folder: ev.EvidenceDir) -> ev.EvidenceDir:
    """The run folder a PD server's ``servers/<role>/`` belongs to (its ``requests.jsonl``, ``session.json``);
    ``folder`` itself otherwise."""
    top = folder.path.parent.parent
    if folder.path.parent.name == ev.Layout.SERVERS.name and (top / ev.Layout.VERDICT.name).is_file():
        return ev.EvidenceDir.open(top)
    return folder


def _fires_during(folder: ev.EvidenceDir) -> list[str]:
    """``id on rank r`` of every fire of this run (a shared server's run: from its ``session.json`` on)."""
    if not folder.injector_dir.is_dir():
        return []
    run = _run_of(folder)
    t0 = run.session.path.stat().st_mtime if run.session.exists() else None
    rep = read_injector_dir(folder.injector_dir)
    return sorted({f"`{f.injection_id}` on rank {f.rank}" for f in rep.fires() if t0 is None or f.time >= t0 - 0.5})


def burst_ticks(led: Any, t0: float, t1: float) -> Optional[tuple[int, int]]:
    """The ticks of one rank's ledger (``repro.ledger.RankLedger``) whose collective records were entered between
    ``t0`` and ``t1`` (epoch seconds), and the tick after the last; None when no record falls there."""
    ticks = [r.tick for r in led.records if t0 <= r.t_enter <= t1 and r.tick > 0]
    return (min(ticks), max(ticks) + 1) if ticks else None


def changes_within(rs: RankState, lo: int, hi: int) -> int:
    """Probe values of ``rs`` that changed at ticks ``lo < t <= hi`` (against the value in force before; a full
    digest at a ledger part's start counts only the values it changes)."""
    vals: Optional[dict] = None
    n = 0
    for t, full, v in rs.lines:
        if t > hi:
            break
        if vals is None:
            if not full:
                continue
            vals = {}
        if t > lo:
            n += sum(1 for k, x in v.items() if k not in vals or vals[k] != x)
        vals.update(v)
    return n


def _release(folder: ev.EvidenceDir) -> Optional[str]:
    try:
        env = folder.env.read(missing_ok=True)
    except ev.EvidenceFileError:
        return None
    return getattr(env, "sglang", None) if env is not None else None


def _digest_plan(folder: ev.EvidenceDir) -> Optional[dict]:
    try:
        plan = folder.plan.read(missing_ok=True)
    except ev.EvidenceFileError:
        return None
    led = (plan.to_json().get("ledger") if plan is not None else None) or {}
    return led.get("digest") if isinstance(led, dict) else None


def check_run(path: Path) -> RunCheck:
    """Hold one run folder to the rules of the module docstring.

    Args:
        path: a folder with ``verdict.json`` (a run's, a PD server's ``servers/<role>/``).
    Returns:
        A :class:`RunCheck`; never raises for a folder's content (an unreadable verdict is NOT_CLEAN with the why).
    """
    t_start = time.monotonic()
    res = _check(Path(path))
    res.seconds = time.monotonic() - t_start
    return res


def _check(path: Path) -> RunCheck:
    folder = ev.EvidenceDir.open(path)
    try:
        v = folder.verdict.read()
    except ev.EvidenceFileError as e:
        return RunCheck(path, Outcome.NOT_CLEAN, f"verdict unreadable: {e}")
    if v.kind != "run" or v.verdict != SUCCEEDED or v.partial:
        return RunCheck(path, Outcome.NOT_CLEAN, f"{v.verdict}{' (partial)' if v.partial else ''}")
    fired = _fires_during(folder)
    if fired:
        return RunCheck(path, Outcome.NOT_CLEAN, "injection fired: " + ", ".join(fired[:4]))
    leds = load_ledgers(path, rank_pids_of(path))
    if not leds:
        return RunCheck(path, Outcome.SKIPPED, "no ledger in injector/ (ledger off, or not recorded)")
    digest = _digest_plan(folder)
    if isinstance(digest, dict) and digest.get("enabled") is False:
        return RunCheck(path, Outcome.SKIPPED, "digest off in plan.json ([ledger] digest = false, or no probe "
                                               "files for this engine)")
    states = read_rank_states(leds)
    st = diagnose_state(leds, states=states)
    if st.status == StateStatus.NOT_RECORDED:
        release = _release(folder)
        releases = (digest or {}).get("releases") or {} if isinstance(digest, dict) else {}
        has_file = release is not None and (release in releases or release.split("+")[0] in releases)
        if has_file and len(states) >= 2:
            missing = sorted(r for r, s in states.items() if s.first_full() is None)
            return RunCheck(path, Outcome.FAILED, st.summary, [
                f"{path}: sglang {release} has a probe file but rank {r} recorded no state digest ({st.summary})"
                for r in missing])
        return RunCheck(path, Outcome.SKIPPED, f"{st.summary}; release {release or 'unknown'}")
    problems: list[str] = []
    if st.diverged:
        for p, vs in st.fields.items():
            problems.append(f"{path}: state diverged at tick {st.tick}: probe `{p}` "
                            + ", ".join(f"rank {r} = {x}" for r, x in vs.items()))
    names = set().union(*({k for _, _, vals in s.lines for k in vals} for s in states.values()))
    for r, s in sorted(states.items()):
        for p, err in sorted(s.errors.items()):
            problems.append(f"{path}: probe `{p}` did not resolve on rank {r}: {err}")
        have = {k for _, _, vals in s.lines for k in vals}
        for p in sorted(names - have - set(s.errors)):
            problems.append(f"{path}: probe `{p}` never recorded on rank {r} (recorded on another rank)")
    window = _burst_window(folder)
    moved = []
    for r, s in sorted(states.items()):
        ticks = burst_ticks(leds[r], *window) if window else None
        if ticks is None:
            n, where = s.changes, "in the whole ledger (no burst window found)"
        else:
            n, where = changes_within(s, *ticks), f"during the burst (ticks {ticks[0]}–{ticks[1]})"
        if n == 0:
            problems.append(f"{path}: no probe value changed on rank {r} {where}")
        moved.append(f"rank {r}: {n} {where}")
    if problems:
        return RunCheck(path, Outcome.FAILED, st.summary, problems)
    absent = sorted(p for p in st.probes_compared if all(p not in got for got in st.resolved.values()))
    return RunCheck(path, Outcome.OK, f"{len(st.probes_compared)} probes compared, ticks "
                    f"{st.compared[0] if st.compared else '?'}–{st.compared[1] if st.compared else '?'}; value changes "
                    + ", ".join(moved) + (f"; absent on this server: {', '.join(absent)}" if absent else ""))


def _burst_window(folder: ev.EvidenceDir) -> Optional[tuple[float, float]]:
    try:
        lines = _run_of(folder).requests.read(missing_ok=True) or []
    except ev.EvidenceFileError:
        return None
    ts = [float(x["t"]) for x in lines if isinstance(x, dict) and isinstance(x.get("t"), (int, float))]
    return (min(ts), max(ts)) if ts else None


def run_folders(roots: Iterable[Path], since: float, seen: set[Path]) -> list[Path]:
    """Folders under ``roots`` holding a ``verdict.json`` written at or after ``since`` (epoch seconds), not in
    ``seen`` (added to it), oldest first."""
    found: list[tuple[float, Path]] = []
    for root in roots:
        if not Path(root).is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in ("stacks", "injector", "latest")]
            if "verdict.json" not in filenames:
                continue
            d = Path(dirpath).resolve()
            try:
                mtime = (d / "verdict.json").stat().st_mtime
            except OSError:
                continue
            if mtime >= since and d not in seen:
                seen.add(d)
                found.append((mtime, d))
    return [d for _, d in sorted(found)]


__all__ = ["Outcome", "REAL_SERVER_MARKS", "RunCheck", "burst_ticks", "changes_within", "check_run", "run_folders"]
