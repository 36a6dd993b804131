"""The analysis's records: one thread's reading, one rank's state, ranks grouped by where they are blocked, and the
:class:`Analysis` of one capture (with its summary and markdown)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from typing import Literal, Optional, Sequence

from repro.diagnosis import describe_where, md_cell
from repro.evidence import Layout
from repro.stacks import Frame, RankCapture


RankStateName = Literal["collective", "idle-wait", "busy", "unknown"]


# lines of inputs / missing ranks `input_lines` lists before one summary line (the rest stay in analysis.json)
MAX_LISTED_LINES = 20


class ThreadReading(BaseModel):
    """What one thread's stack says (internal to the analysis, exposed for tests)."""

    model_config = ConfigDict(frozen=True)

    state: RankStateName
    op: Optional[str] = None
    via: Optional[str] = None
    layers: list[str] = Field(default_factory=list)
    wait: Optional[str] = None
    blocked_frame: Optional[Frame] = None
    innermost: Optional[Frame] = None
    caller_chain: list[str] = Field(default_factory=list)
    injected: bool = False
    injected_site: Optional[str] = None


class RankState(BaseModel):
    """Where one rank is blocked.

    Attributes:
        rank: global rank; pid: its process.
        state: ``collective`` / ``idle-wait`` / ``busy`` / ``unknown`` (no readable stack: see ``error``).
        op: collective op (``all_reduce``, ``broadcast``…), innermost op-named frame; None unless collective.
        via: outermost communication wrapper: ``broadcast_pyobj``, ``GroupCoordinator``, ``pynccl``,
            ``custom_all_reduce``, ``monitored_barrier``, ``torch.distributed`` or ``native-wait``.
        layers: all communication layers seen, outermost first.
        wait: idle-wait kind (``zmq poll/recv``, ``queue get``…) when idle-wait.
        blocked_frame: ``function (file:line)`` of the call site: the first frame outside communication/wait
            layers and the injector (for busy: the innermost frame's caller outside decorators).
        caller_chain: the call site and its callers (function names), innermost first.
        thread: name (or id) of the thread the state was read from; ``main_thread``: whether it is the main one.
        injected: an injector frame sits between the op and the call site.
        injected_site: the patched site whose injected action issued the collective (from the wrapper frame
            ``repro_injected[<site>]``), when known.
        process_group: always None from stacks (py-spy shows no process groups; the ledger fills it).
        cpu_percent: CPU use during capture (percent of one core), when known.
        error: why the state is unknown (or a note on a busy thread beside a collective).
        notes: what the reading says in words (``the main thread is not in this dump``, successive dumps kept the
            last, Python frames absent, the torch timeout seen).
        other_collectives: threads besides the deciding one that wait in a collective (``thread prefetch: all_gather``).
        backend / group_kind: the backend (gloo / NCCL / MPI) and group kind (CPU / device) the frames or the
            text show, else None.
        fmt / source / rank_source: the format read, the file (and block) it came from, how the rank was known.
        spin_wait: the innermost frames are a known spin-wait (an engine's ``FrameRules.spin_waits``: vLLM's CPU
            shm ops, NCCL's proxy loop): hot on the CPU while it waits for a peer (``repro.verdict.judge_stall``).
    """

    model_config = ConfigDict(frozen=True)

    rank: int
    pid: Optional[int] = None
    state: RankStateName
    op: Optional[str] = None
    via: Optional[str] = None
    layers: list[str] = Field(default_factory=list)
    wait: Optional[str] = None
    blocked_frame: Optional[str] = None
    caller_chain: list[str] = Field(default_factory=list)
    thread: str = ""
    main_thread: bool = True
    injected: bool = False
    injected_site: Optional[str] = None
    process_group: Optional[str] = None
    cpu_percent: Optional[float] = None
    error: str = ""
    location_key: str = ""
    notes: list[str] = Field(default_factory=list)
    other_collectives: list[str] = Field(default_factory=list)
    backend: Optional[str] = None
    group_kind: Optional[str] = None
    fmt: str = ""
    source: str = ""
    rank_source: str = ""
    spin_wait: bool = False

    def where(self) -> str:
        """Short human description: ``all_reduce via GroupCoordinator ← VocabParallelEmbedding.forward ← …``
        (``repro.diagnosis.describe_where``, the one formatter every report uses)."""
        return describe_where(self.state, op=self.op, via=self.via, wait=self.wait, blocked_frame=self.blocked_frame,
                              caller_chain=self.caller_chain, injected_site=self.injected_site, error=self.error)


class RankGroup(BaseModel):
    """Ranks blocked at the same place (same state, op and call site)."""

    model_config = ConfigDict(frozen=True)

    ranks: list[int]
    state: RankStateName
    op: Optional[str] = None
    via: Optional[str] = None
    wait: Optional[str] = None
    call_site: Optional[str] = None
    where: str = ""


class Analysis(BaseModel):
    """The diagnosis of one capture of every rank.

    Attributes:
        ranks: one :class:`RankState` per rank, in rank order.
        groups: ranks grouped by where they are blocked (largest group first; unknown ranks not grouped).
        odd_ranks: ranks outside the unique largest group when the ranks diverge; empty on an even split or
            when not diverged.
        even_split: the two (or more) largest groups have the same size (TP=2 is always 1 against 1).
        diverged: no rank busy, at least one rank in a collective, and the known ranks are not all at one place
            (SGLang's idle tick -- some ranks in the idle sleep, the others in the request broadcast -- excepted).
        reason: ``different collective`` / ``same collective, different call sites`` / ``collective vs idle-wait``
            / ``all in the same collective`` / ``some rank busy`` / … (one phrase).
        busy_ranks / unknown_ranks: ranks in those states.
        summary: one sentence for people.
        warnings: parser/capture warnings worth showing.
        inputs: every process read, kept or skipped: ``{file, block, format, pid, title, kept, rank, reason}``.
        formats: format read → number of processes read in it.
        missing: what the dumps lack, in words (``2 of 8 ranks present (missing: 2-7)``, ``rank 1 has no main
            thread``).
        confidence: ``high`` / ``medium`` / ``low``; ``confidence_reasons``: why not higher.
    """

    model_config = ConfigDict(frozen=True)

    ranks: list[RankState]
    groups: list[RankGroup] = Field(default_factory=list)
    odd_ranks: list[int] = Field(default_factory=list)
    even_split: bool = False
    diverged: bool = False
    reason: str = ""
    busy_ranks: list[int] = Field(default_factory=list)
    unknown_ranks: list[int] = Field(default_factory=list)
    summary: str = ""
    warnings: list[str] = Field(default_factory=list)
    inputs: list[dict] = Field(default_factory=list)
    formats: dict[str, int] = Field(default_factory=dict)
    missing: list[str] = Field(default_factory=list)
    confidence: str = ""
    confidence_reasons: list[str] = Field(default_factory=list)

    def input_lines(self) -> list[str]:
        """What was read and how sure the conclusion is, in words (one line each): formats read, every process
        kept or skipped with its reason, what is missing, the confidence and why."""
        from repro.readers.types import FORMAT_NAMES

        out: list[str] = []
        if self.formats:
            out.append("read as: " + ", ".join(f"{FORMAT_NAMES.get(k, k)} ({n} process{'es' if n != 1 else ''})"
                                               for k, n in self.formats.items()))
        for k, i in enumerate(self.inputs):
            if k == MAX_LISTED_LINES:
                out.append(f"… and {len(self.inputs) - k} more inputs (each one is in {Layout.ANALYSIS.name} / --json)")
                break
            where = i.get("file", "") + (f", block {i['block']}" if i.get("block") else "")
            who = f"pid {i['pid']} " if i.get("pid") is not None else ""
            title = f"{i['title'][:60]!r} " if i.get("title") else ""
            if i.get("kept"):
                out.append(f"kept {where}: {who}{title}as rank {i.get('rank')} ({i.get('reason', '')})")
            else:
                out.append(f"skipped {where}: {who}{title}({i.get('reason', '')})")
        out += [f"missing: {m}" for m in self.missing[:MAX_LISTED_LINES]]
        if len(self.missing) > MAX_LISTED_LINES:
            out.append(f"missing: … and {len(self.missing) - MAX_LISTED_LINES} more (each one is in {Layout.ANALYSIS.name} / --json)")
        if self.confidence:
            out.append(f"confidence: {self.confidence}" + (f" ({'; '.join(self.confidence_reasons)})"
                                                           if self.confidence_reasons else ""))
        return out

    def unreadable(self, where: str) -> Optional[str]:
        """One line for input of which no rank's stack could be read (binary, empty, junk files), naming what was
        found and what is expected; None when at least one rank's stack was read. ``where``: the paths, in words.
        ``repro analyze`` and ``repro reproduce`` refuse such input with this same line (exit 2)."""
        if not self.ranks or len(self.unknown_ranks) != len(self.ranks):
            return None
        reasons = [w for w in self.warnings if "binary file" in w or "no Python stack found" in w
                   or "lines that start a dump were looked for" in w or "the file is empty" in w
                   or "the input is empty" in w or "not complete JSON" in w or "not valid JSON" in w]
        return (f"no rank's stack could be read from {where}: "
                + ("; ".join(dict.fromkeys(reasons)) if reasons else
                   "expected py-spy text or --json, faulthandler, pystack, gdb bt or a pasted frame list"))

    def to_json(self) -> str:
        """The analysis as a JSON text (what ``analysis.json`` holds)."""
        return self.model_dump_json(indent=2)

    def to_dict(self) -> dict:
        """The analysis as plain JSON-able data (for writers that encode JSON themselves)."""
        return self.model_dump(mode="json")

    def to_markdown(self, captures: Sequence[RankCapture] = ()) -> str:
        """GitHub-flavoured markdown for an issue comment: summary, per-rank table, raw stacks in ``<details>``."""
        out = [f"**Diagnosis:** {self.summary}", ""]
        out.append("| rank | state | blocked in | via | call site | caller chain |")
        out.append("|---|---|---|---|---|---|")
        for r in self.ranks:
            blocked = r.op or r.wait or ("" if r.state != "unknown" else r.error)
            chain = " ← ".join(f"`{c}`" for c in r.caller_chain[:6])
            site = f"`{r.blocked_frame}`" if r.blocked_frame else ""
            thread = "" if r.main_thread or not r.thread else f" (thread {r.thread})"
            out.append(f"| {r.rank} | {r.state}{thread} | {_md(blocked)} | {_md(r.via or '')} | {site} | {chain} |")
        if self.warnings:
            out += ["", "Warnings:", ""] + [f"- {_md(w)}" for w in self.warnings]
        for c in captures:
            if c.text:
                out += ["", f"<details><summary>rank {c.rank} stacks ({c.method}, pid {c.pid})</summary>", "",
                        "```", c.text.rstrip(), "```", "", "</details>"]
        return "\n".join(out) + "\n"


_md = md_cell  # the one markdown escape (repro.diagnosis)
