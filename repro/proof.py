"""Prove a deadlock, or find a desync, from the ranks' collective ledgers (a live ``LiveAlignment``).

Two shapes of proof (:func:`find_proof`), both sound on any mix of per-rank read positions, because each rank's
file is a prefix of its history (``repro.ledger_follow``):

- **missing partner** — a *wait edge* ``r → s`` says: rank r's thread T is inside collective (g, n) (entered, not
  left), s is a member of g that has not entered (g, n), and the thread of s that issues g's collectives (the
  thread of its latest record on g; a group s used from several threads, or never yet, makes no edge) is itself inside another
  collective (g′, m). r cannot leave (g, n) before s
  enters it, and s cannot enter it before it leaves (g′, m). A *cycle* of such edges is a closed set of waits: take
  the first of them to leave its collective — it needed its successor to leave first. So nobody leaves: DEADLOCKED.
  (The smoke scenario: rank 0 in tp/cpu #25, rank 1 in tp/device #55, each missing from the other's.)
- **unpairable ops** — every member of g entered (g, n), nobody left, and the backend's pairing table
  (:class:`PairingTable`, measured for gloo by ``scripts/measure_pairing.py``) says this pair of ops never completes
  (sglang#30760: one rank in broadcast, the other in all_reduce(MAX), both at TP CPU #459). Those ranks are stuck;
  a rank with a wait edge to a stuck rank is stuck too.

Which collectives count as waits: the ones that need every member of the group (all_reduce, broadcast — a receiver
needs only the source when the ledger names it —, all_gather, all_gather_into_tensor, reduce_scatter(_tensor),
barrier, the object collectives, sglang's coordinator calls recorded as bypass). Point-to-point ops, gather,
all_to_all_single and monitored_barrier never make an edge. Collectives on background threads and async ops take
part only through their recorded waits (an async op's record is left at once: never a wait). A rank whose ledger
is missing, truncated, rotated out of order or corrupt (``RankFollow.unreliable``), or whose process is gone, is in
no proof: the stall rule decides instead.

**Desync** (:func:`find_desyncs`): at one (g, n) every member entered, with different op / reduce op / shapes /
dtypes, and they all left (the backend paired them: wrong values, no hang — gloo pairs two same-size all_reduces
whatever their reduce ops) or one of them raised or died (gloo's size check aborts the process). Groups that
carried send/recv, and gather / all_to_all_single records (whose shapes differ by design), are never compared.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from repro.evidence import Layout
from repro.ledger import Record, short_name
from repro.ledger_follow import LiveAlignment, Slot
from repro.verdict import DEADLOCKED, DESYNCED, Verdict, combine_with_ledger

DATA_DIR = Path(__file__).resolve().parent / "data"

# collectives that complete only once every member of the group entered them (see the module docstring), and the
# ones never compared: both views of the one op table (repro/diagnosis.py)
from repro.diagnosis import UNCOMPARED_OPS, WAIT_OPS  # noqa: E402
ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "float16": 2, "bfloat16": 2, "int32": 4, "float32": 4,
            "int64": 8, "float64": 8, "complex64": 8, "complex128": 16}


class PairingError(ValueError):
    """A pairing table file is unreadable (message names the file and the field)."""


def _cmp(a: float, b: float) -> str:
    return "=" if a == b else ("<" if a < b else ">")


def numel(shapes: Sequence) -> int:
    """Elements passed in a record's tensors (``shapes`` as the ledger writes them; a tensor list is ``[n, *s]``)."""
    return sum(math.prod(int(x) for x in s) if s else 1 for s in shapes)


@dataclass(frozen=True)
class Side:
    """One rank's call in a pair: op, reduce op, element count, dtype, and whether it is a broadcast's source."""

    op: str
    red: Optional[str] = None
    numel: int = 0
    dtype: Optional[str] = None
    is_src: Optional[bool] = None

    @classmethod
    def of(cls, r: Record, rank_in_group: Optional[int] = None, src_in_group: Optional[int] = None) -> "Side":
        is_src = None
        if r.op == "broadcast" and rank_in_group is not None and src_in_group is not None:
            is_src = rank_in_group == src_in_group
        return cls(r.op, r.red, numel(r.shapes), r.dtypes[0] if r.dtypes else None, is_src)


def features(a: Side, b: Side) -> tuple:
    """What a table entry stands for: different ops → just the two ops; the same op → reduce ops equal?, element
    counts (=, <, >), element sizes (=, <, >), dtypes equal?, which side is the broadcast source, and whether a side
    has a single element."""
    if a.op != b.op:
        return (a.op, b.op)
    ia, ib = ITEMSIZE.get(a.dtype or "", 0), ITEMSIZE.get(b.dtype or "", 0)
    # a single element on one side is its own class: gloo hangs on all_reduce 1 vs 4 int32 but aborts in its size
    # check from 4 vs 8 float32 up to 448 vs 512 float16 (measured, repro/data/pairing_gloo.json)
    return (a.op, b.op, a.red == b.red, _cmp(a.numel, b.numel), _cmp(ia, ib), a.dtype == b.dtype, a.is_src, b.is_src,
            min(a.numel, b.numel) <= 1)


class PairingTable:
    """Which pairs of different calls at one (group, sequence number) a backend completes (``pairs``), crashes on
    (``crash``), leaves hanging (``hangs``), or does not define (``undefined``); ``unknown`` when nothing measured
    stands for the pair.

    gloo (``repro/data/pairing_gloo.json``): measured cases, 2 ranks, looked up by :func:`features` (a measured
    all_reduce(SUM) [1] int32 against all_reduce(MAX) [1] int32 stands for every same-size all_reduce pair whose
    reduce ops differ). nccl (``repro/data/pairing_nccl.json``): rules from NCCL's documented semantics.

    Raises:
        PairingError: the file is missing or malformed.
    """

    def __init__(self, backend: str, data: Mapping[str, Any], path: str = "") -> None:
        self.backend = backend
        self.path = path
        self.cases: dict[tuple, str] = {}
        self.solo: dict[str, str] = {}
        self.rules: list[dict] = list(data.get("rules") or [])
        for i, c in enumerate(data.get("cases") or []):
            try:
                a, b, outcome = c["a"], c["b"], c["outcome"]
                if a is None or b is None:
                    one = a or b
                    self.solo[one["op"]] = outcome
                    continue
                sa = Side(a["op"], a.get("red"), int(a.get("numel") or 0), a.get("dtype"),
                          None if a.get("src") is None else a["src"] == 0)
                sb = Side(b["op"], b.get("red"), int(b.get("numel") or 0), b.get("dtype"),
                          None if b.get("src") is None else b["src"] == 1)
            except (KeyError, TypeError, ValueError) as e:
                raise PairingError(f"{path}: cases[{i}]: expected a, b (op, red, numel, dtype, src) and outcome ({e})")
            key = features(sa, sb)
            if self.cases.get(key, outcome) != outcome:
                outcome = "unknown"  # two measured cases with these features disagree: claim nothing
            self.cases[key] = outcome

    @classmethod
    def load(cls, backend: str, path: Optional[Path] = None) -> "PairingTable":
        """The table of ``backend`` (``gloo`` / ``nccl``) from ``repro/data/pairing_<backend>.json`` (or ``path``)."""
        p = Path(path) if path else DATA_DIR / f"pairing_{backend}.json"
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise PairingError(f"{p}: cannot read the pairing table ({e}); expected the JSON written by "
                               "scripts/measure_pairing.py") from None
        return cls(backend, data, str(p))

    def outcome(self, a: Side, b: Side) -> str:
        """``pairs`` / ``crash`` / ``hangs`` / ``undefined`` / ``unknown`` for rank A calling ``a`` and B ``b``."""
        if self.rules:
            differs = set()
            if a.op != b.op:
                differs.add("op")
            else:
                if a.red != b.red:
                    differs.add("red")
                if a.numel != b.numel:
                    differs.add("numel")
                if a.dtype != b.dtype:
                    differs.add("dtype")
                if a.op == "broadcast" and a.is_src is not None and b.is_src is not None and a.is_src == b.is_src:
                    differs.add("src")  # both sources, or both receivers: they name different sources
            for rule in self.rules:
                if bool(rule.get("same_op")) == (a.op == b.op) and set(rule.get("differs") or ()) == differs:
                    return str(rule["outcome"])
            worst = [str(r["outcome"]) for r in self.rules if set(r.get("differs") or ()) & differs]
            return "undefined" if "undefined" in worst else "unknown"
        hit = self.cases.get(features(a, b))
        if hit is None:
            hit = self.cases.get(features(b, a))
        return hit or "unknown"

    def solo_blocks(self, op: str) -> bool:
        """A rank alone in ``op`` (its peers never call it) waits: measured for gloo; NCCL/unmeasured ops: assumed."""
        return self.solo.get(op, "blocks") == "blocks"


@lru_cache(maxsize=8)
def table_for(backend: str) -> Optional[PairingTable]:
    """The pairing table for a backend name as the ledger writes it (``gloo``, ``nccl``, ``cpu:gloo,cuda:nccl``);
    None when none is known (then no unpairable proof on that group)."""
    b = (backend or "").lower()
    name = "nccl" if "nccl" in b else ("gloo" if "gloo" in b else "")
    if not name:
        return None
    try:
        return PairingTable.load(name)
    except PairingError:
        return None


@dataclass(frozen=True)
class WaitEdge:
    """``rank`` (thread ``thread``) is inside ``op`` #``seq`` on ``group`` and waits for ``on``; ``kind``:
    ``missing`` (``on`` has not entered it and is itself inside ``on_group`` #``on_seq``) or ``unpairable`` (``on``
    entered it with an op the backend cannot pair)."""

    rank: int
    thread: str
    group: str
    seq: int
    op: str
    on: int
    kind: str
    on_group: Optional[str] = None
    on_seq: Optional[int] = None
    on_op: Optional[str] = None

    def to_dict(self) -> dict:
        return {"rank": self.rank, "thread": self.thread, "group": self.group, "seq": self.seq, "op": self.op,
                "waits_for": self.on, "kind": self.kind, "peer_in": None if self.on_group is None else
                {"group": self.on_group, "seq": self.on_seq, "op": self.on_op}}


@dataclass(frozen=True)
class Proof:
    """A deadlock proved from the ledgers.

    Attributes:
        kind: ``missing_partner`` or ``unpairable`` (or ``missing_partner+unpairable``).
        ranks: the stuck ranks; edges: the wait edges that prove it; records: rank → the record each stuck rank is
        inside; closing: the record whose entry completed the proof (its ``t_enter`` starts the proof latency);
        summary: one sentence; groups: group key → sglang label or key.
    """

    kind: str
    ranks: tuple[int, ...]
    edges: tuple[WaitEdge, ...]
    records: Mapping[int, Record]
    closing: Record
    summary: str
    groups: Mapping[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "ranks": list(self.ranks), "edges": [e.to_dict() for e in self.edges],
                "inside": {str(k): _rec(v) for k, v in sorted(self.records.items())},
                "closing": _rec(self.closing), "closing_t_enter": self.closing.t_enter,
                "groups": dict(self.groups), "summary": self.summary}

    def note_lines(self) -> list[str]:
        """One line per wait edge, for REPORT.md."""
        out = []
        for e in self.edges:
            g = self.groups.get(e.group, e.group)
            if e.kind == "missing":
                og = self.groups.get(e.on_group or "", e.on_group)
                out.append(f"wait edge: rank {e.rank} in {e.op} #{e.seq} on {g} waits for rank {e.on}, which has not "
                           f"entered it and is inside {e.on_op} #{e.on_seq} on {og}")
            else:
                out.append(f"wait edge: rank {e.rank} in {e.op} #{e.seq} on {g} waits for rank {e.on}, which entered "
                           f"it with {e.on_op} (the {self.kind and 'backend'} cannot pair them)")
        return out


@dataclass(frozen=True)
class Desync:
    """Ranks that entered different collectives at one (group, sequence number).

    Attributes:
        group / label / seq; records: rank → its record there; fields: which of op / red / shapes / dtypes differ;
        outcome: ``completed`` (all left), ``crashed`` (one raised, or its process died), ``pending`` (not all left
        yet); pairing: what the backend's table says of the pair; summary: one sentence.
    """

    group: str
    label: str
    seq: int
    records: Mapping[int, Record]
    fields: tuple[str, ...]
    outcome: str
    pairing: str
    summary: str

    def to_dict(self) -> dict:
        return {"group": self.group, "label": self.label, "seq": self.seq, "fields": list(self.fields),
                "outcome": self.outcome, "pairing": self.pairing,
                "records": {str(k): _rec(v) for k, v in sorted(self.records.items())}, "summary": self.summary}


def _rec(r: Record) -> dict:
    return {"rank": r.rank, "group": r.group, "seq": r.seq, "op": r.op, "api": r.api, "red": r.red,
            "shapes": [list(s) if isinstance(s, tuple) else s for s in r.shapes], "dtypes": list(r.dtypes),
            "site": list(r.site), "tick": r.tick, "thread": r.thread, "t_enter": r.t_enter, "t_exit": r.t_exit,
            "inj": r.inj, "err": r.err, "src": r.src}


def _label(al: LiveAlignment, group: str) -> str:
    g = al.groups.get(group)
    return g.short() if g is not None else group


def _rank_in_group(al: LiveAlignment, group: str, rank: int) -> Optional[int]:
    m = al.members(group)
    return m.index(rank) if rank in m else None


def _required(al: LiveAlignment, r: Record) -> tuple[int, ...]:
    """The members whose entry ``r``'s collective needs (all of them, or a broadcast receiver's source)."""
    members = al.members(r.group)
    if r.op == "broadcast" and r.src is not None and r.src != r.rank:
        return (r.src,) if r.src in members else ()
    if r.op in ("broadcast", "broadcast_object_list", "broadcast_object", "broadcast_tensor_dict") \
            and r.src is None and len(members) > 2:
        return ()  # a receiver needs only the source, which the record does not name
    return tuple(k for k in members if k != r.rank)


def _signature(r: Record) -> tuple:
    return (r.op, r.red, r.shapes, r.dtypes)


def _sides(al: LiveAlignment, slot: Slot) -> dict[int, Side]:
    out = {}
    for k, r in slot.entered.items():
        src_g = _rank_in_group(al, r.group, r.src) if r.src is not None else None
        out[k] = Side.of(r, _rank_in_group(al, r.group, k), src_g)
    return out


def _pair_outcome(al: LiveAlignment, slot: Slot) -> str:
    """The table's word on a slot's differing calls: ``hangs`` only if every differing pair hangs."""
    table = table_for(al.backend(slot.group))
    if table is None:
        return "unknown"
    sides = _sides(al, slot)
    ranks = sorted(sides)
    outs = set()
    for i, a in enumerate(ranks):
        for b in ranks[i + 1:]:
            if _signature(slot.entered[a]) != _signature(slot.entered[b]):
                outs.add(table.outcome(sides[a], sides[b]))
    if not outs or outs == {"pairs"}:
        return "pairs"
    if outs == {"hangs"}:
        return "hangs"
    if "crash" in outs:
        return "crash"
    return "undefined" if "undefined" in outs else "unknown"


def _peer_thread(al: LiveAlignment, k: int, th: str, s: int, group: str) -> Optional[str]:
    """The thread of rank ``s`` that will enter ``group``'s next collective, or None when that is unknown.

    The thread of ``s``'s latest record on ``group`` when only one thread of ``s`` issues it. When ``s`` has issued
    none on ``group`` yet (vLLM's TP device group, first used by a model all_reduce that one rank reached and its
    peer did not), the thread is taken by analogy with rank ``k``: if ``k``'s thread ``th`` alone issues other groups
    too, and ``s`` issues each of those from one and the same thread, that thread issues ``group`` on ``s`` as well
    (the ranks run one program). A group that only a background thread of ``k`` issues (HiCache's prefetch group)
    has no such analogue: unknown, no edge.
    """
    sf = al.ranks[s]
    if len(sf.threads_on.get(group, ())) > 1:
        return None  # s issues the group's collectives from several threads
    if group in sf.last_thread:
        return sf.last_thread[group]
    rk = al.ranks[k]
    found: set = set()
    for h, ths in rk.threads_on.items():
        if h == group or set(ths) != {th} or h in al.p2p_groups:
            continue
        on_s = sf.threads_on.get(h)
        if not on_s:
            continue
        if len(on_s) > 1:
            return None
        found |= set(on_s)
    return next(iter(found)) if len(found) == 1 else None


def find_proof(al: LiveAlignment, alive: Optional[Iterable[int]] = None) -> Optional[Proof]:
    """A deadlock proof from the alignment as read so far, or None (see the module docstring for the rules).

    Args:
        al: the live alignment (``repro.ledger_follow.LedgerFollower.alignment``).
        alive: ranks whose process is alive now (None: all assumed alive); a dead rank is in no proof.
    """
    alive_set = set(al.ranks) if alive is None else set(alive)
    usable = {k for k in al.ranks if al.usable(k) and k in alive_set}
    # nodes: (rank, thread) inside a waiting collective
    nodes: dict[tuple[int, str], Record] = {}
    for k in usable:
        for th, r in al.ranks[k].blocking().items():
            if r.op in WAIT_OPS and r.group not in al.p2p_groups:
                table = table_for(al.backend(r.group))
                if table is None or table.solo_blocks(r.op):
                    nodes[(k, th)] = r
    edges: dict[tuple[int, str], list[tuple[tuple[int, str], WaitEdge]]] = {}
    stuck: dict[tuple[int, str], list[WaitEdge]] = {}
    for node, r in nodes.items():
        k, th = node
        slot = al.slots.get((r.group, r.seq))
        members = al.members(r.group)
        # unpairable: every member entered, nobody left, the backend cannot pair them
        if slot is not None and set(members) <= set(slot.entered) and not slot.left \
                and all(m in usable for m in members) and len({_signature(x) for x in slot.entered.values()}) > 1:
            if all((m, slot.entered[m].thread) in nodes and nodes[(m, slot.entered[m].thread)] is slot.entered[m]
                   for m in members) and _pair_outcome(al, slot) == "hangs":
                stuck[node] = [WaitEdge(k, th, r.group, r.seq, r.op, m, "unpairable", r.group, r.seq, slot.entered[m].op)
                               for m in members if m != k and _signature(slot.entered[m]) != _signature(r)]
                continue
        for s in _required(al, r):
            if s not in usable:
                continue
            sf = al.ranks[s]
            if not sf.knows_group(r.group) or sf.seq_on(r.group) >= r.seq:
                continue
            th_s = _peer_thread(al, k, th, s, r.group)
            if th_s is None:
                continue
            w = nodes.get((s, th_s))
            if w is None or (w.group, w.seq) == (r.group, r.seq):
                continue
            edges.setdefault(node, []).append(((s, th_s), WaitEdge(k, th, r.group, r.seq, r.op, s, "missing",
                                                                   w.group, w.seq, w.op)))
    dead = _dead_nodes(set(nodes), edges, set(stuck))
    if not dead:
        return None
    used: list[WaitEdge] = []
    for n in sorted(dead):
        used += stuck.get(n, [])
        used += [e for tgt, e in edges.get(n, []) if tgt in dead]
    recs = {}
    for (k, _th) in sorted(dead):
        r = nodes[(k, _th)]
        if k not in recs or r.t_enter > recs[k].t_enter:
            recs[k] = r
    kinds = sorted({"unpairable" if e.kind == "unpairable" else "missing_partner" for e in used})
    closing = max((nodes[n] for n in dead), key=lambda r: r.t_enter)
    groups = {g: _label(al, g) for g in {e.group for e in used} | {e.on_group for e in used if e.on_group}}
    proof = Proof("+".join(kinds) or "missing_partner", tuple(sorted(recs)), tuple(used), recs, closing, "", groups)
    return Proof(proof.kind, proof.ranks, proof.edges, proof.records, proof.closing, _proof_summary(proof, al), groups)


def _dead_nodes(nodes: set, edges: dict, stuck: set) -> set:
    """Nodes on a cycle of wait edges, the unpairable ones, and every node with an edge into those (fixpoint)."""
    succ = {n: [t for t, _ in edges.get(n, [])] for n in nodes}
    dead = set(stuck)
    # cycles: a node that can reach itself
    for n in nodes:
        seen, todo = set(), list(succ[n])
        while todo:
            x = todo.pop()
            if x == n:
                dead.add(n)
                break
            if x in seen or x not in succ:
                continue
            seen.add(x)
            todo += succ[x]
    changed = True
    while changed:
        changed = False
        for n in nodes:
            if n not in dead and any(t in dead for t in succ[n]):
                dead.add(n)
                changed = True
    return dead


def _where(r: Record, al: LiveAlignment) -> str:
    inj = "the injected " if r.inj else ""
    red = f"({r.red})" if r.red and r.op == "all_reduce" else ""
    site = " ← ".join(short_name(s) for s in r.site[:2]) or "?"
    return f"{inj}{r.op}{red} #{r.seq} on {_label(al, r.group)} from {site}"


def _proof_summary(p: Proof, al: LiveAlignment) -> str:
    parts = [f"rank {k} is inside {_where(r, al)}" for k, r in sorted(p.records.items())]
    if "unpairable" in p.kind:
        why = "every rank of the group entered it with ops the backend cannot pair, and none left"
    else:
        why = "each waits for a rank that has not entered its collective and is itself blocked: a closed set of waits"
    return "Ledger proof of a deadlock: " + "; ".join(parts) + f" — {why}."


def find_desyncs(al: LiveAlignment, alive: Optional[Iterable[int]] = None, include_pending: bool = False) -> list[Desync]:
    """Slots where every member entered with a different signature (see the module docstring), oldest first.

    Args:
        al: the alignment; alive: ranks whose process is alive (a dead member makes the slot ``crashed``).
        include_pending: also slots not every member left yet (the end of a run: a disagreement is never success).
    """
    alive_set = set(al.ranks) if alive is None else set(alive)
    out: list[Desync] = []
    for (g, n), slot in sorted(al.slots.items(), key=lambda kv: min(r.t_enter for r in kv[1].entered.values())):
        if g in al.p2p_groups:
            continue
        members = al.members(g)
        if len(members) < 2 or not set(members) <= set(slot.entered) or not all(al.usable(m) for m in members):
            continue
        recs = {m: slot.entered[m] for m in members}
        if any(r.op in UNCOMPARED_OPS for r in recs.values()):
            continue
        sigs = {_signature(r) for r in recs.values()}
        if len(sigs) < 2:
            continue
        if any(r.err for r in recs.values()) or any(m not in alive_set for m in members):
            outcome = "crashed"
        elif set(members) <= slot.left:
            outcome = "completed"
        else:
            outcome = "pending"
        if outcome == "pending" and not include_pending:
            continue
        names = ("op", "red", "shapes", "dtypes")
        diff = tuple(nm for i, nm in enumerate(names) if len({_signature(r)[i] for r in recs.values()}) > 1)
        d = Desync(g, _label(al, g), n, recs, diff, outcome, _pair_outcome(al, slot), "")
        out.append(Desync(d.group, d.label, d.seq, d.records, d.fields, d.outcome, d.pairing, _desync_summary(d, al)))
    return out


def _desync_summary(d: Desync, al: LiveAlignment) -> str:
    by = " while ".join(f"rank {k} entered {_where(r, al)} {list(r.shapes)} {','.join(r.dtypes)}"
                        for k, r in sorted(d.records.items()))
    how = {"completed": "and the backend let them complete (wrong values, no hang)",
           "crashed": "and the backend crashed on them (" + next((r.err for r in d.records.values() if r.err),
                                                                   "a rank process died") + ")",
           "pending": "(they have not all left it)"}[d.outcome]
    return f"Ledger desync at {d.label} #{d.seq}: {by} — {', '.join(d.fields)} differ {how}."


def judge_slots(al: LiveAlignment, since: float = 0.0, max_slots: int = 50_000) -> list[Desync]:
    """Retire the slots changed since the last call that every member entered and left, and return the desyncs
    among them (completed or crashed) entered at or after ``since`` (epoch seconds). Keeps the alignment's memory
    and :func:`find_proof` / :func:`find_desyncs`'s work bounded on a long-lived server; at most ``max_slots`` are
    kept (the oldest retired first). Used by the detect stage and by ``repro watch`` (repro/watch/)."""
    out: list[Desync] = []
    for key in list(al.dirty):
        slot = al.slots.get(key)
        al.dirty.discard(key)
        if slot is None:
            continue
        members = al.members(slot.group)
        if not (set(members) <= slot.left):
            continue
        if len({_signature(r) for r in slot.entered.values()}) > 1 and \
                min(r.t_enter for r in slot.entered.values()) >= since:
            out += [d for d in find_desyncs(_Only(al, key)) if d.outcome != "pending"]
        al.retire(key)
    if len(al.slots) > max_slots:
        for key in sorted(al.slots, key=lambda k: min(r.t_enter for r in al.slots[k].entered.values()))[
                : len(al.slots) - max_slots]:
            al.retire(key)
    return out


def live_ranks(rank_pids: Mapping[int, int]) -> set[int]:
    """The ranks (of rank -> pid) whose process runs. A zombie is dead: a rank the backend aborted stays one while
    the engine's parent waits before it reaps (sglang 0.5.23 sleeps 5 s "before crash diagnostics")."""
    import psutil

    out = set()
    for k, pid in rank_pids.items():
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.add(k)
        except psutil.Error:
            pass
    return out


class LedgerProofDetector:
    """The detect stage's ledger detector (``repro.detect``): follows every rank's ledger while the burst runs and
    ends it DEADLOCKED the moment :func:`find_proof` holds, whatever the ranks' CPU; after the burst
    (:meth:`final_verdict`) turns a run whose ledgers disagree (:func:`find_desyncs`) into DESYNCED.

    On a proof it still captures every rank twice (``repro.checker.check_stall``) for the report; the verdict time
    is taken before capturing. Timings it adds (seconds): ``proof_latency_s`` (enter of the record that closed the
    proof → verdict), ``last_progress_to_verdict_s``, ``ledger_follow_cpu_s`` (this process's CPU spent following
    and proving; one ``repro.ledger_follow.shared_follower`` follows a server's ledgers across all its bursts,
    never re-reading them). ``captures`` counts its stack captures (1 once a proof's stacks were taken; the session
    adds it to the stall rule's count into the run's ``captures``, so a proven run does not say ``captures 0`` next to
    ``proof_capture_s``). Inactive when the plan's ledger is off; a rank whose ledger is missing, truncated or
    rotated out of order is left out of every proof, and the verdict's notes say so (the stall rule decides
    instead).
    """

    name = "ledger-proof"
    PROOF_EVERY_S = 0.0  # look for a proof on every poll that read something, else at most this often
    CRASH_RECORD_WAIT_S = 1.5  # after a rank died in the backend's mismatch check: how long the survivor's record may take
    MAX_SLOTS = 50_000

    def __init__(self) -> None:
        self.follower: Any = None
        self.timings: dict[str, float] = {}
        self.proof: Optional[Proof] = None
        self.desyncs: list[Desync] = []
        self.cpu_s = 0.0
        self.since = 0.0
        self.fallback_said = False
        self._last_proof_t = 0.0
        self.rank_pids: dict[int, int] = {}
        self.server_log: Optional[Path] = None
        self.log_start = 0
        self.captures = 0  # stack captures taken (check_stall calls that returned: -proof and its -proofb)

    def start(self, ctx: Any) -> None:
        import time as _t

        from repro.ledger_follow import shared_follower

        self.__init__()
        led = (ctx.plan or {}).get("ledger") or {}
        if not led.get("enabled") or ctx.injector_dir is None:
            return
        self.rank_pids = dict(ctx.rank_pids)
        self.since = ctx.t_burst or _t.time()
        self.server_log = Layout.SERVER_LOG.at(Path(ctx.injector_dir).parent)
        try:  # a crash's message counts only if this burst's server wrote it (a hunt session's log is appended)
            self.log_start = self.server_log.stat().st_size
        except OSError:
            self.log_start = 0
        c0 = _t.thread_time()
        # the server's ledgers are followed for its whole life: this burst reads on from where the last one stopped
        self.follower = shared_follower(Path(ctx.injector_dir), self.rank_pids)
        self.follower.poll()
        self._judge_slots()
        self.cpu_s += _t.thread_time() - c0

    def _alive(self) -> set[int]:
        return live_ranks(self.rank_pids)

    def _judge_slots(self) -> None:
        """Retire slots every member entered and left; keep the desyncs among them (entered after ``since``)."""
        self.desyncs += judge_slots(self.follower.alignment, self.since, self.MAX_SLOTS)

    def poll(self, ctx: Any) -> Optional[Any]:
        import time as _t

        from repro.detect import Detection

        if self.follower is None or self.proof is not None:
            return None
        c0 = _t.thread_time()
        n = self.follower.poll()
        if n:
            self._judge_slots()
        proof = None
        if n or ctx.now - self._last_proof_t >= 1.0:
            self._last_proof_t = ctx.now
            proof = find_proof(self.follower.alignment, self._alive())
        self.cpu_s += _t.thread_time() - c0
        self.timings["ledger_follow_cpu_s"] = self.cpu_s
        if proof is None:
            fb = self.follower.alignment.fallback_reasons()
            if fb and not self.fallback_said and (ctx.now - (ctx.t_burst or ctx.now)) > 1.0:
                self.fallback_said = True
                why = "ledger proof unavailable, the stall rule decides: " + "; ".join(fb)
                return Detection(self.name, False, reason=why, record={"fallback": fb, "time": ctx.now})
            return None
        t_dec = _t.time()
        self.proof = proof
        self.timings["proof_latency_s"] = t_dec - proof.closing.t_enter
        st = ctx.state
        last = getattr(st, "last_progress_t", None) or ctx.t_burst
        self.timings["last_progress_to_verdict_s"] = t_dec - last
        ctx.emit("proof", {"proof": proof.to_dict()})
        analysis, cap = None, {}
        try:  # stacks for the report; the verdict does not depend on them
            chk = self.capture(ctx)
            self.captures += 1
            analysis = chk.second_analysis
            cap = {"stall_rule_would_say": chk.judgement.reason, "stall_rule_deadlocked": chk.judgement.deadlocked,
                   "cpu_percent": {str(k): round(v, 1) for k, v in chk.cpu_percent.items()}}
        except Exception as e:  # noqa: BLE001 - a failed capture must not cost the proven verdict
            cap = {"capture_error": f"{type(e).__name__}: {e}"}
        self.timings["proof_capture_s"] = _t.time() - t_dec
        v = Verdict(DEADLOCKED, proof.summary, tuple(proof.note_lines()), proof=proof.to_dict())
        record = {"detector": self.name, "deadlocked": True, "reason": proof.summary, "time": t_dec,
                  "proof_latency_s": round(self.timings["proof_latency_s"], 3), **cap}
        return Detection(self.name, True, v, analysis, proof.summary, record, {Layout.PROOF: proof.to_dict()})

    def capture(self, ctx: Any) -> Any:
        """The stacks of every rank once the proof holds (``stacks/rank<k>-proof.txt``), for the report: a
        ``repro.checker.StallCheck`` (``repro.multihost``'s detector captures on the ranks' hosts instead)."""
        from repro.checker import check_stall

        return check_stall(ctx.rank_pids, ctx.run_dir.stacks_dir, list(ctx.expected_ranks), tag="-proof",
                           native=ctx.native, injector_dir=ctx.injector_dir,
                           fallback_signal=(ctx.plan or {}).get("faulthandler_signal"))

    def stop(self, ctx: Any) -> None:
        pass

    def final_verdict(self, verdict: Verdict, ctx: Any = None) -> Verdict:
        """The run's verdict after the ledgers had their say (``repro.verdict.combine_with_ledger``), with the
        fallback stated in a note when the ledger could not be used for some rank."""
        import time as _t

        if self.follower is None:
            return verdict
        try:
            c0 = _t.thread_time()
            self.follower.poll()
            self._judge_slots()
            al = self.follower.alignment
            pending = [d for d in find_desyncs(al, self._alive(), include_pending=True)
                       if min(r.t_enter for r in d.records.values()) >= self.since]
            self.cpu_s += _t.thread_time() - c0
            self.timings["ledger_follow_cpu_s"] = self.cpu_s
            found = self.desyncs + [d for d in pending if (d.group, d.seq) not in {(x.group, x.seq) for x in self.desyncs}]
            if not found and self.server_log is not None:
                text = _log_tail(self.server_log, self.log_start)
                crash = _crash_from_log_text(al, self._alive(), text)
                # the survivor's record of the collective the dead rank aborted in is written when its own call
                # fails (connection reset, tens of ms after the peer's abort; the injector writes it before the
                # exception returns): a death seen sooner than that waits for it, boundedly (one log read per poll)
                deadline = _t.monotonic() + self.CRASH_RECORD_WAIT_S
                while (crash is None and _t.monotonic() < deadline and self._alive() != set(self.rank_pids)
                       and _mismatch_line(text) is not None):
                    _t.sleep(0.05)
                    self.follower.poll()
                    text = _log_tail(self.server_log, self.log_start)
                    crash = _crash_from_log_text(al, self._alive(), text)
                found = [crash] if crash is not None else []
            fb = al.fallback_reasons()
        finally:
            if not self._alive():  # the server is gone: nothing more to follow
                self.follower.close()
        out = verdict
        if found and verdict.verdict != DEADLOCKED:
            d = found[0]
            more = [f"also: {x.summary}" for x in found[1:4]]
            out = combine_with_ledger(verdict, Verdict(DESYNCED, d.summary, tuple(more), desync=d.to_dict()))
        if fb and self.proof is None:
            out = Verdict(out.verdict, out.reason, (*out.notes, "ledger proof unavailable for part of the run, the "
                                                    "stall rule decided: " + "; ".join(fb)), out.proof, out.desync)
        return out


GLOO_MISMATCH_MARKERS = ("doesn't match expected size", "collective mismatch")


def _log_tail(server_log: Path, start: int = 0, limit: int = 200_000) -> Optional[str]:
    """What the server log holds from byte ``start`` on (at most its last ``limit`` bytes); None if unreadable."""
    try:
        with open(server_log, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(start, size - limit) if size >= start else max(0, size - limit))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return None


def _mismatch_line(text: Optional[str]) -> Optional[str]:
    """The first line of a server log's text carrying a backend's collective-mismatch message
    (:data:`GLOO_MISMATCH_MARKERS`), stripped; None if there is none (or no text)."""
    if not text:
        return None
    return next((ln.strip() for ln in text.splitlines() if any(m in ln for m in GLOO_MISMATCH_MARKERS)), None)


def crash_desync(al: LiveAlignment, alive: Iterable[int], server_log: Path, log_start: int = 0) -> Optional[Desync]:
    """A rank that aborted in the backend's own mismatch check before its ledger record reached disk.

    gloo aborts the process (``terminate … gloo::EnforceNotMet … Received data size doesn't match expected size. Is
    there a distributed collective mismatch in your code?``) within microseconds of the mismatched call, before the
    ledger wrote it (the ticking thread writes at each tick, the writer thread 100-250 ms after the last write).
    Then the ledger shows a survivor inside (or raised out of) collective (g, n), a dead member of g that never
    reached n, and the server log carries gloo's message: that is a desync the
    backend crashed on. None unless all three hold. ``log_start``: read the log from this byte on (what this server
    wrote during this burst: a hunt session's log is appended across servers).
    """
    if not [k for k in al.ranks if k not in set(alive)]:
        return None  # the log is read only when a rank is dead
    return _crash_from_log_text(al, alive, _log_tail(server_log, log_start))


def _crash_from_log_text(al: LiveAlignment, alive: Iterable[int], text: Optional[str]) -> Optional[Desync]:
    """:func:`crash_desync` on the server log's text already read (``text``: from the burst's start; None: unreadable)."""
    dead = [k for k in al.ranks if k not in set(alive)]
    if not dead:
        return None
    line = _mismatch_line(text)
    if line is None:
        return None
    for (g, n), slot in sorted(al.slots.items(), key=lambda kv: -max(r.t_enter for r in kv[1].entered.values())):
        members = al.members(g)
        gone = [d for d in dead if d in members and d not in slot.entered and al.usable(d)
                and al.ranks[d].knows_group(g) and al.ranks[d].seq_on(g) < n]
        if not gone:
            continue
        recs = dict(slot.entered)
        k, r = sorted(recs.items())[0]
        summary = (f"Ledger desync at {_label(al, g)} #{n}: rank {k} entered {_where(r, al)} {list(r.shapes)} "
                   f"{','.join(r.dtypes)}; rank(s) {','.join(map(str, gone))} aborted in the backend's own mismatch "
                   f"check before its record of #{n} reached disk (server log: {line[:200]}).")
        return Desync(g, _label(al, g), n, recs, ("shapes",) if "size" in line else (), "crashed", "crash", summary)
    return None


class _Only:
    """A view of one slot of an alignment (for :func:`find_desyncs` on a slot being retired)."""

    def __init__(self, al: LiveAlignment, key: tuple[str, int]) -> None:
        self._al = al
        self.slots = {key: al.slots[key]}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._al, name)


__all__ = ["LedgerProofDetector", "PairingTable", "PairingError", "Side", "features", "table_for", "WaitEdge", "Proof", "Desync",
           "find_proof", "find_desyncs", "crash_desync", "live_ranks", "judge_slots", "numel", "WAIT_OPS"]
