"""``repro reproduce``: from the stacks of a hung server to a scenario that hangs the same way on purpose.

Three steps, each usable alone:

1. :func:`signature` — what a hang looks like, independent of rank ids, pids and line numbers: the ranks grouped by
   identical reading, each group's state (collective / idle-wait / busy), normalised op (``all_reduce``…) and the
   first :data:`SIGNATURE_FRAMES` non-communication frames of its chain as ``module:qualname`` (injector and ledger
   frames ignored, so a reproduction's injected wrapper does not change it). Two hangs have the same signature iff
   these multisets (one entry per rank) are equal.
2. :func:`plan` — candidate variants read off the dump, mapped onto the target's source in the TARGET interpreter
   (``repro/reproduce_src.py``, standard library only, never importing the engine): an *extra collective* on the odd
   rank(s) at the call their innermost non-communication frame was making (gated ``called_from`` its callers and
   ``inside_loop`` where the source shows that call inside a ``for`` loop), the mirror *skipped collective* on the
   other ranks, and *root-cause* candidates from discovery's rank-local decision points (``repro.discover``) whose
   caller is on the odd rank's path, each with the hunt's perturbations.
3. :func:`scenario_text` — a scenario file ``repro sites`` / ``repro run`` accept (the hunt's TOML writer).

Bad input (:class:`ReproduceInputError`, exit 2, nothing launched): ranks that agree, a single rank, a busy rank, a
dump without Python frames, an engine without an adapter.

Checked against sglang 0.5.23 (``srt/managers/scheduler.py``, ``srt/mem_cache/unified_radix_cache.py``) on the CPU
testbed.
"""

from __future__ import annotations

import fnmatch
import json
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from repro.analysis import Analysis, analyze, load_captures, select_thread
from repro.frames import _is_bootstrap, _is_noise, comm_layer, idle_kind, is_injector_frame, is_ledger_frame
from repro.evidence import EvidenceDir, Layout
from repro.readers.types import Frame, RankCapture

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SIGNATURE_FRAMES = 3
LOOP_SEARCH_FRAMES = 6  # callers looked through for a `for` loop around the chain's call
SRC_SCRIPT = Path(__file__).resolve().parent / "reproduce_src.py"
SRC_TIMEOUT_S = 120.0
RULES_NAME = "reproduce_rules.toml"

# exit codes of `repro reproduce` (beside 0-8, 130, 143 of the other verbs; see README.md)
EXIT_REPRODUCED = 10
EXIT_DIFFERENT_HANG = 11
EXIT_NOT_REPRODUCED = 12
EXIT_WRITTEN = 0  # candidates written, nothing run


class ReproduceInputError(ValueError):
    """The dumps cannot be reproduced (one line: what was read, why not, what to give instead)."""


# ------------------------------------------------------------------------------------------------ signature
def _module_of(f: Frame) -> str:
    """The file's module name, last dotted part only (``scheduler`` for ``sglang/srt/managers/scheduler.py`` and for
    py-spy's shortened ``scheduler.py``): dumps shorten paths differently, the qualname carries the rest."""
    base = f.basename
    return base[:-3] if base.endswith(".py") else base


def _is_comm(f: Frame) -> bool:
    return comm_layer(f) not in (None, "native") or idle_kind(f) is not None


def chain_frames(c: RankCapture) -> tuple[Optional[str], Optional[str], list[Frame]]:
    """The deciding thread of a rank (``repro.analysis.select_thread``): ``(state, op, frames)`` with ``frames`` the
    Python frames from the call site outwards, communication/wait layers, decorator wrappers, bootstrap, injector and
    ledger frames left out. ``(None, None, [])`` when the rank has no readable thread."""
    t, r, _ = select_thread(c.threads)
    if t is None or r is None:
        return None, None, []
    frames = list(t.frames)
    start = 0
    if r.blocked_frame is not None:
        start = next((i for i, f in enumerate(frames) if f == r.blocked_frame), 0)
    out = []
    for f in frames[start:]:
        if f.native or _is_noise(f) or _is_bootstrap(f) or is_injector_frame(f) or is_ledger_frame(f) or _is_comm(f):
            continue
        out.append(f)
    return r.state, r.op, out


@dataclass(frozen=True)
class GroupKey:
    """One group's contribution to a signature: state, op, first frames (``module:qualname``)."""

    state: str
    op: Optional[str]
    frames: tuple[str, ...]

    def text(self) -> str:
        what = self.op if self.state == "collective" else self.state
        return f"{what} ← {' ← '.join(self.frames) or '?'}"


@dataclass(frozen=True)
class Signature:
    """The shape of a hang: a multiset of :class:`GroupKey`, one per rank (``entries``: key → number of ranks).

    ``by_rank``: rank → key (for the reports; rank ids are not part of equality)."""

    entries: tuple[tuple[GroupKey, int], ...]
    by_rank: tuple[tuple[int, GroupKey], ...] = field(default=(), compare=False)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Signature) and Counter(dict(self.entries)) == Counter(dict(other.entries))

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.entries, key=repr)))

    def groups(self) -> list[tuple[GroupKey, list[int]]]:
        """Groups with their ranks, largest first."""
        out: dict[GroupKey, list[int]] = {}
        for r, k in self.by_rank:
            out.setdefault(k, []).append(r)
        return sorted(out.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))

    def lines(self) -> list[str]:
        return [f"{len(rs)}× {k.text()}  (rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))})"
                for k, rs in self.groups()]

    def to_json(self) -> list[dict]:
        return [{"ranks": rs, "state": k.state, "op": k.op, "frames": list(k.frames)} for k, rs in self.groups()]


def frame_key(f: Frame) -> str:
    """``module:qualname`` of a frame (module: see :func:`_module_of`)."""
    return f"{_module_of(f)}:{f.function}"


def signature(analysis: Analysis, captures: Sequence[RankCapture]) -> Signature:
    """The signature of one capture of every rank.

    Args:
        analysis: ``repro.analysis.analyze(captures)`` (its states and normalised ops are used).
        captures: the same captures (their frames give the chains).
    """
    caps = {c.rank: c for c in captures if c.rank is not None}
    per: list[tuple[int, GroupKey]] = []
    for s in analysis.ranks:
        c = caps.get(s.rank)
        frames = chain_frames(c)[2] if c is not None else []
        per.append((s.rank, GroupKey(s.state, s.op if s.state == "collective" else None,
                                     tuple(frame_key(f) for f in frames[:SIGNATURE_FRAMES]))))
    return Signature(tuple(Counter(k for _, k in per).items()), tuple(per))


# ------------------------------------------------------------------------------------------------ bad input
def _engine_of(captures: Sequence[RankCapture]) -> Optional[str]:
    from repro.readers.titles import identify_title

    for c in captures:
        if c.title:
            info = identify_title(c.title)
            if info is not None and info.engine:
                return info.engine
    return None


def check_input(analysis: Analysis, captures: Sequence[RankCapture], adapter: Optional[str] = None) -> str:
    """Refuse dumps that cannot be reproduced; return the engine's adapter name.

    Raises:
        ReproduceInputError: no rank's stack readable (the line ``repro analyze`` gives); one rank only; a rank without Python frames (a native-only or unreadable dump); a busy
            rank; ranks that agree; an engine no registered adapter knows.
    """
    from repro.targets.registry import all_adapters

    src = ", ".join(sorted({c.source.split(", block ")[0] for c in captures if c.source})) or "the dumps"
    nothing = analysis.unreadable(src)
    if nothing is not None:  # binary, empty or junk files: nothing was read (not "one rank", issue 29 item 5)
        raise ReproduceInputError(nothing)
    if len(captures) < 2:
        read = "no rank dump was read" if not captures else "only one rank's dump was read"
        raise ReproduceInputError(f"{src}: {read}; a reproduction needs every rank of the TP "
                                  "group (one dump per rank, or a file holding them all)")
    for c in captures:
        if not any(not f.native for t in c.threads for f in t.frames):
            why = (c.error or "only native frames").split("; ")[0][:160]
            raise ReproduceInputError(f"{c.source or src}: rank {c.rank} has no Python frames ({why}); capture the "
                                      "ranks with py-spy dump (or faulthandler) so the call chain shows")
    engine = _engine_of(captures)
    known = all_adapters()
    if engine is not None and engine not in known:
        raise ReproduceInputError(f"{src}: the process titles are {engine}'s, and no adapter is registered for it "
                                  f"(known: {', '.join(sorted(known))}); add one in repro/targets/ (docs/adapters.md)")
    if analysis.busy_ranks:
        raise ReproduceInputError(f"{src}: rank{'s' if len(analysis.busy_ranks) > 1 else ''} "
                                  f"{','.join(map(str, analysis.busy_ranks))} busy (on CPU, not blocked): not a hang "
                                  "to reproduce yet; capture again when every rank is blocked (repro watch does)")
    if not analysis.diverged:
        raise ReproduceInputError(f"{src}: the ranks agree ({analysis.reason or 'same place'}): nothing to "
                                  "reproduce; a collective-desync hang has ranks blocked at different places")
    from repro.targets.registry import DEFAULT_ADAPTER

    return adapter or engine or DEFAULT_ADAPTER  # neither --base nor a title names one: assumed (the notes say so)


# ------------------------------------------------------------------------------------------------ source mapping
def map_frames(python: str, package: str, frames: Sequence[Frame], timeout_s: float = SRC_TIMEOUT_S) -> list[dict]:
    """Map frames to the engine's source in ``python`` (see ``repro/reproduce_src.py`` for the answer's shape).

    Raises:
        ReproduceInputError: the interpreter failed or timed out (the message names it).
    """
    payload = json.dumps([{"file": f.module_or_file, "function": f.function, "line": f.line} for f in frames])
    try:
        p = subprocess.run([python, str(SRC_SCRIPT), package], input=payload, capture_output=True, text=True,
                           timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ReproduceInputError(f"{python}: could not map the frames to {package}'s source ({e})") from None
    for line in p.stdout.splitlines():
        if line.startswith("REPRO-SRC "):
            return json.loads(line[len("REPRO-SRC "):])
    tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no answer"]
    raise ReproduceInputError(f"{python}: could not map the frames to {package}'s source: {tail[0]}")


# ------------------------------------------------------------------------------------------------ rules (data)
def rules_path(adapter: Any) -> Path:
    """The adapter's reproduce rules (the run's adapter, or a registered name): ``reproduce_rules.toml`` next to its
    hunt catalogue."""
    if isinstance(adapter, str):
        from repro.targets.registry import get_adapter

        adapter = get_adapter(adapter)
    if not adapter.hunt_catalogue:
        raise ReproduceInputError(f"adapter {adapter.name!r} has no hunt catalogue, so no {RULES_NAME} beside it")
    return Path(adapter.hunt_catalogue).parent / RULES_NAME


def load_rules(path: Path) -> dict:
    """Read the reproduce rules (``scenarios/sglang/reproduce_rules.toml``: package, groups by class, server hints)."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ReproduceInputError(f"{path}: cannot read the reproduce rules ({e})") from None


# ------------------------------------------------------------------------------------------------ candidates
@dataclass
class Candidate:
    """One variant to try: name, kind (``extra_collective`` / ``skipped_collective`` / ``root_cause``), what it
    says, its injections (scenario dicts), and the words on how it was read off the dump."""

    name: str
    kind: str
    description: str
    injections: list[dict]
    notes: list[str] = field(default_factory=list)


@dataclass
class Plan:
    """What :func:`plan` proposes: the candidates, the server it guessed (``server_args``, ``server_says``), version
    drift in words (``drift``), the odd ranks used per side (``sides``)."""

    candidates: list[Candidate]
    server_args: list[str]
    server_says: list[str]
    drift: list[str]
    needs_base: list[str]
    adapter: str
    tp_size: int

    def to_json(self) -> dict:
        return {"adapter": self.adapter, "tp_size": self.tp_size, "server_args": self.server_args,
                "server_says": self.server_says, "drift": self.drift, "needs_base": self.needs_base,
                "candidates": [{"name": c.name, "kind": c.kind, "description": c.description,
                                "injections": c.injections, "notes": c.notes} for c in self.candidates]}


def _pattern(m: dict, f: Frame) -> str:
    return f"{m['module']}:{m['qualname']}" if m.get("module") else f"*:{f.function}"


def _group_for(rules: dict, qualname: str, call: Optional[dict]) -> dict:
    """The action's group: the call's own ``group=self.X``, else the rules' default for the class (first glob
    that matches the site's qualname), else the rules' ``default_group``."""
    if call and call.get("group"):
        return {"group": call["group"]}
    for g in rules.get("groups") or []:
        if fnmatch.fnmatchcase(qualname, g.get("site", "")):
            return {k: g[k] for k in ("group", "method") if g.get(k)}
    return {"group": rules["default_group"]} if rules.get("default_group") else {}


def _sides(analysis: Analysis) -> list[tuple[list[int], list[int]]]:
    """(odd ranks, other ranks) pairs: the odd ranks of the analysis, or each side of an even split."""
    all_ranks = [s.rank for s in analysis.ranks]
    if analysis.odd_ranks:
        return [(analysis.odd_ranks, [r for r in all_ranks if r not in analysis.odd_ranks])]
    judged = [g for g in analysis.groups if g.state != "busy"]
    out = []
    for g in judged[:2]:
        out.append((sorted(g.ranks), [r for r in all_ranks if r not in g.ranks]))
    return out


def _symptom(side: str, odd: list[int], others: list[int], frames: list[Frame], maps: list[dict], op: Optional[str],
             rules: dict, drift: list[str]) -> list[Candidate]:
    """The extra collective on ``odd`` and its mirror (skipped collective on ``others``) at the call the innermost
    frame was making (see the module docstring)."""
    if not frames:
        return []
    m0, f0 = maps[0], frames[0]
    if not m0.get("module"):
        near = ", ".join(m0.get("nearest") or []) or "none close"
        drift.append(f"{frame_key(f0)} ({f0.module_or_file}) is not in this version's engine"
                     f"{'' if m0.get('file_found') else ' (no such file)'}; nearest names: {near}")
        return []
    call = m0.get("call") or {}
    op = op if op and op not in ("wait",) else "all_reduce"
    if call.get("collective"):
        # the innermost frame issues the collective itself: fire one more on entry to it, gated on its callers
        site = f"{m0['module']}:{m0['qualname']}"
        action: dict = {"kind": "extra_collective", "op": op}
        short = m0["qualname"].rsplit(".", 1)[-1]
        if call.get("self_method") and not call.get("group"):
            action["method"] = call["name"]
        elif any(w in short.lower() for w in ("all_reduce", "broadcast", "all_gather")) and not call.get("group"):
            action.update(_group_for(rules, m0["qualname"], None))
        else:
            action.update(_group_for(rules, m0["qualname"], call))
        callers = list(zip(frames[1:3], maps[1:3]))
        where = f"at entry to {m0['qualname']}"
    else:
        if not call.get("name"):
            drift.append(f"in this version {m0['qualname']} has no call at line {f0.line}; the dump's line is from "
                         "another version")
            return []
        # the frame's line calls a function that (in this version) issues no collective itself: the divergence is
        # at that call: fire on entry to the callee, gated on the frame and its caller
        cls = m0["qualname"].rsplit(".", 1)[0] if "." in m0["qualname"] else ""
        if call.get("self_method") and cls:
            site = f"{m0['module']}:{cls}.{call['name']}"
        else:
            site = f"*:*.{call['name']}"
        drift.append(f"in this version {m0['qualname']} (line {f0.line}) calls {call.get('full') or call['name']}, "
                     f"which issues no collective there; the extra {op} is made on entry to {call['name']}")
        action = {"kind": "extra_collective", "op": op, **_group_for(rules, site.split(":", 1)[1], None)}
        callers = list(zip(frames[0:2], maps[0:2]))
        where = f"before {call['name']} from {m0['qualname']}"
    if "method" in action:
        action.pop("group", None)
    if "method" not in action and "group" not in action:
        drift.append(f"no process group is known on {site.split(':', 1)[1].rsplit('.', 1)[0]} for an extra {op} "
                     f"there: add a [[groups]] rule for it to the adapter's {RULES_NAME}, or write the variant by hand")
        return []
    start = frames.index(callers[0][0]) if callers else len(frames)
    if callers and not any(m.get("loop_var") for _, m in callers):
        # the loop that repeats the call may sit a few callers further out (the #30760 waiting-queue loop)
        extra = next(((f, m) for f, m in zip(frames[start + len(callers):start + LOOP_SEARCH_FRAMES],
                                              maps[start + len(callers):start + LOOP_SEARCH_FRAMES])
                      if m.get("loop_var")), None)
        if extra is not None:
            callers.append(extra)
    loop_i = next((i for i, (_, m) in enumerate(callers) if m.get("loop_var")), None)
    called_from = [_pattern(m, f) for f, m in callers]
    gate: dict = {}
    if loop_i is not None:
        called_from.insert(0, called_from.pop(loop_i))
        gate["called_from"] = called_from
        gate["inside_loop"] = callers[loop_i][1]["loop_var"]
    elif called_from:
        gate["called_from"] = called_from
    if "*" in site.split(":", 1)[0]:
        return []  # a site must name its module (repro.scenario); without one the callee's class is unknown
    out = [Candidate(f"extra_collective{side}", "extra_collective",
                     f"rank{'s' if len(odd) > 1 else ''} {','.join(map(str, odd))}: one extra {op} {where}",
                     [{"id": f"extra_{op}{side}", "site": site, "action": action,
                       "gate": {**gate, "ranks": odd, "occurrence": {"mode": "first"}}}])]
    if others and call.get("collective") and call.get("self_method") and "." in m0["qualname"]:
        callee = f"{m0['module']}:{m0['qualname'].rsplit('.', 1)[0]}.{call['name']}"
        mgate = {"called_from": [f"{m0['module']}:{m0['qualname']}"] + called_from[:1]}
        out.append(Candidate(f"skipped_collective{side}", "skipped_collective",
                             f"rank{'s' if len(others) > 1 else ''} {','.join(map(str, others))}: {call['name']} "
                             f"skipped once in {m0['qualname']} (the mirror image)",
                             [{"id": f"skip_{call['name']}{side}", "site": callee, "action": {"kind": "skip"},
                               "gate": {**mgate, "ranks": others, "occurrence": {"mode": "first"}}}]))
    return out


def _root_causes(side: str, odd: list[int], others: list[int], maps: list[dict], points: Sequence[Any],
                 perturbations: dict, limit: int) -> list[Candidate]:
    """Discovery's decision points whose caller is on the odd rank's path, each × its perturbations.

    The perturbation goes to the OTHER ranks: the odd rank is the one still inside the caller's loop, issuing the
    collective its peers no longer reach because their own reading (a free-slot count, a poll) made them leave
    early (sglang#30760: the peers' ``get_num_allocatable_reqs`` said the batch is full). With TP=2 either choice
    gives the same signature (rank ids are not part of it)."""
    path = {f"{m['module']}:{m['qualname']}": m for m in maps if m.get("module")}
    out: list[Candidate] = []
    for p in points:
        if p.caller not in path:
            continue
        m = path[p.caller]
        if p.loop_var and m.get("loop_var") not in (p.loop_var, None):
            continue
        for pname in p.perturbations:
            pert = perturbations.get(pname)
            if pert is None or getattr(pert, "by_construction", False):
                continue
            who = others or odd
            gate: dict = {"called_from": [p.caller], "ranks": who, "occurrence": {"mode": "first"}}
            if p.loop_var:
                gate["inside_loop"] = p.loop_var
            name = f"root_{p.site.rsplit('.', 1)[-1]}_{pname}{side}"
            out.append(Candidate(name, "root_cause",
                                 f"rank{'s' if len(who) > 1 else ''} {','.join(map(str, who))}: "
                                 f"{p.site.split(':', 1)[1]} {pert.says} in {p.caller.split(':', 1)[1]}"
                                 + (f" inside `for {p.loop_var}`" if p.loop_var else ""),
                                 [{"id": name, "site": [p.site, *p.family], "action": dict(pert.action), "gate": gate}],
                                 [p.what]))
            if len(out) >= limit:
                return out
    return out


def server_guess(rules: dict, maps: Sequence[dict], frame_keys: Sequence[str] = ()) -> tuple[list[str], list[str], list[str]]:
    """``(args, what was guessed, what only --base can say)`` from the rules' ``[[server_hints]]``: a hint applies
    when one of its ``frames`` globs matches a mapped ``module:qualname`` or a dump frame's :func:`frame_key`
    (``hiradix_cache:HiRadixCache.check_prefetch_progress``: a file this version may no longer have)."""
    names = [f"{m['module']}:{m['qualname']}" for m in maps if m.get("module")] + list(frame_keys)
    args: list[str] = []
    says: list[str] = []
    needs: list[str] = []
    for h in rules.get("server_hints") or []:
        if any(fnmatch.fnmatchcase(n, g) for n in names for g in h.get("frames", [])):
            for a in h.get("args", []):
                if a not in args:
                    args.append(a)
            says.append(f"{h.get('name', 'hint')}: {' '.join(h.get('args', []))} (frames {', '.join(h.get('frames', []))})")
            if h.get("needs_base"):
                needs.append(h["needs_base"])
    return args, says, needs


def plan(analysis: Analysis, captures: Sequence[RankCapture], python: str, adapter: str, rules: dict, *,
         points: Sequence[Any] = (), perturbations: Optional[dict] = None, root_limit: int = 4) -> Plan:
    """Candidate variants for one diverged capture (see the module docstring).

    Args:
        python: the target interpreter (frames are mapped to its engine's source).
        points: discovery's points (``repro.discover.discover(...).points``); empty: no root-cause candidates.
        perturbations: the hunt catalogue's perturbations by name (``repro.catalogue.load_catalogue(...).perturbations``).
    Raises:
        ReproduceInputError: the frames could not be mapped (interpreter failed).
    """
    caps = {c.rank: c for c in captures}
    states = {s.rank: s for s in analysis.ranks}
    cands: list[Candidate] = []
    drift: list[str] = []
    all_maps: list[dict] = []
    all_keys: list[str] = []
    sides = _sides(analysis)
    for i, (odd, others) in enumerate(sides):
        suffix = "" if len(sides) == 1 else f"_r{'-'.join(map(str, odd))}"
        _, op, frames = chain_frames(caps[odd[0]])
        frames = frames[:8]
        maps = map_frames(python, rules.get("package", adapter), frames) if frames else []
        all_maps += maps
        all_keys += [frame_key(f) for f in frames]
        for f, m in zip(frames, maps):
            if not m.get("module") and m is not maps[0]:
                drift.append(f"{frame_key(f)} is not in this version's engine; nearest names: "
                             f"{', '.join(m.get('nearest') or []) or 'none close'}")
        cands += _symptom(suffix, odd, others, frames, maps, states[odd[0]].op or op, rules, drift)
        cands += _root_causes(suffix, odd, others, maps, points, perturbations or {}, root_limit)
    args, says, needs = server_guess(rules, all_maps, all_keys)
    seen: set = set()
    uniq = []
    for c in cands:
        if c.name not in seen:
            seen.add(c.name)
            uniq.append(c)
    return Plan(uniq, args, says, list(dict.fromkeys(drift)), needs, adapter, max(len(analysis.ranks), 1))


# ------------------------------------------------------------------------------------------------ scenario file
def scenario_text(p: Plan, base: Any, source: str, model: str = "", release: str = "") -> str:
    """A scenario file (``repro.scenario_toml.scenario_toml``) with one variant per candidate and the base's server, or the
    adapter's defaults plus the guessed flags when ``base`` is None; ``release``: which release and why (a comment)."""
    from repro.scenario_toml import scenario_toml
    from repro.scenario import Scenario

    if base is None:
        base = Scenario.model_validate({
            "name": "reproduce", "description": "written by repro reproduce", "stall_s": 10, "budget_s": 120,
            "server": {"adapter": p.adapter, "tp_size": p.tp_size, "args": p.server_args, "model": model},
            "burst": {"requests": 8, "concurrency": 8, "max_new_tokens": 4, "input_len": 64},
            "variants": [{"name": "placeholder", "expect": "deadlock", "injections": []}]})
    comment = (f"Written by `repro reproduce` from {source}.\n" + (f"release: {release}\n" if release else "")
               + "".join(f"server guess: {s}\n" for s in p.server_says)
               + "".join(f"version drift: {d}\n" for d in p.drift)
               + "Run: repro run <this file> --variant <name>   (each candidate expects DEADLOCKED)")
    variants = [(c.name, "deadlock", c.description, c.injections) for c in p.candidates]
    return scenario_toml(base, "reproduce_" + Path(source).name.replace(".", "_")[:40] if source else "reproduce",
                         "repro reproduce candidates: " + "; ".join(c.description for c in p.candidates),
                         variants, comment=comment)


def read_dumps(paths: Sequence[str]) -> tuple[Analysis, list[RankCapture]]:
    """``repro analyze``'s reading of the dumps: (analysis, captures)."""
    caps = load_captures(paths)
    return analyze(caps), caps


@dataclass
class Written:
    """What :func:`write_candidates` produced: the scenario file, the original's signature, the plan, the
    interpreter used and discovery's state in words."""

    scenario_file: Path
    signature: Signature
    plan: Plan
    python: str
    notes: list[str]
    release: Optional[Any] = None  # the repro.releases.ReleaseChoice: which release and why

    def to_json(self) -> dict:
        return {"scenario": str(self.scenario_file), "signature": self.signature.to_json(), "python": self.python,
                "notes": self.notes, "release": self.release.to_json() if self.release else None, **self.plan.to_json()}


def write_candidates(paths: Sequence[str], out_dir: Path, *, base_path: Optional[Path] = None,
                     python: Optional[str] = None, tp: Optional[int] = None, model: Optional[str] = None,
                     use_discovery: bool = True, release: Optional[str] = None, reports: Sequence[str] = ()) -> Written:
    """Read the dumps, refuse bad input, pick the release (``repro.reproduce_release.pick_release``: ``release``
    forced, else what ``reports`` / the dumps say, else the frames' range), map the frames onto that release's
    engine (or ``python``'s), propose candidates and write ``out_dir/reproduce.toml``.

    Nothing is launched. Bad input is refused before any interpreter is chosen.

    Raises:
        ReproduceInputError: bad dumps (see :func:`check_input`), a bad ``--base``, no target interpreter, an
            unknown release or one that is not set up (one line naming the setup command), or the written scenario
            does not validate (the message names the file and field).
    """
    from repro.releases import ReleaseError
    from repro.reproduce_release import pick_release
    from repro.analysis import AnalyzeInputError
    from repro.interpreter import InterpreterError, choose_python
    from repro.scenario import ScenarioError, load_scenario, tp_option_problem

    bad_tp = tp_option_problem(tp, 2, [("each candidate", "deadlock")])  # as `repro run --tp` checks it
    if bad_tp:
        raise ReproduceInputError(bad_tp)
    try:
        analysis, caps = read_dumps(paths)
    except AnalyzeInputError as e:
        raise ReproduceInputError(str(e)) from None
    base = None
    if base_path is not None:
        try:
            base = load_scenario(base_path)
        except ScenarioError as e:
            raise ReproduceInputError(f"--base: {e}") from None
    adapter = check_input(analysis, caps, base.server.adapter if base is not None else None)
    from repro.targets.registry import get_adapter

    engine = get_adapter(adapter)  # the dumps' engine (or --base's), resolved once and passed down
    try:
        release_py, choice = pick_release(engine, caps, paths, reports=reports, forced=release, python=python)
    except ReleaseError as e:
        raise ReproduceInputError(str(e)) from None
    try:
        py = release_py or choose_python(python, engine)
    except InterpreterError as e:
        raise ReproduceInputError(str(e)) from None
    rules = load_rules(rules_path(engine))
    notes: list[str] = []
    if base is None and _engine_of(caps) is None:
        notes.append(f"engine: {engine.name} (assumed: no process title names an engine and no --base was given; "
                     "pass --base SCENARIO whose server.adapter names it)")
    points: Sequence[Any] = ()
    perts: dict = {}
    if use_discovery:
        from repro.discover import DiscoverError, default_rules_path, discover
        from repro.catalogue import HuntError, catalogue_for, load_catalogue

        try:
            cat = load_catalogue(catalogue_for(engine))
            perts = cat.perturbations
            d = discover(py, default_rules_path(engine, cat.path), known_perturbations=list(cat.perturbations))
            points = d.points
            notes.append(f"discovery: {len(d.points)} decision points in {d.scan.get('package')}")
        except (DiscoverError, HuntError) as e:
            notes.append(f"discovery unavailable ({e}): no root-cause candidates")
    p = plan(analysis, caps, py, adapter, rules, points=points, perturbations=perts)
    if tp is not None:
        p.tp_size = tp
    if not p.candidates:
        raise ReproduceInputError("no candidate could be read off the dumps: " + ("; ".join(p.drift) or
                                  "the odd rank's frames map to nothing in this engine"))
    if base is not None:
        p.server_says.insert(0, f"server from --base {base_path}")
        p.needs_base = []
        if tp is not None:
            base = base.model_copy(update={"server": base.server.model_copy(update={"tp_size": tp})})
    if model and base is not None:
        base = base.model_copy(update={"server": base.server.model_copy(update={"model": model})})
    out_dir.mkdir(parents=True, exist_ok=True)
    text = scenario_text(p, base, ", ".join(str(x) for x in paths), model or "", choice.reason)
    f = EvidenceDir.open(out_dir).reproduce_scenario.write(text)
    try:
        load_scenario(f)
    except ScenarioError as e:  # a bug here, not the user's: say so with the file
        raise ReproduceInputError(f"{f}: the written scenario does not validate ({e})") from None
    return Written(f, signature(analysis, caps), p, py, notes, choice)


# ------------------------------------------------------------------------------------------------ running
REPRODUCED = "REPRODUCED"
DIFFERENT_HANG = "DIFFERENT HANG"
NOT_REPRODUCED = "NOT REPRODUCED"


@dataclass
class Tried:
    """One candidate run: its verdict, evidence folder, the reproduction's signature (None without a hang) and the
    outcome (:data:`REPRODUCED` / :data:`DIFFERENT_HANG` / :data:`NOT_REPRODUCED`)."""

    candidate: str
    verdict: str
    evidence: Path
    outcome: str
    signature: Optional[Signature] = None
    error: str = ""

    def to_json(self) -> dict:
        return {"candidate": self.candidate, "verdict": self.verdict, "evidence": str(self.evidence),
                "outcome": self.outcome, "signature": self.signature.to_json() if self.signature else None,
                "error": self.error}


def judge(original: Signature, verdict: str, evidence: Path) -> tuple[str, Optional[Signature], str]:
    """The outcome of one candidate run: DEADLOCKED with the original's signature → REPRODUCED; DEADLOCKED with
    another → DIFFERENT HANG; anything else (or stacks that cannot be read) → NOT REPRODUCED."""
    if verdict != "DEADLOCKED":
        return NOT_REPRODUCED, None, ""
    try:
        a, caps = read_dumps([str(evidence)])
    except Exception as e:  # the run's stacks are unreadable: the hang cannot be compared
        return NOT_REPRODUCED, None, f"its stacks could not be read ({e})"
    sig = signature(a, caps)
    return (REPRODUCED if sig == original else DIFFERENT_HANG), sig, ""


def run_candidates(w: Written, evidence_root: Path, *, python: Optional[str] = None, model: Optional[str] = None,
                   tp: Optional[int] = None, only: Sequence[str] = ()) -> list[Tried]:
    """Run the written candidates in one session, each on a fresh server (``repro.runner.run_many`` with
    ``fresh_each``: a root-cause candidate run after others found the caches warm and hung elsewhere — DIFFERENT
    HANG — where alone it REPRODUCED), and judge each against the original's signature.

    Raises:
        repro.runner.RunError: bad input before anything was launched.
        KeyboardInterrupt: after teardown.
    """
    from repro.runner import RunOptions, run_many

    names = [c.name for c in w.plan.candidates if not only or c.name in only]
    opts = RunOptions(scenario_path=w.scenario_file, python=python or w.python, model=model, tp=tp,
                      evidence_root=evidence_root, command_line=f"repro run {w.scenario_file}")
    out = []
    for name, res in zip(names, run_many(opts, names, fresh_each=True)):
        outcome, sig, err = judge(w.signature, str(res.verdict.verdict), res.evidence)
        out.append(Tried(name, str(res.verdict.verdict), res.evidence, outcome, sig, err))
    return out


def keep_winner(w: Written, tried: Sequence[Tried], out_dir: Path) -> Optional[Path]:
    """Write ``out_dir/reproducer.toml``: the written scenario's server and burst with only the first REPRODUCED
    candidate as its one variant (the scenario to keep, beside the dumps in an issue). None when nothing reproduced.

    Raises:
        ReproduceInputError: the kept file does not validate (a bug here; the message names the file).
    """
    from repro.scenario_toml import scenario_toml
    from repro.scenario import ScenarioError, load_scenario

    win = next((t for t in tried if t.outcome == REPRODUCED), None)
    c = next((c for c in w.plan.candidates if win is not None and c.name == win.candidate), None)
    if c is None:
        return None
    base = load_scenario(w.scenario_file)
    kept = EvidenceDir.open(out_dir).reproducer
    f = kept.path
    comment = (f"Kept by `repro reproduce`: candidate {c.name} ({c.kind}) hung with the dumps' signature.\n"
               + "".join(f"server guess: {x}\n" for x in w.plan.server_says)
               + f"Run: repro run {f} --expect deadlock")
    kept.write(scenario_toml(base, base.name, c.description, [(c.name, "deadlock", c.description, c.injections)],
                             comment=comment))
    try:
        load_scenario(f)
    except ScenarioError as e:
        raise ReproduceInputError(f"{f}: the kept scenario does not validate ({e})") from None
    return f


def exit_code(tried: Sequence[Tried]) -> int:
    """10 when a candidate REPRODUCED, else 11 when one made a DIFFERENT HANG, else 12."""
    outs = {t.outcome for t in tried}
    if REPRODUCED in outs:
        return EXIT_REPRODUCED
    if DIFFERENT_HANG in outs:
        return EXIT_DIFFERENT_HANG
    return EXIT_NOT_REPRODUCED


def reproduction_markdown(w: Written, tried: Sequence[Tried], source: str, seconds: float) -> str:
    """REPRODUCTION.md: outcome, the signatures side by side, every candidate's run, the scenario to keep, how to
    run it again and how to prove a fix with ``repro compare``."""
    code = exit_code(tried)
    kinds = {c.name: c for c in w.plan.candidates}
    best = next((t for t in tried if t.outcome == REPRODUCED), None) or closest_hang(w.signature, tried, kinds)
    head = {EXIT_REPRODUCED: REPRODUCED, EXIT_DIFFERENT_HANG: DIFFERENT_HANG}.get(code, NOT_REPRODUCED)
    lines = [f"# {head}", "", f"From {source}; {len(tried)} candidate(s) run in {seconds:.0f} s "
             f"(`{w.scenario_file}`, python `{w.python}`).", ""]
    if w.release is not None:
        lines += [f"Release: {w.release.reason}.", ""]
    lines += ["## Signatures", "", "| original | reproduction" + (f" ({best.candidate})" if best else "") + " |",
              "|---|---|"]
    left = w.signature.lines()
    right = best.signature.lines() if best and best.signature else []
    for i in range(max(len(left), len(right))):
        lines.append(f"| {left[i] if i < len(left) else ''} | {right[i] if i < len(right) else ''} |")
    lines += ["", "## Candidates", "", "| candidate | kind | what | verdict | outcome | evidence |", "|---|---|---|---|---|---|"]
    for t in tried:
        c = kinds.get(t.candidate)
        lines.append(f"| `{t.candidate}` | {c.kind if c else ''} | {c.description if c else ''} | {t.verdict} | "
                     f"{t.outcome}{(' — ' + t.error) if t.error else ''} | {Layout.REPORT.at(t.evidence)} |")
    others = [t for t in tried if t.outcome == DIFFERENT_HANG and t is not best and t.signature is not None]
    for t in others:  # every other hang, side by side with the original
        lines += ["", f"## {DIFFERENT_HANG}: `{t.candidate}`", "", f"| original | {t.candidate} |", "|---|---|"]
        right = t.signature.lines()
        for i in range(max(len(left), len(right))):
            lines.append(f"| {left[i] if i < len(left) else ''} | {right[i] if i < len(right) else ''} |")
    if w.plan.server_says or w.plan.drift:
        lines += ["", "## What was guessed", ""] + [f"- server: {s}" for s in w.plan.server_says] + \
                 [f"- {s}" for s in w.plan.needs_base] + [f"- version drift: {d}" for d in w.plan.drift]
    if best and best.outcome == REPRODUCED:
        kept = Layout.REPRODUCER.at(w.scenario_file.parent)
        lines += ["", "## Keep it", "", f"Scenario: `{w.scenario_file}`, variant `{best.candidate}` (alone: `{kept}`).",
                  "", f"Run again: `repro run {w.scenario_file} --variant {best.candidate}` (expects DEADLOCKED).", "",
                  f"Prove a fix: `repro compare {w.scenario_file} --variant {best.candidate} --before installed "
                  "--after patch:FIX.patch` (before DEADLOCKED, after ALL REQUESTS SUCCEEDED; a root-cause candidate "
                  "proves a fix, an extra-collective one only shows the symptom)."]
    elif best:
        c = kinds.get(best.candidate)
        shared = _shared_lines(w.signature, best)
        lines += ["", "## Closest hang (nothing reproduced)", "",
                  f"No candidate hung where the dumps did. The closest is `{best.candidate}` "
                  f"({c.kind if c else 'candidate'}; {shared} of {len(w.signature.groups())} blocked place(s) as in "
                  "the dumps): a different hang, so a fix it stops is not shown to stop the reported one.", "",
                  f"Look at it: `repro run {w.scenario_file} --variant {best.candidate}`; then check what was guessed "
                  "above (pass the server's real flags with --base) and try the root-cause candidates one at a time "
                  "(`--only NAME`)."]
    return "\n".join(lines) + "\n"


def _shared_lines(original: Signature, t: Tried) -> int:
    """How many of the original signature's places (one line each: where a set of ranks is blocked, rank ids aside)
    the candidate's hang has too."""
    if t.signature is None:
        return 0
    theirs = {k for k, _ in t.signature.groups()}
    return sum(1 for k, _ in original.groups() if k in theirs)


def closest_hang(original: Signature, tried: Sequence[Tried], kinds: dict) -> Optional[Tried]:
    """The DIFFERENT HANG nearest the dumps: most signature lines in common, then a root-cause candidate before an
    extra-collective one (the symptom), then the first run; None when no candidate hung."""
    hangs = [t for t in tried if t.outcome == DIFFERENT_HANG]
    if not hangs:
        return None
    order = {id(t): i for i, t in enumerate(tried)}
    return max(hangs, key=lambda t: (_shared_lines(original, t),
                                     getattr(kinds.get(t.candidate), "kind", "") == "root_cause", -order[id(t)]))
