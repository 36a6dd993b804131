"""Arm and disarm a served server (``repro serve``) from its evidence folder: the library behind ``repro arm`` /
``repro disarm``.

A served folder holds ``plan.json`` (the arm file's path, the injector's out_dir and the injection ids),
``serve.json`` (rank -> pid) and ``processes.json`` (the server tree). Arming writes the arm file and waits until
every rank's injector logged that it read it (``repro.runner.arm_and_wait``: ranks poll the file on their own,
every ``arm_poll_s``); disarming writes an empty arm file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

from repro import evidence as ev


class ArmError(ValueError):
    """The folder cannot be armed (no plan, not a served folder, no live server, unknown injection id); the
    message names the file or id and the fix. The CLI exits 2 on it."""


@dataclass(frozen=True)
class ServedRun:
    """What a served folder says: its arm file, the injection ids its plan holds, the injector folder and the ranks.

    ``rank_pids`` is empty for a folder without ``serve.json`` (then arming does not wait); ``injector_dir`` is
    None then too.
    """

    folder: Path
    arm_file: Path
    injection_ids: tuple[str, ...]
    injector_dir: Optional[Path]
    rank_pids: dict[int, int]


@dataclass(frozen=True)
class ArmResult:
    """One ``arm``: the ids armed, the arm file, and the ranks that did not read it in time (``late``)."""

    armed: tuple[str, ...]
    arm_file: Path
    rank_pids: dict[int, int]
    late: tuple[int, ...]
    waited: bool
    injector_dir: Optional[Path] = None

    @property
    def read_by(self) -> list[int]:
        """Ranks whose injector acknowledged the arm file (empty when arming did not wait)."""
        return sorted(k for k in self.rank_pids if k not in self.late) if self.waited else []

    @property
    def confirmed(self) -> bool:
        """Every rank read the arm file (or there was nothing to wait for)."""
        return not self.late


def served_run(evidence: Union[str, Path], need_live_server: bool = True) -> ServedRun:
    """Read a served folder.

    Args:
        evidence: the folder ``repro serve`` printed.
        need_live_server: require a live process of the tree its ``processes.json`` lists.
    Raises:
        ArmError: no readable plan, or (``need_live_server``) no live server belongs to the folder.
    """
    from repro.procs import alive, load_procs

    folder = Path(evidence)
    try:
        evd = ev.EvidenceDir.open(folder)
        plan = evd.plan.read()
    except ev.EvidenceFileError as e:
        raise ArmError(f"{e}; pass the evidence folder `repro serve` printed") from None
    if need_live_server:
        try:
            procs = load_procs(evd.processes.path)
        except (OSError, ValueError):
            procs = []
        if not any(alive(p) for p in procs):
            raise ArmError(f"no live server belongs to {folder} (its {ev.Layout.PROCESSES.name} lists none running); "
                           "start one with `repro serve SCENARIO` and pass the folder it prints")
    try:
        serve = evd.serve.read(missing_ok=True)
    except ev.EvidenceFileError:
        serve = None
    rank_pids = serve.ranks() if serve is not None else {}
    return ServedRun(folder, Path(plan.arm_file), tuple(plan.injection_ids()),
                     Path(plan.out_dir) if rank_pids and plan.out_dir else None, rank_pids)


def arm(evidence: Union[str, Path], injections: Optional[Sequence[str]] = None) -> ArmResult:
    """Arm a served server's injector and wait (at most ``repro.runner.ARM_ACK_TIMEOUT_S``) until every rank read it.

    Args:
        injections: ids to arm (default: every injection of the plan); re-arming restarts occurrence counts.
    Raises:
        ArmError: see :func:`served_run`, or an id the plan does not hold.
    """
    from repro.runner import arm_and_wait

    stack = _stack_roles(evidence)
    if stack:  # several servers (PD): each engine server has its own arm file and injector folder (repro.pd)
        return _arm_stack(evidence, stack, injections)
    s = served_run(evidence)
    ids = tuple(injections or s.injection_ids)
    unknown = [i for i in ids if i not in s.injection_ids]
    if unknown:
        raise ArmError(f"unknown injection id(s) {', '.join(unknown)}; this plan has: "
                       f"{', '.join(s.injection_ids) or '(none)'}")
    late = arm_and_wait(s.arm_file, ids, s.injector_dir, s.rank_pids)
    return ArmResult(ids, s.arm_file, dict(s.rank_pids), tuple(sorted(late)),
                     waited=bool(ids and s.injector_dir and s.rank_pids), injector_dir=s.injector_dir)


def disarm(evidence: Union[str, Path]) -> Path:
    """Disarm a served server (an empty arm file: sites stay patched and counted, nothing fires); returns the arm
    file. Same rule as :func:`arm`: a folder whose server is gone is refused, its arm file left as it is.

    Raises:
        ArmError: no readable plan in the folder, or no live server belongs to it.
    """
    from repro.runner import write_arm_file

    s = served_run(evidence)
    for r in _stack_roles(evidence):
        write_arm_file(Path(r["arm_file"]), [])
    write_arm_file(s.arm_file, [])
    return s.arm_file


def _stack_roles(evidence: Union[str, Path]) -> list[dict]:
    """The engine roles of a multi-server folder's ``stack.json`` (written by ``repro.pd``), else []."""
    try:
        rec = ev.EvidenceDir.open(evidence).stack.read(missing_ok=True)
    except Exception:
        return []
    roles = rec.get("roles") if isinstance(rec, dict) else None
    return [r for r in roles or [] if isinstance(r, dict) and r.get("kind") == "engine" and r.get("arm_file")]


def _arm_stack(evidence: Union[str, Path], roles: list[dict], injections: Optional[Sequence[str]]) -> ArmResult:
    """Arm each engine server of a stack with its own share of the ids and wait for its ranks. The result's ranks
    are numbered across the servers in stack order (``prefill`` TP0..N-1, then ``decode`` TP0..)."""
    from repro.runner import arm_and_wait

    s = served_run(evidence)
    ids = tuple(injections or s.injection_ids)
    unknown = [i for i in ids if i not in s.injection_ids]
    if unknown:
        raise ArmError(f"unknown injection id(s) {', '.join(unknown)}; this plan has: "
                       f"{', '.join(s.injection_ids) or '(none)'}")
    all_pids: dict[int, int] = {}
    late: list[int] = []
    for r in roles:
        pids = {int(k): int(v) for k, v in (r.get("rank_pids") or {}).items()}
        base = len(all_pids)
        mine = [i for i in ids if i in (r.get("injection_ids") or [])]
        inj_dir = Path(r["folder"]) / ev.Layout.INJECTOR.name
        late += [base + k for k in arm_and_wait(Path(r["arm_file"]), mine, inj_dir, pids)]
        all_pids.update({base + k: v for k, v in pids.items()})
    return ArmResult(ids, s.arm_file, all_pids, tuple(sorted(late)), waited=bool(ids and all_pids))


__all__ = ["ArmError", "ArmResult", "ServedRun", "served_run", "arm", "disarm"]
