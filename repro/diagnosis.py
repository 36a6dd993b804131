"""Diagnosis types: the words every report uses, defined once (no analysis here, no I/O).

Layering, the way PyTorch's ``tools/flight_recorder/components`` splits ``types`` / ``builder`` / ``utils``:
this module holds the plain types and formatters; the work that fills them lives in :mod:`repro.analysis` (stack
states), :mod:`repro.ledger` (ledger alignment) and ``repro.hunt.diagnose`` / ``crash_diagnosis`` (which
collective a hunt trial diverged in); the reports (``repro.report`` → REPORT.md, ``repro.compare`` →
COMPARISON.md, ``repro.hunt`` → HUNT.md, ``repro.watch`` → the watch's REPORT.md) import these types and the two
formatters (:func:`describe_where`, :func:`md_cell`) and nothing else of the diagnosis.

Contents:

- :class:`DivergenceKind` — what the ledger's first divergence is (``none`` / ``missing`` / ``mismatch``).
- :class:`CollectiveFamily` — which kind of collective a hunt trial diverged in.
- :class:`CrashKind` — a desync the backend caught and aborted on (today: gloo's size check).
- :class:`CollectiveDiagnosis` — which collective diverged, its family, and the crash kind when it was a crash.
- :data:`COLLECTIVES` — the one table of collective ops the harness knows (op → family of call, abbreviation);
  :data:`COLLECTIVE_OPS` and the narrower :data:`DATA_COLLECTIVES` are views of it. The injector
  (``injectors/repro_injector/``) never imports the harness and keeps its own list of what it wraps.
- :func:`describe_where` — the one "where is this rank" sentence (``all_reduce via GroupCoordinator ← f ← g``).
- :func:`md_cell` — the one markdown escape for text put into a table cell or a one-line bullet.

Enums are ``str`` subclasses: ``DivergenceKind.MISSING == "missing"`` holds and JSON writes the plain value, so
files written with them read the same as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping, Optional, Sequence


class DivergenceKind(str, Enum):
    """Kind of the first point where the ranks' ledgers disagree (see ``repro.ledger.align``).

    ``NONE``: the ledgers agree; ``MISSING``: some ranks of a group entered sequence number N, others never did
    and are blocked in another collective; ``MISMATCH``: every rank entered N, with different op / reduce op /
    shapes / dtypes.
    """

    NONE = "none"
    MISSING = "missing"
    MISMATCH = "mismatch"

    def __str__(self) -> str:  # f"{kind}" gives "missing", as the plain strings did
        return self.value


class CollectiveFamily(str, Enum):
    """Which kind of collective a diverged trial was caught in.

    ``SCHEDULING``: issued by the scheduler or the cache (the family ``repro hunt`` looks for: rank-local state
    steering control flow around it); ``FORWARD``: only the model's own forward collectives (a consequence of
    different batches, not the decision point itself); ``UNCLEAR``: no stack says.
    """

    SCHEDULING = "scheduling/cache"
    FORWARD = "model forward"
    UNCLEAR = "unclear"

    def __str__(self) -> str:
        return self.value


class CrashKind(str, Enum):
    """A desync the backend detected and aborted a rank on, instead of hanging.

    ``GLOO_SIZE_MISMATCH``: gloo's pair transport received a message of another size than the posted collective
    expects (``Received data size doesn't match expected size``, ``enforce fail at pair.cc``) and the rank aborted.
    """

    GLOO_SIZE_MISMATCH = "gloo size mismatch"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class CollectiveDiagnosis:
    """Which collective diverged and in which family (one hunt trial, from its stacks or its server log).

    Attributes:
        family: :class:`CollectiveFamily`.
        collective: name of the divergent collective (catalogue name, else ``op ← caller ← …``); for a crash
            prefixed with the crash kind (``gloo size mismatch in …``).
        in_ranks: ranks blocked in that collective; other ranks are elsewhere.
        where: rank -> one-line place (:func:`describe_where`).
        chain: caller chain of the divergent collective (innermost first).
        known: the upstream issue it matches, if any.
        crash: the :class:`CrashKind` when the backend caught the desync and aborted a rank; None for a hang.
    """

    family: CollectiveFamily
    collective: str
    in_ranks: tuple[int, ...] = ()
    where: dict = field(default_factory=dict)
    chain: tuple[str, ...] = ()
    known: Optional[str] = None
    crash: Optional[CrashKind] = None

    @property
    def is_desync_crash(self) -> bool:
        """The backend aborted a rank on mismatched collectives (``crash`` is set)."""
        return self.crash is not None


# ---------------------------------------------------------------------------------------------------- the op list
@dataclass(frozen=True)
class CollectiveOp:
    """One op name the harness recognises in a stack or a ledger.

    Attributes:
        name: the function name as it appears (``all_reduce``, ``broadcast_object_list``, sglang's ``allreduce``).
        kind: ``collective`` (every rank of the group takes part with data), ``object`` (pickled-object
            collective), ``p2p`` (send/recv), ``sync`` (barrier) or ``wait`` (an async work's wait).
        abbrev: short label for the timeline picture.
    """

    name: str
    kind: str
    abbrev: str


COLLECTIVES: tuple[CollectiveOp, ...] = (
    CollectiveOp("all_reduce", "collective", "AR"), CollectiveOp("allreduce", "collective", "AR"),
    CollectiveOp("broadcast", "collective", "BC"), CollectiveOp("all_gather", "collective", "AG"),
    CollectiveOp("all_gather_into_tensor", "collective", "AGt"), CollectiveOp("allgather", "collective", "AG"),
    CollectiveOp("reduce_scatter", "collective", "RS"), CollectiveOp("reduce_scatter_tensor", "collective", "RSt"),
    CollectiveOp("reduce", "collective", "RD"), CollectiveOp("gather", "collective", "GA"),
    CollectiveOp("scatter", "collective", "SC"), CollectiveOp("all_to_all", "collective", "A2A"),
    CollectiveOp("all_to_all_single", "collective", "A2A"), CollectiveOp("all_gatherv", "collective", "AGv"),
    CollectiveOp("reduce_scatterv", "collective", "RSv"),
    CollectiveOp("all_gather_single", "collective", "AGt"), CollectiveOp("reduce_scatter_single", "collective", "RSt"),
    CollectiveOp("barrier", "sync", "BAR"), CollectiveOp("monitored_barrier", "sync", "MBAR"),
    CollectiveOp("broadcast_object_list", "object", "BOL"), CollectiveOp("all_gather_object", "object", "AGO"),
    CollectiveOp("gather_object", "object", "GO"), CollectiveOp("scatter_object_list", "object", "SOL"),
    CollectiveOp("broadcast_object", "object", "BO"), CollectiveOp("broadcast_tensor_dict", "object", "BTD"),
    CollectiveOp("send", "p2p", "SND"), CollectiveOp("recv", "p2p", "RCV"), CollectiveOp("isend", "p2p", "iSND"),
    CollectiveOp("irecv", "p2p", "iRCV"), CollectiveOp("batch_isend_irecv", "p2p", "BSR"),
    CollectiveOp("send_object_list", "p2p", "SOL"), CollectiveOp("recv_object_list", "p2p", "ROL"),
    CollectiveOp("send_object", "p2p", "SO"), CollectiveOp("recv_object", "p2p", "RO"),
    CollectiveOp("wait", "wait", "W"),
)
OPS: Mapping[str, CollectiveOp] = {c.name: c for c in COLLECTIVES}
COLLECTIVE_OPS: frozenset[str] = frozenset(OPS)
"""Every op name above: what the stack analysis recognises as "in a collective"."""
DATA_COLLECTIVES: frozenset[str] = frozenset(c.name for c in COLLECTIVES if c.kind in ("collective", "sync", "object")
                                             and c.name not in ("allreduce", "allgather"))
"""Group collectives that a backend pairs across ranks (no point-to-point, no bare ``wait``): what a crash log's
aborted thread is searched for."""

WAIT_OPS: frozenset[str] = frozenset({
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "barrier", "broadcast_object_list", "all_gather_object", "broadcast_object", "broadcast_tensor_dict"})
"""Ledger ops that complete only once every member of the group entered them: a rank inside one waits for every
peer (what the ledger proof ``repro.proof`` builds its wait edges from)."""
UNCOMPARED_OPS: frozenset[str] = frozenset({"send", "recv", "gather", "scatter", "all_to_all_single", "monitored_barrier"})
"""Ledger ops whose ranks legitimately differ (point-to-point, rooted, per-rank sizes): never a desync by themselves."""
assert WAIT_OPS <= COLLECTIVE_OPS and UNCOMPARED_OPS <= COLLECTIVE_OPS


def op_abbrev(op: str) -> str:
    """Timeline label of an op: ``AR`` for all_reduce; unknown ops their first 4 letters."""
    c = OPS.get(op)
    return c.abbrev if c is not None else op[:4]


# -------------------------------------------------------------------------------------------------- formatters
def _callers(chain: Sequence[str]) -> list[str]:
    return [c for c in chain if not str(c).startswith("[injected")]


def describe_where(state: str, *, op: Optional[str] = None, via: Optional[str] = None, wait: Optional[str] = None,
                   blocked_frame: Optional[str] = None, caller_chain: Sequence[str] = (),
                   injected_site: Optional[str] = None, error: str = "", depth: int = 3) -> str:
    """The one-line place of a rank, for every report (REPORT.md, COMPARISON.md, HUNT.md, the watch's report).

    Args:
        state: ``collective`` / ``idle-wait`` / ``busy`` / ``unknown`` (``repro.analysis.RankState.state``).
        op, via, wait, blocked_frame, caller_chain, injected_site, error: the rank state's fields of the same names.
        depth: callers shown after the op (injector wrapper frames ``[injected…]`` are never shown).
    Returns:
        ``all_reduce via GroupCoordinator ← VocabParallelEmbedding.forward ← …`` (``via`` only when not plain
        torch.distributed); ``the injected all_reduce at Scheduler.run_batch ← …`` when the collective is the
        injector's own; ``idle (zmq poll) ← …``; ``busy in f ← g``; ``unknown (why)``.
    """
    chain = _callers(caller_chain)
    tail = " ← ".join(chain[:depth])
    if state == "collective" and injected_site:
        return f"the injected {op} at " + " ← ".join([injected_site] + chain[:2])
    if state == "collective":
        head = f"{op}" + (f" via {via}" if via and via != "torch.distributed" else "")
        return f"{head} ← {tail}" if tail else head
    if state == "idle-wait":
        return f"idle ({wait}) ← {tail}" if tail else f"idle ({wait})"
    if state == "busy":
        return f"busy in {blocked_frame}" + (f" ← {' ← '.join(chain[1:depth])}" if len(chain) > 1 else "")
    return f"unknown ({error})" if error else (state if state and state != "unknown" else "unknown")


def where_of(rank_state: Any, depth: int = 3) -> str:
    """:func:`describe_where` of a rank state object (``RankState``) or its JSON dict (``analysis.json``)."""
    get = rank_state.get if isinstance(rank_state, Mapping) else (lambda k, d=None: getattr(rank_state, k, d))
    return describe_where(get("state", "") or "", op=get("op"), via=get("via"), wait=get("wait"),
                          blocked_frame=get("blocked_frame"), caller_chain=get("caller_chain") or (),
                          injected_site=get("injected_site"), error=get("error", "") or "", depth=depth)


def md_cell(text: Any) -> str:
    """Escape text for a markdown table cell or a one-line bullet: ``|`` → ``\\|``, newlines → spaces."""
    return str(text).replace("|", "\\|").replace("\r", "").replace("\n", " ")


__all__ = ["DivergenceKind", "CollectiveFamily", "CrashKind", "CollectiveDiagnosis", "CollectiveOp", "COLLECTIVES",
           "OPS", "COLLECTIVE_OPS", "DATA_COLLECTIVES", "WAIT_OPS", "UNCOMPARED_OPS", "op_abbrev", "describe_where", "where_of", "md_cell"]
