"""The verdict rules (docs/pipeline.md), as pure functions over typed records so they can be tested on their own.

Three verdicts, each with an exit code:

- ``DEADLOCKED`` (3): a stall was seen and, in two captures ~1–2 s apart, no rank is busy, at least one rank is in
  a collective, the ranks disagree, the blocking frames are unchanged and every rank uses < 10 % of a core —
  except a rank whose innermost frames are a known spin-wait in both captures (an engine's ``FrameRules.spin_waits``):
  hot, but blocked.
- ``ALL REQUESTS SUCCEEDED`` (0): every request answered normally AND the injector was loaded and armed in every
  rank process AND every injected site was entered on every rank after arming.
- ``DESYNCED`` (7): the collective ledgers show that at one (process group, sequence number) the ranks entered
  different collectives (op, reduce op, shapes or dtypes) and the backend let them complete (wrong values, no
  hang) or crashed on them (gloo's size check). ``repro.proof`` finds it; DEADLOCKED wins when both hold, and a
  run whose ledgers disagree is never ALL REQUESTS SUCCEEDED.
- ``INCONCLUSIVE`` (4): anything else, always with a reason naming the rank, site or process concerned.

DEADLOCKED is also declared at once, without waiting for a stall, when ``repro.proof`` proves it from the ledgers
(a closed set of waits, or ops the backend cannot pair); the verdict then carries the proof (``Verdict.proof``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

DEADLOCKED = "DEADLOCKED"
SUCCEEDED = "ALL REQUESTS SUCCEEDED"
INCONCLUSIVE = "INCONCLUSIVE"
REQUESTS_ERRORED = "requests errored"  # how a burst verdict with failed requests begins (repro.checker reads it)
DESYNCED = "DESYNCED"

EXIT_CODES = {SUCCEEDED: 0, DEADLOCKED: 3, INCONCLUSIVE: 4, DESYNCED: 7}
EXPECT_WORDS = {"deadlock": DEADLOCKED, "success": SUCCEEDED, "inconclusive": INCONCLUSIVE, "desync": DESYNCED}
EXIT_MISMATCH = 5
# exit codes a run ends with that are not a verdict's (verdict.json records them too: always the process's code)
EXIT_INTERNAL = 1  # an internal error (a traceback) before a verdict
EXIT_USAGE = 2  # bad input: refused (e.g. a site that resolves nowhere, found once the server was healthy)
EXIT_INTERRUPTED = 130  # SIGINT (Ctrl-C): 128 + 2
EXIT_TERMINATED = 143  # SIGTERM: 128 + 15


class Interrupted(KeyboardInterrupt):
    """The KeyboardInterrupt the CLI's SIGINT/SIGTERM handler raises; ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int) -> None:
        super().__init__()
        self.signum = int(signum)
        self.exit_code = 128 + self.signum


def interrupt_exit_code(exc: BaseException) -> int:
    """The exit code after ``exc`` (a KeyboardInterrupt): 143 for SIGTERM, else 130 (a plain Ctrl-C)."""
    return int(getattr(exc, "exit_code", EXIT_INTERRUPTED))

IDLE_CPU_PERCENT = 10.0  # a blocked rank uses less than this share of one core


@dataclass(frozen=True)
class Verdict:
    """A run's outcome. ``reason`` is one sentence a reviewer can read; ``notes`` add context (gate matched, ...)."""

    verdict: str
    reason: str
    notes: tuple[str, ...] = ()
    proof: Optional[Mapping[str, Any]] = None  # DEADLOCKED from the ledgers: repro.proof.Proof.to_dict()
    desync: Optional[Mapping[str, Any]] = None  # DESYNCED: repro.proof.Desync.to_dict()

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"verdict": self.verdict, "reason": self.reason, "notes": list(self.notes),
                               "exit_code": self.exit_code}
        if self.proof is not None:
            out["proof"] = dict(self.proof)
        if self.desync is not None:
            out["desync"] = dict(self.desync)
        return out


def combine_with_ledger(verdict: "Verdict", desync: Optional["Verdict"]) -> "Verdict":
    """The run's verdict once the ledgers had their say: DEADLOCKED stays; otherwise a DESYNCED verdict from the
    ledgers (``desync``, None when they agree) replaces ALL REQUESTS SUCCEEDED and INCONCLUSIVE (a crash on a
    mismatched collective, e.g. gloo's size check, is a desync), keeping the replaced verdict's sentence as a note."""
    if desync is None or verdict.verdict == DEADLOCKED:
        return verdict
    if verdict.verdict == DESYNCED:
        return verdict
    return Verdict(DESYNCED, desync.reason, (*desync.notes, f"without the ledger: {verdict.verdict}: {verdict.reason}",
                                             *verdict.notes), desync=desync.desync)


def exit_code_for(verdict: str, expect: Optional[str]) -> int:
    """The process exit code: the verdict's own code, or with ``expect`` (a word of EXPECT_WORDS) 0 / 5."""
    if expect is None:
        return EXIT_CODES[verdict]
    return 0 if EXPECT_WORDS[expect] == verdict else EXIT_MISMATCH


@dataclass(frozen=True)
class StallJudgement:
    """What two captures of a stalled server say. ``deadlocked`` is True only when every rule of docs/pipeline.md holds."""

    deadlocked: bool
    reason: str
    busy_ranks: tuple[int, ...] = ()
    cpu_percent: Mapping[int, float] = field(default_factory=dict)


def judge_stall(
    first: Any,
    second: Any,
    frames_unchanged: bool,
    cpu_percent: Mapping[int, float],
    expected_ranks: Sequence[int],
) -> StallJudgement:
    """Apply the DEADLOCKED rule to two analyses of captures taken ~1–2 s apart.

    Args:
        first, second: ``repro.analysis.Analysis`` of the first and the confirming capture (``.ranks`` each with
            ``.rank`` and ``.state`` in ``collective`` / ``idle-wait`` / ``busy`` / ``unknown``; ``.diverged``;
            ``.summary``).
        frames_unchanged: the blocking frames of every rank are the same in both captures.
        cpu_percent: rank -> share of one core (percent) each rank process used between the two captures.
        expected_ranks: the ranks the server has (all must have been captured).
    Returns:
        A StallJudgement; when not deadlocked its ``reason`` names the rank(s) that prevent the call.
    """
    states = {r.rank: r for r in second.ranks}
    missing = [k for k in expected_ranks if k not in states or getattr(states[k], "state", "unknown") == "unknown"]
    if missing:
        return StallJudgement(False, f"rank(s) {_ranks(missing)} could not be captured or read; cannot tell a deadlock")
    first_states = {r.rank: r.state for r in first.ranks}
    busy = sorted(k for k, r in states.items() if r.state == "busy" or first_states.get(k) == "busy")
    if busy:
        where = "; ".join(f"TP{k} {states[k].where()}" for k in busy if callable(getattr(states[k], "where", None)))
        return StallJudgement(False, f"rank(s) {_ranks(busy)} busy (on CPU or sleeping outside a collective)"
                              + (f": {where}" if where else ""), tuple(busy), dict(cpu_percent))
    # A hot rank whose innermost frames are a known spin-wait (FrameRules.spin_waits, read into RankState.spin_wait)
    # in both captures, with frames unchanged, waits for a peer: blocked, not busy (vLLM's CPU shm ops spin).
    first_by_rank = {r.rank: r for r in first.ranks}
    spinning = {k for k, r in states.items() if frames_unchanged and getattr(r, "spin_wait", False)
                and getattr(first_by_rank.get(k), "spin_wait", False)}
    hot = sorted(k for k, pct in cpu_percent.items() if pct >= IDLE_CPU_PERCENT and k not in spinning)
    if hot:
        detail = ", ".join(f"TP{k} {cpu_percent[k]:.0f}%" for k in hot)
        return StallJudgement(False, f"rank(s) {_ranks(hot)} still use CPU ({detail} of a core)", tuple(hot), dict(cpu_percent))
    if not any(r.state == "collective" for r in states.values()):
        return StallJudgement(False, "no rank is inside a collective (all idle-waiting)", (), dict(cpu_percent))
    if not (first.diverged and second.diverged):
        return StallJudgement(False, f"ranks agree: {second.summary}", (), dict(cpu_percent))
    if not frames_unchanged:
        return StallJudgement(False, "blocking frames changed between the two captures (still moving)", (), dict(cpu_percent))
    return StallJudgement(True, second.summary, (), dict(cpu_percent))


@dataclass(frozen=True)
class InjectionCheck:
    """Per injection, what the fire logs say after the last arming (rank -> count)."""

    injection_id: str
    site: str
    entered: Mapping[int, int]
    matched: Mapping[int, int]
    fired: Mapping[int, int]
    absent: Optional[str] = None  # the injector found the site absent in every process that looked (why), else None
    required: bool = True  # False: an observe-only counter (scenario ``required = false``); zero entries are a count
    nature: str = ""  # natural / forced / observe (repro.scenario.nature_of of its action); "" when not known
    outcomes: Mapping[int, tuple[str, ...]] = field(default_factory=dict)  # rank -> what a natural action's fire
    # did there (a fault: "fault on thread T: thread died"; repro.injection_records.fault_outcomes); {} when nothing


def judge_completion(
    requests: Sequence[Any],
    expected_ranks: Sequence[int],
    loaded_ranks: Sequence[int],
    armed_ranks: Sequence[int],
    injections: Sequence[InjectionCheck],
) -> Verdict:
    """Judge a burst that ended (every request answered or failed) with no deadlock declared.

    Args:
        requests: ``repro.driver.RequestRecord`` objects (``succeeded``, ``status``, ``error``, ``index``).
        expected_ranks: ranks of the server (e.g. ``[0, 1]`` at TP=2).
        loaded_ranks: ranks whose scheduler process wrote a loaded marker.
        armed_ranks: ranks whose injector saw the arm file (ignored when there are no injections).
        injections: one InjectionCheck per injection of the variant.
    Returns:
        SUCCEEDED only if every request succeeded (but those the driver's mass abort disconnected), the injector was loaded (and armed) on every rank and every
        injected site was entered on every rank after arming (but ``required=False`` counters, whose counts are only
        noted); otherwise INCONCLUSIVE naming what is missing.
    """
    failed = [r for r in requests if not r.succeeded and getattr(r, "status", "") != "aborted"]  # aborted: on purpose
    if failed:
        first = failed[0]
        return Verdict(
            INCONCLUSIVE,
            f"{REQUESTS_ERRORED}: {len(failed)} of {len(requests)} did not succeed (request {first.index}: {first.status}, {first.error})",
        )
    not_loaded = [k for k in expected_ranks if k not in set(loaded_ranks)]
    if not_loaded:
        return Verdict(INCONCLUSIVE, f"injector not loaded on rank(s) {_ranks(not_loaded)} (no loaded marker from that scheduler process)")
    if injections:
        not_armed = [k for k in expected_ranks if k not in set(armed_ranks)]
        if not_armed:
            return Verdict(INCONCLUSIVE, f"arm file never seen by rank(s) {_ranks(not_armed)}")
    notes: list[str] = []
    for inj in injections:
        never = [k for k in expected_ranks if inj.entered.get(k, 0) == 0]
        if never and inj.absent:
            return Verdict(
                INCONCLUSIVE,
                f"site {inj.site} ({inj.injection_id}) is absent in this engine's code, so it was never patched nor entered: "
                f"{inj.absent} (`repro sites` lists the nearest names)",
            )
        if not inj.required:
            entered = ", ".join(f"TP{k} {inj.entered.get(k, 0)}" for k in expected_ranks)
            notes.append(f"{inj.injection_id}: {inj.site} entered ({entered}) (counted only; not required)")
            continue
        if never:
            return Verdict(
                INCONCLUSIVE,
                f"site {inj.site} ({inj.injection_id}) never entered on rank(s) {_ranks(never)} after arming: the run did not exercise it",
            )
        matched = sum(inj.matched.values())
        fired = sum(inj.fired.values())
        entered = ", ".join(f"TP{k} {inj.entered.get(k, 0)}" for k in expected_ranks)
        if matched == 0:
            notes.append(
                f"{inj.injection_id}: {inj.site} was entered ({entered}) but its gate never matched: the gated call site "
                "was not reached in this run (e.g. it no longer exists in this version)"
            )
        else:
            fired_on = [k for k in expected_ranks if inj.fired.get(k, 0)]
            notes.append(
                f"{inj.injection_id}: {inj.site} entered ({entered}); gate matched {matched}×, fired {fired}×"
                + (f" on rank(s) {_ranks(fired_on)}" if fired_on else " (action none: control)")
            )
    return Verdict(SUCCEEDED, f"all {len(requests)} requests answered with the requested output length", tuple(notes))


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(k) for k in ranks)
