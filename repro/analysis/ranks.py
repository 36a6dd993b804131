"""From captured stacks to rank states (:func:`rank_state`) and from rank states to the analysis of one capture
(:func:`analyze`): grouping, the odd rank(s) out, the reason; comparing two captures (:func:`frames_unchanged`)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

from repro.frames import (_INJECTED_SITE_RE, _NATIVE_OP_HINTS, _data_rules, _frame_rules, _is_bootstrap,
                                   _is_noise, _label, _norm_op, _python_layer_kind, comm_layer, helper_kind,
                                   idle_kind, injected_site, is_injector_frame, is_op_dispatch_frame, is_spin_wait,
                                   native_collective)
from repro.analysis.types import Analysis, RankGroup, RankState, ThreadReading
from repro.diagnosis import COLLECTIVE_OPS
from repro.stacks import Frame, RankCapture, ThreadStack


def read_thread(t: ThreadStack, max_chain: int = 8) -> ThreadReading:
    """Classify one thread: collective (op, via, layers), idle-wait (kind) or busy; find the call site.

    The call site (``blocked_frame``) is the first Python frame outside the communication / waiting layers and the
    injector, skipping decorator wrappers; ``caller_chain`` is it and its callers (function names, decorator and
    bootstrap frames left out, injector frames marked ``[injected]``), at most ``max_chain`` entries.
    """
    frames = t.frames
    if not frames:
        return ThreadReading(state="unknown")
    i = 0
    layers: list[str] = []
    native_ops: list[str] = []
    while i < len(frames) and frames[i].native:
        lay = comm_layer(frames[i])
        if lay == "native-wait":
            if "native-wait" not in layers:
                layers.append("native-wait")
            low = frames[i].function.lower()
            for hint, op in _NATIVE_OP_HINTS:
                if hint in low:
                    native_ops.append(op)
                    break
            else:
                nop = _data_rules().native_op(frames[i].function)
                if nop:
                    native_ops.append(nop)
        i += 1
    if i >= len(frames):
        if not layers and (t.active is False or any(_data_rules().is_native_idle(f.function) for f in frames[:3])):
            return ThreadReading(state="idle-wait", wait="native wait", innermost=frames[0])
        return ThreadReading(state="collective" if layers else "busy", op=native_ops[0] if native_ops else None,
                             via="native-wait" if layers else None, layers=layers, innermost=frames[0])
    # torch's op dispatch (``torch.ops._C.shm_allreduce(...)`` → ``OpOverloadPacket.__call__``) right inside a
    # communication layer is part of that layer (vLLM's CPU shm ops); anywhere else it is the caller's own work
    k = i
    while k < len(frames) and (frames[k].native or is_op_dispatch_frame(frames[k])):
        k += 1
    if k > i and k < len(frames) and comm_layer(frames[k]) not in (None, "native"):
        i = k
    innermost = frames[i]
    # collective: contiguous comm-layer frames from the innermost Python frame outwards
    j = i
    op: Optional[str] = None
    comm_frames: list[Frame] = []
    while j < len(frames):
        f = frames[j]
        lay = comm_layer(f)
        if lay == "native":
            j += 1
            continue
        if lay is None:
            break
        comm_frames.append(f)
        if lay not in layers:
            layers.append(lay)
        if op is None and _norm_op(f.function) in COLLECTIVE_OPS:
            op = _norm_op(f.function)
        elif op is None and _data_rules().op_alias(f.function):
            op = _data_rules().op_alias(f.function)
        j += 1
    if comm_frames or layers:
        if op is None:
            op = native_ops[0] if native_ops else (_norm_op(comm_frames[0].function) if comm_frames else "wait")
        outer_first = list(reversed(layers))
        via = outer_first[0]  # the outermost communication wrapper
        site_idx, chain, injected = _call_site(frames, j, max_chain)
        return ThreadReading(state="collective", op=op, via=via, layers=outer_first, innermost=innermost,
                             blocked_frame=frames[site_idx] if site_idx is not None else None,
                             caller_chain=chain, injected=injected,
                             injected_site=injected_site(frames[j:site_idx]) if injected and site_idx else None)
    kind = idle_kind(innermost)
    if kind is not None:
        j = i
        while j < len(frames) and (frames[j].native or idle_kind(frames[j]) is not None):
            kind = idle_kind(frames[j]) or kind  # the outermost wait names it (Queue.get over Condition.wait)
            j += 1
        site_idx, chain, injected = _call_site(frames, j, max_chain)
        return ThreadReading(state="idle-wait", wait=kind, innermost=innermost,
                             blocked_frame=frames[site_idx] if site_idx is not None else None,
                             caller_chain=chain, injected=injected)
    site_idx, chain, injected = _call_site(frames, i, max_chain, skip_injector=False)
    if t.active is False and not is_injector_frame(innermost):
        return ThreadReading(state="idle-wait", wait="off CPU (py-spy: idle)", innermost=innermost,
                             blocked_frame=innermost, caller_chain=chain, injected=injected)
    return ThreadReading(state="busy", innermost=innermost,
                         blocked_frame=frames[site_idx] if site_idx is not None else innermost,
                         caller_chain=chain, injected=injected or is_injector_frame(innermost))


def _call_site(frames: list[Frame], start: int, max_chain: int, skip_injector: bool = True):
    injected = False
    site: Optional[int] = None
    k = start
    while k < len(frames):
        f = frames[k]
        if f.native or _is_noise(f) or (skip_injector and is_injector_frame(f)):
            # a patched site's wrapper (``repro_injected[...]``) that passed the call through to the engine's own
            # function is not an injection: only an action frame of the injector (``Site.run`` …) issued the op
            injected = injected or (is_injector_frame(f) and not _INJECTED_SITE_RE.search(f.function))
            k += 1
            continue
        site = k
        break
    chain: list[str] = []
    in_injector = False
    for f in frames[start:]:
        if len(chain) >= max_chain:
            break
        if f.native or _is_bootstrap(f):
            continue
        if is_injector_frame(f):
            if not in_injector:  # a run of injector frames is shown once, by its innermost frame
                chain.append(_label(f))
            else:
                m = _INJECTED_SITE_RE.search(f.function)
                if m and chain:  # the run's wrapper names the patched site: show that instead
                    chain[-1] = f"[injected] at {m.group(1)}"
            in_injector = True
            continue
        in_injector = False
        if _is_noise(f):
            continue
        chain.append(f.function)
    return site, chain, injected


def select_thread(threads: Sequence[ThreadStack]) -> tuple[Optional[ThreadStack], Optional[ThreadReading], str]:
    """Pick the thread that decides a rank's state and read it; every thread is considered.

    Helper threads (:func:`helper_kind`) never stand for the rank. In order: the main thread when it is in a
    collective; else a non-helper thread that is busy (py-spy saw it on CPU, or the main thread with no flag)
    — the rank may still progress — with a note naming any thread held in a collective; else a thread in a
    collective (a background thread's collective counts, and is named); else the main thread's own state. When the
    dump has no main thread, the first non-helper thread stands in, with a note; with only helper threads the
    result is ``(None, None, note)``.
    Returns ``(thread, reading, note)``.
    """
    if not threads:
        return None, None, ""
    readings = [(t, read_thread(t)) for t in threads]
    main = next(((t, r) for t, r in readings if t.is_main), None)
    own = [(t, r) for t, r in readings if helper_kind(t) is None]
    colls = [(t, r) for t, r in own if r.state == "collective"]
    if main is not None and main[1].state == "collective":
        return main[0], main[1], ""
    busy = [(t, r) for t, r in own if r.state == "busy" and (t.active is True or (t.active is None and t.is_main))]
    if busy:
        t, r = main if main is not None and main in busy else busy[0]
        note = ""
        if colls:
            ct, cr = colls[0]
            who = "the main thread" if t.is_main else f"thread {t.name or t.thread_id}"
            note = f"thread {ct.name or ct.thread_id} is in {cr.op}, but {who} is busy"
        return t, r, note
    if colls:
        return colls[0][0], colls[0][1], ""
    if main is not None:
        return main[0], main[1], ""
    rest = [(t, r) for t, r in own if r.state != "unknown"]
    if rest:
        t, r = rest[0]
        return t, r, f"the main thread is not in this dump; read thread {t.name or t.thread_id or '(no id)'}"
    helpers = sorted({helper_kind(t) or "" for t in threads} - {""})
    return None, None, ("the main thread is not in this dump; only helper threads ("
                        + ", ".join(helpers) + ") were captured, and they never stand for the rank")


def _location_key(r: ThreadReading) -> str:
    f = r.blocked_frame
    site = f"{f.short_function}@{f.basename}:{f.line}" if f else "?"
    if r.state == "collective":
        return f"collective|{r.op}|{site}"
    if r.state == "idle-wait":
        return f"idle-wait|{r.wait}|{site}"
    if r.state == "busy":
        inner = r.innermost
        return f"busy|{inner.short_function}@{inner.basename}:{inner.line}" if inner else "busy|?"
    return "unknown"


def rank_state(c: RankCapture) -> RankState:
    """The :class:`RankState` of one capture (``unknown`` with the capture's error when no stack was read)."""
    rank = c.rank if c.rank is not None else -1
    info = dict(fmt=c.fmt, source=c.source, rank_source=c.rank_source, cpu_percent=c.cpu_percent, pid=c.pid)
    notes = list(c.notes)
    if not c.threads:
        err = c.error or ("; ".join(c.warnings[:2]) if c.warnings else "no stack captured")
        return RankState(rank=rank, state="unknown", error=err, location_key="unknown", notes=notes, **info)
    if not any(t.is_main for t in c.threads):
        notes.append("the main thread is not in this dump")
    t, r, note = select_thread(c.threads)
    if t is None or r is None:
        return RankState(rank=rank, state="unknown", error=note, location_key="unknown", notes=notes, **info)
    if note and note.startswith("the main thread is not in this dump"):
        notes = [n for n in notes if n != "the main thread is not in this dump"] + [note]
        note = ""
    backend, nop, kind = native_collective(c.threads)
    pb, pk = _python_layer_kind(c.threads)
    backend, kind = c.backend or backend or pb, c.group_kind or kind or pk
    op = r.op
    if r.state == "collective" and op in (None, "wait") and (c.op or nop):
        op = c.op or nop
    others = []
    for ot in c.threads:
        if ot is t or helper_kind(ot) is not None:
            continue
        orr = read_thread(ot)
        if orr.state == "collective":
            others.append(f"thread {ot.name or ot.thread_id}: {orr.op}")
    if r.state == "unknown":
        return RankState(rank=rank, state="unknown", error="the main thread has no frames",
                         thread=t.name or t.thread_id, location_key="unknown", notes=notes, **info)
    key = _location_key(r)
    if op != r.op and key.startswith("collective|"):
        key = key.replace(f"collective|{r.op}|", f"collective|{op}|", 1)
    return RankState(
        rank=rank, state=r.state, op=op, via=r.via, layers=r.layers, wait=r.wait,
        blocked_frame=r.blocked_frame.render() if r.blocked_frame else None, caller_chain=r.caller_chain,
        thread=t.name or t.thread_id, main_thread=t.is_main, injected=r.injected, injected_site=r.injected_site,
        error=note, location_key=key, notes=notes, other_collectives=others, backend=backend,
        group_kind=kind, spin_wait=r.state == "collective" and is_spin_wait(t), **info,
    )


def _ranks_text(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ",".join(str(r) for r in ranks)


def _is_are(ranks: Sequence[int]) -> str:
    return "is" if len(ranks) == 1 else "are"


def analyze(captures: Sequence[RankCapture]) -> Analysis:
    """Diagnose one capture of every rank.

    Args:
        captures: one :class:`RankCapture` per rank (any order; ``rank`` None entries are ignored).
    Returns:
        An :class:`Analysis`: per-rank states, groups by blocking location, odd rank(s) out, ``diverged`` and a
        one-sentence ``summary``.
    """
    caps = sorted((c for c in captures if c.rank is not None), key=lambda c: c.rank)  # type: ignore[arg-type]
    states = [rank_state(c) for c in caps]
    warnings = [w for c in caps for w in c.warnings]
    warnings += [f"rank {c.rank}: {c.notice}" for c in caps if c.notice]
    by_key: "OrderedDict[str, list[RankState]]" = OrderedDict()
    for s in states:
        if s.state != "unknown":
            by_key.setdefault(s.location_key, []).append(s)
    groups = [
        RankGroup(ranks=[s.rank for s in members], state=members[0].state, op=members[0].op, via=members[0].via,
                  wait=members[0].wait, call_site=members[0].blocked_frame, where=members[0].where())
        for members in by_key.values()
    ]
    groups.sort(key=lambda g: (-len(g.ranks), g.ranks[0]))
    busy = [s.rank for s in states if s.state == "busy"]
    unknown = [s.rank for s in states if s.state == "unknown"]
    judged = [g for g in groups if g.state != "busy"]
    in_coll = any(g.state == "collective" for g in judged)
    handshake = _idle_handshake(states, judged)
    diverged = bool(in_coll and len(judged) > 1 and not busy and not handshake)
    odd: list[int] = []
    even = False
    if diverged:
        top = len(judged[0].ranks)
        if len(judged[1].ranks) == top:
            even = True
        else:
            odd = sorted(r for g in judged[1:] for r in g.ranks)
    if handshake and not busy:
        reason = "idle: waiting for the next request"
        summary = _handshake_summary(states, unknown)
    else:
        reason = _reason(judged, busy, unknown, in_coll)
        summary = _summary(states, judged, busy, unknown, diverged, odd, even, reason)
    inputs, formats, missing, conf, why = _honesty(caps, states)
    return Analysis(ranks=states, groups=groups, odd_ranks=odd, even_split=even, diverged=diverged, reason=reason,
                    busy_ranks=busy, unknown_ranks=unknown, summary=summary, warnings=warnings, inputs=inputs,
                    formats=formats, missing=missing, confidence=conf, confidence_reasons=why)


_HAND_WRITTEN = frozenset({"condensed", "arrow-chain"})


def _honesty(caps: Sequence[RankCapture], states: Sequence[RankState]):
    """What was read, what is missing and how sure the conclusion is (see :class:`Analysis`)."""
    inputs: list[dict] = []
    for c in caps:
        inputs += [dict(i) for i in c.inputs]
    for c in caps:
        if c.source:
            inputs.append({"file": c.source, "block": 0, "format": c.fmt, "pid": c.pid, "title": c.title,
                           "kept": True, "rank": c.rank, "reason": c.rank_source or "rank given"})
    formats: dict[str, int] = {}
    for c in caps:
        if c.fmt:
            formats[c.fmt] = formats.get(c.fmt, 0) + 1
    missing: list[str] = []
    ranks = sorted(s.rank for s in states)
    why: list[str] = []
    if ranks and ranks[-1] + 1 > len(ranks):
        gone = sorted(set(range(ranks[-1] + 1)) - set(ranks))
        shown = ",".join(str(r) for r in gone[:32]) + (f",… ({len(gone)} in all)" if len(gone) > 32 else "")
        missing.append(f"{len(ranks)} of at least {ranks[-1] + 1} ranks present (missing: {shown})")
        why.append("some ranks are missing")
    for s in states:
        if s.state == "unknown":
            missing.append(f"rank {s.rank}: no readable stack ({s.error[:120]})" if s.error else
                           f"rank {s.rank}: no readable stack")
        elif any(n.startswith("the main thread is not in this dump") for n in s.notes):
            missing.append(f"rank {s.rank} has no main thread in its dump")
        if any("Python frames are absent" in n for n in s.notes):
            missing.append(f"rank {s.rank}: Python frames absent (native frames only)")
        if any(n.startswith("no stack in the watchdog's text") for n in s.notes):
            missing.append(f"rank {s.rank}: no stack (read from torch's watchdog message)")
    if len(states) == 1:
        why.append("only one rank: nothing to compare")
    if any(s.state == "unknown" for s in states):
        why.append("some ranks unreadable")
    if any(c.rank_source == "file order" for c in caps):
        why.append("some ranks numbered in file order (no rank in titles, prefixes or file names)")
    if any(c.fmt in _HAND_WRITTEN for c in caps):
        why.append("hand-written frame lists (no thread states, possibly abridged)")
    if any(any("Python frames are absent" in n for n in s.notes) for s in states):
        why.append("native frames only")
    if any(m.endswith("(read from torch's watchdog message)") for m in missing):
        why.append("a rank read from a watchdog message, not from a stack")
    if any(s.state != "unknown" and not s.main_thread for s in states) or \
            any(m.endswith("has no main thread in its dump") for m in missing):
        why.append("a rank's state was read from a thread other than the main one")
    low = len(states) <= 1 or any(s.state == "unknown" for s in states) or (ranks and ranks[-1] + 1 > 2 * len(ranks))
    conf = "low" if low else ("medium" if why else "high")
    return inputs, formats, missing, conf, why


def _chain_has(s: RankState, names: frozenset) -> bool:
    return any(c.rsplit(".", 1)[-1] in names for c in s.caller_chain)


def _idle_handshake(states: list[RankState], judged: list[RankGroup]) -> bool:
    """Some ranks idle-sleep in the scheduler's idle path while the others wait in the request broadcast.

    With ``--sleep-on-idle`` (IdleSleeper: zmq poll with a 1 s timeout) an idle SGLang server is captured like
    this most of the time: it is the idle shape, not a divergence (seen on the CPU testbed, sglang 0.5.23).
    """
    if len(judged) < 2:
        return False
    known = [s for s in states if s.state in ("collective", "idle-wait")]
    coll = [s for s in known if s.state == "collective"]
    idle = [s for s in known if s.state == "idle-wait"]
    if not coll or not idle:
        return False
    rules = _frame_rules()
    return all(s.op == "broadcast" and s.via in rules.request_broadcast_layers
               and _chain_has(s, rules.request_broadcast_callers)
               for s in coll) and all(_chain_has(s, rules.idle_loop_callers) for s in idle)


def _handshake_summary(states: list[RankState], unknown: list[int]) -> str:
    idle = [s.rank for s in states if s.state == "idle-wait"]
    coll = [s.rank for s in states if s.state == "collective"]
    tail = f" (no readable stack from {_ranks_text(unknown)})" if unknown else ""
    callers = _frame_rules().request_broadcast_callers
    first = next((st for st in states if st.state == "collective"), None)
    caller = next((c.rsplit(".", 1)[-1] for c in (first.caller_chain if first else ()) if c.rsplit(".", 1)[-1] in callers), "")
    how = f" ({first.via} ← {caller})" if first is not None and first.via and caller else ""
    return (f"Not diverged: {_ranks_text(idle)} {_is_are(idle)} idle-sleeping in the scheduler's idle path while "
            f"{_ranks_text(coll)} {_is_are(coll)} in the request broadcast{how} "
            f"waiting for the next tick — an idle server, not a hang{tail}.")


def _reason(judged: list[RankGroup], busy: list[int], unknown: list[int], in_coll: bool) -> str:
    if busy:
        return "some rank busy"
    if not judged:
        return "no readable stack"
    if len(judged) == 1:
        g = judged[0]
        return ("all in the same collective from the same call site" if g.state == "collective"
                else "all idle-waiting at the same place")
    if not in_coll:
        return "idle-waiting at different places, no rank in a collective"
    colls = [g for g in judged if g.state == "collective"]
    if len(colls) < len(judged):
        return "collective vs idle-wait"
    if len({g.op for g in colls}) > 1:
        return "different collective"
    return "same collective, different call sites"


def _group_text(g: RankGroup) -> str:
    return f"{_ranks_text(g.ranks)} {_is_are(g.ranks)} " + (
        f"in {g.where}" if g.state == "collective" else g.where if g.state != "idle-wait" else g.where
    )


def _summary(states: list[RankState], judged: list[RankGroup], busy: list[int], unknown: list[int],
             diverged: bool, odd: list[int], even: bool, reason: str) -> str:
    tail = f" (no readable stack from {_ranks_text(unknown)})" if unknown else ""
    if not states:
        return "no rank captured."
    if not judged and busy:
        return f"{_ranks_text(busy)} {_is_are(busy)} busy: no rank is blocked{tail}."
    if not judged:
        return f"no readable stack from any rank{tail}."
    if len(states) == 1:
        s = states[0]
        return (f"Only rank {s.rank} was captured: one rank cannot diverge from itself; capture every rank of the "
                f"TP group to compare (rank {s.rank}: {s.where()}).")
    if busy:
        bs = [s for s in states if s.state == "busy"]
        b = "; ".join(f"rank {s.rank} busy in {s.blocked_frame}" for s in bs[:3])
        return (f"Not diverged yet: {b} (a busy rank may still reach the collective), while "
                + "; ".join(_group_text(g) for g in judged) + tail + ".")
    if len(judged) == 1:
        g = judged[0]
        if g.state == "collective":
            return (f"Not diverged: all {len(g.ranks)} ranks wait in {g.where} — the same collective from the "
                    f"same call site (idle ranks look like this; not a hang by itself){tail}.")
        return f"Not diverged: all {len(g.ranks)} ranks {g.where}{tail}."
    if not diverged:
        return "Not diverged: " + "; ".join(_group_text(g) for g in judged) + f" ({reason}){tail}."
    if even:
        sides = "; ".join(_group_text(g) for g in judged)
        n = " against ".join(str(len(g.ranks)) for g in judged)
        return f"DIVERGED ({reason}, a {n} split): {sides}{tail}."
    major = judged[0]
    minor = [g for g in judged[1:]]
    return (f"DIVERGED ({reason}): " + "; ".join(_group_text(g) for g in minor)
            + f", while {_group_text(major)}; odd {'rank' if len(odd) == 1 else 'ranks'} out: "
            + ",".join(str(r) for r in odd) + f"{tail}.")


def frames_unchanged(first: Sequence[RankCapture], second: Sequence[RankCapture]) -> bool:
    """True when every rank of ``first`` was captured in ``second`` with the same deciding stack.

    Per rank, the thread that decides the state (:func:`select_thread`) must have the same Python frames
    (function, file base name, line) in both captures; background threads are not compared. A rank missing or
    without stacks in either capture makes the answer False.
    """
    return not changed_ranks(first, second)


def changed_ranks(first: Sequence[RankCapture], second: Sequence[RankCapture]) -> list[int]:
    """Ranks whose deciding stack differs between two captures (or that are missing / unreadable in either)."""
    b = {c.rank: c for c in second}
    changed = []
    for a in first:
        if a.rank is None:
            continue
        c = b.get(a.rank)
        if c is None or not a.threads or not c.threads:
            changed.append(a.rank)
            continue
        ta, _, _ = select_thread(a.threads)
        tc, _, _ = select_thread(c.threads)
        if ta is None or tc is None or _sig(ta) != _sig(tc):
            changed.append(a.rank)
    if not first:
        return [-1]
    return changed


def _sig(t: ThreadStack) -> list[tuple[str, str, Optional[int]]]:
    return [(f.short_function, f.basename, f.line) for f in t.python_frames]
