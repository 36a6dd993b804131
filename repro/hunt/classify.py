"""Classification of a hunt trial: which collective diverged, whether it is in the model's forward or in a
scheduling/cache collective (the family the hunt looks for), whether it is a known upstream issue, and the one-line
hazard statement (types: :mod:`repro.diagnosis`; the catalogue's rules: :mod:`repro.catalogue`).
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

from repro.catalogue import Catalogue, glob_any, short_frame
from repro.diagnosis import DATA_COLLECTIVES, CollectiveDiagnosis, CollectiveFamily, CrashKind, where_of
from repro.hunt.plan import Trial
from repro.verdict import DEADLOCKED, DESYNCED, SUCCEEDED

FAMILY_SCHED = CollectiveFamily.SCHEDULING  # the enums of repro.diagnosis; names kept for callers
FAMILY_FORWARD = CollectiveFamily.FORWARD
FAMILY_UNCLEAR = CollectiveFamily.UNCLEAR


Diagnosis = CollectiveDiagnosis  # the type lives in repro.diagnosis (reports import only types)


def diagnose(analysis: Optional[dict], catalogue: Catalogue) -> Diagnosis:
    """Name the divergent collective of a deadlock from its analysis (``Analysis.to_dict()``).

    The divergent collective is the one of a rank blocked in a collective that is neither the idle request
    broadcast (``idle_frames``) nor under the model forward (``forward_frames``); failing that, a forward one.
    """
    if not analysis or not analysis.get("ranks"):
        return Diagnosis(FAMILY_UNCLEAR, "no stacks")
    where = {int(r["rank"]): where_of(r) for r in analysis["ranks"]}
    sched, fwd = [], []
    for r in analysis["ranks"]:
        if r.get("state") != "collective":
            continue
        chain = [c for c in r.get("caller_chain") or [] if not c.startswith("[injected]")]
        if glob_any(chain, catalogue.idle_frames):
            continue
        (fwd if glob_any(chain, catalogue.forward_frames) else sched).append((r, tuple(chain)))
    pick, family = (sched, FAMILY_SCHED) if sched else ((fwd, FAMILY_FORWARD) if fwd else ([], FAMILY_UNCLEAR))
    if not pick:
        return Diagnosis(FAMILY_UNCLEAR, "no rank blocked in a non-idle collective", (), where)
    r, chain = pick[0]
    name = next((n.name for n in catalogue.named if glob_any(chain, n.frames)), "")
    if not name:
        name = f"{r.get('op')} ← " + " ← ".join(chain[:3])
    in_ranks = tuple(sorted(int(x["rank"]) for x, c in pick if c == chain))
    return Diagnosis(family, name, in_ranks, where, chain, known_issue(catalogue, chain))


def known_issue(catalogue: Catalogue, chain: Sequence[str], short: bool = False) -> Optional[str]:
    """The catalogue's ``[[known]]`` issue whose frames all match the divergent collective's caller chain, or None.

    Args:
        catalogue: the hunt catalogue (``scenarios/<engine>/hunt_catalogue.toml``).
        chain: caller frames, innermost first (``Class.method`` names, or bare function names when ``short``).
        short: the chain holds bare function names (a faulthandler dump in a server log): each pattern is matched
            by its last dotted part, as ``[[classify.named]]`` is for crashes.
    """
    for k in catalogue.known:
        pats = tuple(f.rsplit(".", 1)[-1] for f in k.frames) if short else k.frames
        if pats and all(glob_any(chain, (f,)) for f in pats):
            return k.issue
    return None


_MISMATCH_RE = re.compile(r"collective mismatch|Received data size doesn't match|doesn't match expected size")


def crash_diagnosis(log_text: str, catalogue: Catalogue) -> Optional[Diagnosis]:
    """A desync the backend caught: gloo aborts a rank whose peer sent a collective of another size.

    Reads the server log written during one trial: faulthandler's ``Fatal Python error`` thread dumps (parsed by
    ``repro.stacks.parse_faulthandler``, innermost frame first) and names the collective the aborted rank was in.
    Returns None when the log shows no mismatch; else a diagnosis with ``crash`` = ``CrashKind.GLOO_SIZE_MISMATCH``.
    ``family`` is ``model forward`` when a frame is one of the catalogue's ``crash_forward_functions``.
    """
    from repro.stacks import parse_faulthandler

    if not _MISMATCH_RE.search(log_text):
        return None
    crash = CrashKind.GLOO_SIZE_MISMATCH
    start = log_text.find("Fatal Python error")
    dump = parse_faulthandler(log_text[start:] if start >= 0 else log_text)[0]
    for thread in dump.threads:
        frames = [f for f in thread.frames if not f.native]
        names = [f.short_function for f in frames]
        op = next((n for n in names if n in DATA_COLLECTIVES), None)
        if op is None:
            continue
        chain = tuple(f.short_function for f in frames
                      if not (f.module_or_file.startswith("torch/") or "/torch/" in f.module_or_file)
                      and "repro_injector" not in f.module_or_file and f.short_function not in DATA_COLLECTIVES
                      and f.short_function != "wrapper")
        fwd = bool(set(chain) & set(catalogue.crash_forward_functions))
        name = next((n.name for n in catalogue.named if glob_any(chain, tuple(f.rsplit(".", 1)[-1] for f in n.frames))), "")
        coll = f"{crash} in {name or op + ' ← ' + ' ← '.join(chain[:3])}"
        return Diagnosis(FAMILY_FORWARD if fwd else FAMILY_SCHED, coll, (), {}, chain,
                         known_issue(catalogue, chain, short=True), crash=crash)
    return Diagnosis(FAMILY_UNCLEAR, f"{crash} (no stack of the aborted rank in the log)", crash=crash)


def desync_diagnosis(desync: dict, cat: Catalogue) -> Diagnosis:
    """A :class:`Diagnosis` for a DESYNCED trial from the ledger proof's desync record (``Desync.to_dict()``):
    the collective is named by the catalogue from the records' call-site frames (innermost first), the family is
    the model forward when a frame is one of its ``forward_frames``, and ``known`` as for a deadlock."""
    recs = list((desync.get("records") or {}).values())
    chains = [tuple(short_frame(x) for x in (r.get("site") or [])) for r in recs]
    busy = [c for c in chains if c and not glob_any(c, cat.idle_frames)]  # the idle request broadcast says nothing
    chain = next((c for c in busy if not glob_any(c, cat.forward_frames)), busy[0] if busy else (chains[0] if chains else ()))
    fam = FAMILY_FORWARD if chain and glob_any(chain, cat.forward_frames) else FAMILY_SCHED
    name = next((n.name for n in cat.named if glob_any(chain, n.frames)), "")
    ops = "/".join(sorted({str(r.get("op")) for r in recs if r.get("op")}))
    if not name:
        name = f"{ops or 'collective'} #{desync.get('seq')} on {desync.get('label') or desync.get('group')}" + (
            f" ← {' ← '.join(chain[:3])}" if chain else "")
    known = known_issue(cat, chain)
    ranks = tuple(sorted(int(r.get("rank")) for r in recs if r.get("rank") is not None))
    return Diagnosis(fam, name, ranks, {}, chain, known)


def hazard_statement(trial: Trial, verdict: str, diag: Optional[Diagnosis], matched: int, fired: int, world: int) -> str:
    """One line a reviewer can act on (what was perturbed, where, and what followed)."""
    t = trial
    head = f"rank-local `{t.row.point}` {t.perturbation.says} on rank {t.rank} ({t.row.where})"
    if matched == 0:
        return f"{head}: the gated call was not reached during the burst (not exercised)"
    if verdict == DEADLOCKED and diag is not None:
        others = [k for k in range(world) if k not in diag.in_ranks]
        who = f"rank(s) {', '.join(map(str, diag.in_ranks))} wait in it, rank(s) {', '.join(map(str, others))} never issue it"
        kind = "a scheduling/cache collective" if diag.family == FAMILY_SCHED else (
            "the model's own forward collective" if diag.family == FAMILY_FORWARD else "a collective")
        known = f" (known: {diag.known})" if diag.known else ""
        bc = " (by construction: the perturbation itself removes/adds a collective)" if t.perturbation.by_construction else ""
        return f"{head} → {diag.collective}: {who} → deadlock in {kind}{known}{bc}"
    if verdict == SUCCEEDED:
        return f"{head} → tolerated: every request answered, ranks stayed in step"
    if verdict == DESYNCED:
        where = f" in {diag.collective}" if diag is not None else ""
        return f"{head} → the ranks entered different collectives{where} (DESYNCED: the ledgers disagree)"
    if diag is not None and diag.crash is not None:
        kind = "the model's own forward collective" if diag.family == FAMILY_FORWARD else "a scheduling/cache collective"
        return (f"{head} → ranks issued mismatched collectives; gloo aborted a rank ({diag.collective}, {kind}): "
                f"a desync crash here, a hang or silent corruption where the backend does not check sizes")
    return f"{head} → {verdict.lower()}"
