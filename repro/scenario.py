"""Scenario files (the test as data) and the plan they compile to (what the injector reads).

A scenario is a TOML file under ``scenarios/``. It names the real bug it mirrors, the server to run, the request
burst, the stall/budget times and one or more named variants. Each variant lists injections: *where* (a site,
with alternatives across engine versions), *when* (a stack gate: caller frames, loop, ranks, occurrence) and
*what* (an action: extra collective, skip, return value, state (all *forced*); delay, stop, clock, fault, pending,
miss, fail (the *natural* environment nemeses); or none for a control). ``nature_of`` labels an action.

``load_scenario`` validates with pydantic and raises :class:`ScenarioError` whose message names the file, the
field and what was expected. ``compile_plan`` turns one variant into a plain-JSON dict: the contract with
``injectors/repro_injector`` (which never imports this package). Keep both sides in step: ``PLAN_VERSION``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator, model_validator

from repro.nemeses import MassAbort, Workload  # MassAbort: re-exported (the client-side nemesis lives there)
from repro.resources import EXAMPLES_DIR
from repro.targets import DEFAULT_ADAPTER

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PLAN_VERSION = 1
PLAN_ENV = "REPRO_PLAN"

Expect = Literal["deadlock", "success", "inconclusive", "desync"]
VERDICT_OF_EXPECT = {
    "deadlock": "DEADLOCKED",
    "success": "ALL REQUESTS SUCCEEDED",
    "inconclusive": "INCONCLUSIVE",
}

_SITE_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
_FRAME_RE = re.compile(r"^[\w.*?\[\]]+(:[\w.*?\[\]<>]+)?$")


class ScenarioError(ValueError):
    """A scenario file could not be read or is invalid; the message names file, field and the fix."""


NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"  # a scenario's, variant's or injection's name: it becomes a path component


def path_name_problem(name: str) -> str:
    """"" when ``name`` is safe as one path component (an evidence folder ``<root>/<scenario>/``, a run label), else
    what is wrong: ``.`` and ``..`` match :data:`NAME_PATTERN` but name the folder itself or its parent, so evidence
    would land outside ``--evidence-dir``."""
    if name and not name.strip("."):
        return (f"{name!r} is only dots: as a folder name '.' and '..' are the folder itself and its parent (the "
                "evidence would land outside --evidence-dir); use a name with at least one letter, digit, '_' or '-'")
    return ""


MAX_TP_SIZE = 64  # the largest TP size a scenario (server.tp_size) or --tp may ask for


def tp_option_problem(tp: Optional[int], default_tp: int, expects: Sequence[tuple[str, str]]) -> str:
    """"" when ``--tp`` (``tp``; None: not given, ``default_tp`` is used) can run ``expects``, else the one line
    ``repro run`` and ``repro reproduce`` refuse it with (exit 2): a TP size outside 1..MAX_TP_SIZE, or fewer than
    2 ranks for something that expects a deadlock (a collective desync needs 2 ranks).

    Args:
        expects: ``(what, expect)`` per thing to run, e.g. ``("variant 'x'", "deadlock")``.
    """
    if tp is not None and not 1 <= tp <= MAX_TP_SIZE:
        return f"--tp must be ≥ 1 and ≤ {MAX_TP_SIZE} (got {tp})"
    size = tp if tp is not None else default_tp
    for what, expect in expects:
        if size < 2 and expect == "deadlock":
            return (f"{what} expects a deadlock, but a collective desync needs at least 2 ranks (TP size {size}); "
                    "use --tp 2 or more")
    return ""


def _path_name(v: str) -> str:
    problem = path_name_problem(v)
    if problem:
        raise ValueError(problem)
    return v


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# A scenario's numbers and booleans as TOML writes them: ``tp_size = true`` is not 1, ``stall_s = "8"`` is not 8 s,
# ``ledger = "no"`` is not false (pydantic's lax mode took all three; ``tp_size = true`` then surfaced as a gate-rank
# error). An integer still fills a float field (``stall_s = 8``). Every int/float/bool field below says ``strict``.
StrictInt = Annotated[int, Strict()]
StrictBool = Annotated[bool, Strict()]
StrictFloat = Annotated[float, Strict()]  # takes an int too (8 -> 8.0)


class RoleSpec(_Strict):
    """One server of a multi-server topology (``[server.roles.<name>]``): what differs from ``[server]``.

    ``tp_size`` replaces ``server.tp_size`` for this role (None: the adapter's default for the role); ``args`` and
    ``env`` are added after the shared ``server.args`` / ``server.env``.
    """

    tp_size: Optional[int] = Field(None, ge=1, le=MAX_TP_SIZE, strict=True)
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)


class ServerSpec(_Strict):
    """The server a scenario runs: which adapter, model, TP size, engine flags and environment.

    ``topology`` = ``single`` (one server, the default) or a name the adapter knows (SGLang: ``pd`` = a prefill
    server of ``tp_size`` ranks, a decode server and a router that receives the burst; ``docs/pd.md``); ``roles``
    holds per-role overrides (``[server.roles.decode] tp_size = 1``). ``args`` / ``env`` go to every engine server.

    ``adapter`` is any name registered in ``repro.targets.registry`` (built in: ``sglang``; others through the
    ``repro.adapters`` entry-point group); an unknown name is an error listing the known ones.
    """

    adapter: str = DEFAULT_ADAPTER
    model: str = Field("", description="model path; empty = the CPU testbed's tiny model")
    tp_size: int = Field(2, ge=1, le=MAX_TP_SIZE, strict=True)
    args: list[str] = Field(default_factory=list, description="extra engine flags, e.g. ['--max-running-requests', '8']")
    env: dict[str, str] = Field(default_factory=dict)
    startup_timeout_s: float = Field(300.0, gt=0, strict=True)
    topology: str = Field("single", pattern=r"^[a-z][a-z0-9_-]*$")
    roles: dict[str, RoleSpec] = Field(default_factory=dict)

    @field_validator("adapter")
    @classmethod
    def _known_adapter(cls, v: str) -> str:
        from repro.targets.registry import known_adapters

        known = known_adapters()
        if v not in known:
            raise ValueError(f"unknown adapter {v!r}; expected one of: {', '.join(known)} (an engine package "
                             "registers its adapter in the 'repro.adapters' entry-point group)")
        return v


class Burst(_Strict):
    """The request burst the driver sends once the injector is armed (``abort``: a mass abort during it)."""

    requests: int = Field(8, ge=1, le=10_000, strict=True)
    concurrency: int = Field(8, ge=1, le=1024, strict=True)
    max_new_tokens: int = Field(8, ge=1, strict=True)
    input_len: int = Field(32, ge=1, strict=True)
    seed: int = Field(1234, strict=True)
    request_timeout_s: float = Field(600.0, gt=0, strict=True, description="hard per-request bound; stalls are detected earlier")
    abort: Optional[MassAbort] = None
    workload: Optional[Workload] = Field(None, description="what the clients do besides the plain burst (repro.nemeses)")


class Occurrence(_Strict):
    """Which matching calls fire, counted only while armed and restarted at each (re)arm.

    ``every``: all matches; ``first``: the first match; ``nth``: the n-th match (1-based). ``max_fires`` caps the
    total fires per process per arming (0 = no cap).
    """

    mode: Literal["every", "first", "nth"] = "first"
    nth: int = Field(1, ge=1, strict=True)
    max_fires: int = Field(0, ge=0, strict=True)


class Gate(_Strict):
    """Stack gate: the site fires only when the call stack matches.

    Frame patterns are ``module:qualname`` globs (``fnmatch``), e.g.
    ``sglang.srt.managers.scheduler:Scheduler._get_new_batch_prefill_raw``; a pattern without ``:`` matches the
    qualname in any module. ``called_from``: every pattern must match some frame within ``max_depth`` frames above
    the site (decorator ``wrapper`` frames are skipped and do not count toward the depth).
    ``not_called_from``: no pattern may match. ``inside_loop``: the frame matched by ``called_from[0]`` must be
    executing inside the ``for`` loop whose target is this name (e.g. ``req``). ``ranks``: global ranks (or ranks
    in the group reached by ``rank_group`` from ``self``) on which the gate can match; empty = all ranks.
    """

    called_from: list[str] = Field(default_factory=list)
    not_called_from: list[str] = Field(default_factory=list)
    max_depth: int = Field(16, ge=1, le=256, strict=True)
    inside_loop: Optional[str] = None
    ranks: list[StrictInt] = Field(default_factory=list)
    rank_group: Optional[str] = Field(None, description="attribute path from self to a process group; rank in that group")
    occurrence: Occurrence = Field(default_factory=Occurrence)

    @field_validator("called_from", "not_called_from")
    @classmethod
    def _patterns(cls, v: list[str]) -> list[str]:
        for p in v:
            if not _FRAME_RE.match(p):
                raise ValueError(f"frame pattern {p!r} must look like 'module:Qual.name' (globs allowed)")
        return v

    @model_validator(mode="after")
    def _loop_needs_caller(self) -> "Gate":
        if self.inside_loop and not self.called_from:
            raise ValueError("inside_loop needs called_from: the loop is looked for in the frame matched by called_from[0]")
        return self


class ExtraCollective(_Strict):
    """Fire one extra collective before (or after) the original call: a collective its peers never issue.

    The group is reached from ``self`` by ``group`` (attribute path, e.g. ``tp_cpu_group`` or
    ``tp_group.cpu_group``) or from a module (``module:attr`` or ``module:getter()``, e.g. vLLM's
    ``vllm.distributed.parallel_state:get_tp_group()``; a group wrapper with a ``cpu_group`` gives that gloo
    group), or the collective is issued by calling ``method`` on ``self`` with a 1-element
    int tensor (e.g. ``_all_reduce_attn_groups``). Tensors go on CPU for gloo groups, CUDA for NCCL.
    """

    kind: Literal["extra_collective"]
    op: Literal["all_reduce", "broadcast", "barrier", "all_gather"] = "all_reduce"
    group: Optional[str] = None
    method: Optional[str] = None
    when: Literal["before", "after"] = "before"
    reduce_op: Optional[Literal["SUM", "MAX", "MIN", "PRODUCT"]] = Field(
        None, description="all_reduce only: the reduce op (torch.distributed.ReduceOp name); default SUM on a group, "
                          "MAX through a two-argument method. Two ranks firing all_reduces of the same size with "
                          "different reduce ops complete on gloo with wrong values: a desync that does not hang")

    @model_validator(mode="after")
    def _one_target(self) -> "ExtraCollective":
        if bool(self.group) == bool(self.method):
            raise ValueError("set exactly one of 'group' (attribute path from self) or 'method' (method of self)")
        if self.reduce_op is not None and self.op != "all_reduce":
            raise ValueError(f"reduce_op is for op = \"all_reduce\" only (op is {self.op!r}); remove reduce_op")
        return self


class Skip(_Strict):
    """Do not call the original on the chosen ranks (a missing collective); return ``value`` instead."""

    kind: Literal["skip"]
    value: Any = None
    return_arg: Optional[int] = Field(None, ge=0, strict=True, description="return this positional argument instead of value (0 = self for methods): a skipped in-place collective hands back its input")


class ReturnValue(_Strict):
    """Call the original, then replace its result on the chosen ranks (per-rank state divergence); with ``offset``,
    return the original's result plus ``offset`` instead (a drift of ±1 slot, a clock jump in seconds)."""

    kind: Literal["return_value"]
    value: Any = None
    call_original: bool = Field(True, strict=True)
    offset: Optional[Union[StrictInt, StrictFloat]] = Field(None, description="return the original's result plus this number instead of value (drift, e.g. -1)")


# The natural actions' numbers: a number written as a number (``stop_s = true`` is not a 1 s stop, ``"2"`` is not 2)
# and finite (``nan`` fails every bound check with a message that names the bound, not the nan). Integers are fine.
_SECONDS: dict = {"strict": True, "allow_inf_nan": False}


class Delay(_Strict):
    """*Natural*: sleep ``delay_s`` seconds before calling the original (the rank looks busy, not deadlocked)."""

    kind: Literal["delay"]
    delay_s: float = Field(..., gt=0, le=3600, **_SECONDS)


class Stop(_Strict):
    """*Natural*: stop the whole rank process (SIGSTOP) and continue it (SIGCONT) ``stop_s`` seconds later: every
    thread of the rank stops (OS scheduling, a paused VM), unlike ``delay`` which sleeps only the calling thread."""

    kind: Literal["stop"]
    stop_s: float = Field(..., gt=0, le=600, description="seconds the rank stays stopped", **_SECONDS)


CLOCK_NAMES = ("monotonic", "time", "perf_counter", "monotonic_ns", "time_ns", "perf_counter_ns")


class Clock(_Strict):
    """*Natural*: from this fire on, the rank's ``time`` clocks read ``step_s`` seconds later plus ``skew`` extra
    seconds per real second (for ``for_s`` real seconds; 0 = until the process exits). Only ``time.<name>`` looked
    up at call time moves (``from time import monotonic`` bound earlier keeps the real clock); the injector's own
    ledger and timers keep the real functions."""

    kind: Literal["clock"]
    clocks: list[Literal["monotonic", "time", "perf_counter", "monotonic_ns", "time_ns", "perf_counter_ns"]] = Field(
        default_factory=lambda: ["monotonic", "time"], min_length=1)
    step_s: float = Field(0.0, ge=-86_400, le=86_400, description="a step of the clock, seconds (may be negative)", **_SECONDS)
    skew: float = Field(0.0, ge=-0.9, le=100, description="extra seconds per real second from the fire (a fast/slow clock)", **_SECONDS)
    for_s: float = Field(0.0, ge=0, description="real seconds the shift lasts; 0 = until exit", **_SECONDS)

    @model_validator(mode="after")
    def _moves(self) -> "Clock":
        if self.step_s == 0 and self.skew == 0:
            raise ValueError("a clock action must move the clock: set step_s (seconds, e.g. 30) or skew (e.g. 0.5)")
        return self


class Fault(_Strict):
    """*Natural*: the call raises ``exception`` once on the chosen rank (a failed transfer, a storage error):
    ``when`` = before (instead of the call) or after (the operation ran, its caller sees a failure). The fire log's
    ``fault_outcome`` says ``observe_s`` later what the thread did: died, caught it and called again, or neither."""

    kind: Literal["fault"]
    exception: Literal["RuntimeError", "OSError", "TimeoutError", "ConnectionError", "ValueError"] = "RuntimeError"
    message: str = ""
    when: Literal["before", "after"] = "before"
    observe_s: float = Field(5.0, gt=0, le=600, description="seconds after the fault to check the thread", **_SECONDS)


class Pending(_Strict):
    """*Natural*: a completion poll (an event's ``query``, a ``done()``) answers not-done (``value``) for ``polls``
    consecutive matching calls from the fire on: a device or transfer that completes later on this rank only. With
    ``only_done`` the poll is called each time and the fire is the first (n-th) poll whose true answer was done
    (injectors/repro_injector/_natural.py ``run_natural``)."""

    kind: Literal["pending"]
    polls: int = Field(..., ge=1, le=100_000, description="how many consecutive polls answer not-done", strict=True)
    value: Any = Field(False, description="the not-done answer (False for Event.query / Future.done)")
    call_original: bool = Field(False, strict=True, description="still call the poll (a poll with side effects)")
    only_done: bool = Field(False, strict=True, description="call the poll; one whose true answer is not done (equal "
                            "to `value`, or not `done` when given) is no fire (and no match): occurrence counts the "
                            "polls that would have said done")
    done: Any = Field(None, description="with only_done: the true answer that means done (a status poll's success "
                      "value, e.g. 4); unset: anything but `value`")

    @model_validator(mode="after")
    def _done_needs_only_done(self) -> "Pending":
        if self.done is not None and not isinstance(self.done, (bool, int, float, str)):
            raise ValueError(f"done = {self.done!r}: expected one value (a number, true / false or a string), the "
                             "poll's answer that means done (e.g. done = 4 for a status poll whose success value is 4)")
        if self.done is not None and not self.only_done:
            raise ValueError("'done' is read only with only_done = true (the poll is then called and its true answer "
                             "compared); add only_done = true, or drop done")
        return self


class Miss(_Strict):
    """*Natural* (on a storage backend's method: an answer from outside the replicated state): the call runs, and its
    answer says the pages from index ``keep_pages`` on are not there — "not stored" on a query (``batch_exists`` →
    at most ``keep_pages``) or a read (``batch_get`` → None per missed key), the failure answer on a write
    (``batch_set`` → False). With ``only_hits`` a call that found no more than ``keep_pages`` pages is no fire and no
    match, so occurrence ``first`` / ``nth`` picks the first / n-th call that found pages (a chosen request)."""

    kind: Literal["miss"]
    keep_pages: int = Field(0, ge=0, le=1_000_000, strict=True, description="leading pages that keep their true answer")
    only_hits: bool = Field(True, strict=True, description="a call with nothing to miss is no fire (and no match)")


class Fail(_Strict):
    """*Natural* (on a storage backend's method): the call reports failure without doing its work (nothing read or
    written): it answers ``answer`` — ``false`` (sglang 0.5.23 ``HiCacheFile.batch_set`` / ``set``), ``none``
    (``get``), ``zero`` (``batch_exists``) — or with ``per_key`` a list of it, one per key of the call's first list
    argument (``batch_get`` → ``none``). A storage call that *raises* is ``fault``."""

    kind: Literal["fail"]
    answer: Literal["false", "none", "zero"] = "false"
    per_key: bool = Field(False, strict=True, description="answer one per key of the call's first list argument")


class Observe(_Strict):
    """Control: the site stays patched and counted (entered/matched) but nothing ever fires."""

    kind: Literal["none"]
    record_callers: bool = Field(False, strict=True, description="write one 'seen' fire-log event per distinct call place (repro hunt's baseline)")


class State(_Strict):
    """Move real engine state on the chosen ranks: take ``take`` slots of the pool at ``pool`` (attribute path from
    ``self``, e.g. ``req_to_token_pool`` on sglang's Scheduler) and keep them (a per-rank leak), or give them back
    at the first call of the site ``release_after_ticks`` scheduler ticks later (the ledger's tick count). The
    original is then called unchanged. sglang 0.5.23's idle leak check (``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE``,
    on by default) raises at the first fully idle tick on a leaked slot: size the burst so the hang comes first,
    or release before idle."""

    kind: Literal["state"]
    pool: str = Field(..., pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$",
                      description="attribute path from self to the pool, e.g. req_to_token_pool")
    take: Optional[int] = Field(None, ge=1, le=1_000_000, strict=True, description="slots taken per fire (default 1)")
    leave: Optional[int] = Field(None, ge=0, strict=True, description="instead of take: take all but this many free slots (the "
                                 "pool's size need not be known, e.g. leave = 1 so one request fits)")
    release_after_ticks: Optional[int] = Field(None, ge=1, strict=True, description="give the slots back this many ticks later")

    @model_validator(mode="after")
    def _take_or_leave(self) -> "State":
        if self.take is not None and self.leave is not None:
            raise ValueError("set one of 'take' (slots to take) or 'leave' (free slots to leave), not both")
        return self


Action = Union[ExtraCollective, Skip, ReturnValue, Delay, Observe, State, Stop, Clock, Fault, Pending, Miss, Fail]

# Natural: the engine gets an answer from outside its replicated state (a clock, storage, a device or completion
# event, OS scheduling, an exception) as the environment could give it on one rank; forced: another value of the
# engine's own bookkeeping (however plausible). Mirrors injectors/repro_injector/_natural.py:NATURE (a test checks).
NATURE = {
    "delay": "natural", "stop": "natural", "clock": "natural", "fault": "natural", "pending": "natural",
    "miss": "natural", "fail": "natural", "return_value": "forced", "skip": "forced", "state": "forced", "extra_collective": "forced", "none": "observe",
}


def nature_of(action: Any) -> str:
    """``natural`` / ``forced`` / ``observe`` for an action (model or dict); a dict's own ``nature`` (``control``) wins."""
    d = action.model_dump() if isinstance(action, BaseModel) else dict(action or {})
    return str(d.get("nature") or NATURE.get(str(d.get("kind", "none")), "forced"))


class LedgerTable(_Strict):
    """The ``[ledger]`` table: ``enabled`` records every collective; ``digest`` adds the per-tick lockstep state
    digest (the engine release's probes: ``[state]`` of ``repro/targets/<engine>/releases/<V>.toml``). ``ledger = true|false`` still parses."""

    enabled: bool = Field(True, strict=True)
    digest: bool = Field(True, strict=True)


class Injection(_Strict):
    """One fault: where (site alternatives), when (gate), what (action)."""

    id: str = Field(..., pattern=NAME_PATTERN)
    site: list[str] = Field(..., min_length=1, description="'module:Class.method' alternatives; first that resolves wins")
    aliases: list[str] = Field(default_factory=list, description="for module:function sites, 'module:name' copies to rebind too")
    gate: Gate = Field(default_factory=Gate)
    action: Action = Field(..., discriminator="kind")
    server: Optional[str] = Field(None, description="multi-server topologies: the role whose ranks take this "
                                  "injection (e.g. 'prefill'); None = every engine server")
    required: bool = Field(True, strict=True, description="the verdict needs this site entered on every rank after arming; "
                           "false: an observe-only counter whose per-rank counts are reported, zero included "
                           "(e.g. an abort path a request takes only on some runs)")

    _id_path = field_validator("id")(_path_name)

    @field_validator("site", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("site", "aliases")
    @classmethod
    def _site_shape(cls, v: list[str]) -> list[str]:
        for s in v:
            if not _SITE_RE.match(s):
                raise ValueError(f"site {s!r} must look like 'package.module:Class.method' or 'package.module:function'")
        return v


class Variant(_Strict):
    """A named way to run the scenario: its injections and the verdict it is expected to give."""

    name: str = Field(..., pattern=NAME_PATTERN)
    description: str = ""
    expect: Expect
    injections: list[Injection] = Field(default_factory=list)
    abort: Optional[MassAbort] = Field(None, description="this variant's mass abort (replaces burst.abort), so one "
                                       "server can run it between the other variants")
    workload: Optional[Workload] = Field(None, description="this variant's workload (replaces burst.workload; repro.nemeses)")

    _name_path = field_validator("name")(_path_name)

    @model_validator(mode="after")
    def _unique_ids(self) -> "Variant":
        ids = [i.id for i in self.injections]
        if len(ids) != len(set(ids)):
            raise ValueError(f"injection ids must be unique within a variant, got {ids}")
        return self


class Scenario(_Strict):
    """A whole scenario file. ``variants[0]`` is the default variant."""

    name: str = Field(..., pattern=NAME_PATTERN)
    description: str = ""
    mirrors: str = Field("", description=f"upstream issue/PR the scenario mirrors, e.g. '{DEFAULT_ADAPTER}#30760'")
    server: ServerSpec = Field(default_factory=ServerSpec)
    burst: Burst = Field(default_factory=Burst)
    stall_s: float = Field(10.0, gt=0, strict=True)
    budget_s: float = Field(180.0, gt=0, strict=True)
    ledger: Union[StrictBool, LedgerTable] = True
    variants: list[Variant] = Field(..., min_length=1)

    @field_validator("ledger", mode="before")
    @classmethod
    def _ledger_shape(cls, v: Any) -> Any:
        # one line naming the problem, not one per member of the union (bool, LedgerTable)
        if not isinstance(v, (bool, dict, LedgerTable)):
            raise ValueError("expected true, false or a [ledger] table (enabled = true|false, digest = true|false)")
        bad = [k for k in ("enabled", "digest") if isinstance(v, dict) and k in v and not isinstance(v[k], bool)]
        if bad:
            raise ValueError(f"[ledger] {bad[0]} = {toml_value(v[bad[0]])}: expected true or false")
        return v

    _name_path = field_validator("name")(_path_name)

    @property
    def ledger_enabled(self) -> bool:
        """Record collectives (``ledger = true`` or ``[ledger] enabled = true``)."""
        return self.ledger.enabled if isinstance(self.ledger, LedgerTable) else bool(self.ledger)

    @property
    def digest_enabled(self) -> bool:
        """Record the lockstep state digest too (on with the ledger unless ``[ledger] digest = false``)."""
        return self.ledger_enabled and (self.ledger.digest if isinstance(self.ledger, LedgerTable) else True)

    @model_validator(mode="after")
    def _checks(self) -> "Scenario":
        names = [v.name for v in self.variants]
        if len(names) != len(set(names)):
            raise ValueError(f"variant names must be unique, got {names}")
        if self.budget_s <= self.stall_s:
            raise ValueError(f"budget_s ({self.budget_s}) must be greater than stall_s ({self.stall_s})")
        return self

    def variant(self, name: Optional[str]) -> Variant:
        """Return the named variant (default: the first). Raises ScenarioError listing the known names."""
        if name is None:
            return self.variants[0]
        for v in self.variants:
            if v.name == name:
                return v
        raise ScenarioError(f"scenario {self.name!r} has no variant {name!r}; known: {', '.join(v.name for v in self.variants)}")


def gate_rank_problem(variants: Sequence[Variant], tp_size: int,
                      servers: Optional[Mapping[str, tuple[str, int]]] = None) -> Optional[str]:
    """The first gate of ``variants`` whose ``ranks`` name a rank outside a TP group of ``tp_size`` (a gate with
    ``rank_group`` counts ranks in that group and is not checked), as the sentence ``run`` and ``sites`` both refuse
    with (the caller prefixes the file); None when every gate's ranks fit. ``servers`` (a multi-server topology,
    ``repro.pd.injection_tp_sizes``): injection id → (the engine server it runs on, that server's TP size), which
    replaces ``tp_size`` for that injection (a decode server of TP 4 has ranks 0..3 whatever the prefill's TP)."""
    for v in variants:
        for inj in v.injections:
            server, tp = (servers or {}).get(inj.id, (None, tp_size))
            bad = [k for k in inj.gate.ranks if inj.gate.rank_group is None and not 0 <= k < tp]
            if bad:
                where = f" (server {server})" if server else ""
                return (f"variants.{v.name}.injections.{inj.id}.gate.ranks lists rank(s) {bad}, outside the TP group of "
                        f"size {tp}{where} (expected 0..{tp - 1})")
    return None


STORAGE_KINDS = ("miss", "fail")


def storage_action_problem(variants: Sequence[Variant], storage_sites: Sequence[str], adapter_name: str) -> Optional[str]:
    """The first ``miss`` / ``fail`` injection of ``variants`` with a site alternative that is no storage backend
    method of the engine (``storage_sites``: the adapter's ``module:qualname`` globs), as the sentence ``run`` and
    ``sites`` refuse with (the caller prefixes the file); None when every one fits. Elsewhere (a scheduler method)
    the answer it cuts or invents is the engine's own bookkeeping, forced, while its records would say natural."""
    from fnmatch import fnmatchcase

    for v in variants:
        for inj in v.injections:
            kind = getattr(inj.action, "kind", "")
            if kind not in STORAGE_KINDS:
                continue
            sites = [inj.site] if isinstance(inj.site, str) else list(inj.site)
            bad = [x for x in sites if not any(fnmatchcase(x, g) for g in storage_sites)]
            if bad:
                where = (f"the {adapter_name} adapter's storage backend methods ({', '.join(storage_sites)})"
                         if storage_sites else f"a storage backend method (the {adapter_name} adapter names none)")
                return (f"variants.{v.name}.injections.{inj.id}: action {kind} is natural only on {where}; the site "
                        f"{bad[0]} is not one: put it on the backend's own method (e.g. batch_get / batch_exists / "
                        f"batch_set), or use a forced action (return_value) there")
    return None


def _model_fields_at(loc: tuple, data: Any) -> tuple[list[str], str]:
    """For a validation error at ``loc``: the field names allowed beside its last element (for "did you mean"),
    and a readable path naming variants and injections by name/id (``variant 'x', injection 'y': gate.foo``)."""
    import typing

    cls: Any = Scenario
    node: Any = data
    named: list[str] = []
    plain: list[str] = []
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(part, int):
            if isinstance(node, list) and 0 <= part < len(node):
                node = node[part]
                key = "name" if plain and plain[-1] == "variants" else "id"
                label = node.get(key) if isinstance(node, dict) else None
                kind = "variant" if plain and plain[-1] == "variants" else (plain[-1].rstrip("s") if plain else "item")
                if label is not None:
                    named.append(f"{kind} {label!r}")
                    plain = []
                    continue
            plain.append(str(part))
            continue
        if last:
            plain.append(str(part))
            break
        plain.append(str(part))
        node = node.get(part) if isinstance(node, dict) else None
        fld = getattr(cls, "model_fields", {}).get(part)
        cls = None
        if fld is not None:
            ann = fld.annotation
            for _ in range(4):  # unwrap Optional[...] / list[...] / Union[...] to the model class inside
                if isinstance(ann, type) and issubclass(ann, BaseModel):
                    break
                args = [a for a in typing.get_args(ann) if a is not type(None)]
                ann = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), args[0] if args else None)
            cls = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    fields = list(getattr(cls, "model_fields", {}) or {})
    where = ", ".join(named + ([".".join(plain)] if plain else []))
    return fields, where


def toml_value(value: Any) -> str:
    """A value read from a TOML file, spelled as TOML spells it, with its type where the type is the problem:
    ``true, a boolean`` (Python would say ``True``), ``"2", a string``; numbers as they are (``-2.0``, ``nan``)."""
    kind = {bool: "a boolean", str: "a string", list: "a list"}.get(type(value))
    return f"{_toml_literal(value)}, {kind}" if kind else _toml_literal(value)


def _toml_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_literal(v) for v in value) + "]"
    return repr(value)


def got_clause(err: Mapping[str, Any]) -> str:
    """`` (got <value>)`` for a pydantic error of a scenario or catalogue field (:func:`toml_value`); "" where the
    value says nothing (a missing field, an unknown field, a whole table)."""
    got = err.get("input")
    if err["type"] in ("missing", "extra_forbidden") or isinstance(got, dict):
        return ""
    return f" (got {toml_value(got)})"


def _format_validation(path: Path, err: ValidationError, data: Any = None) -> str:
    import difflib

    lines = [f"{path}: invalid scenario ({err.error_count()} problem(s)); fix these fields:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<top level>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            fields, where = _model_fields_at(tuple(e["loc"]), data)
            near = difflib.get_close_matches(str(e["loc"][-1]), fields, n=2, cutoff=0.5) if fields else []
            loc = where or loc
            msg = "unknown field" + (f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else
                                     (f" (expected one of: {', '.join(fields)})" if fields else " (typo?)"))
        elif e["type"] == "missing":
            msg = "required field is missing"
        lines.append(f"  - {loc}: {msg}{got_clause(e)}")
    return "\n".join(lines)


def load_scenario(path: Union[str, Path]) -> Scenario:
    """Read and validate a scenario TOML file.

    Raises:
        ScenarioError: the file is missing, is not valid TOML (line/column given), or a field is invalid (each
            problem listed as ``field.path: what was expected``).
    """
    p = Path(path)
    if not p.is_file():
        raise ScenarioError(f"{p}: scenario file not found (expected a .toml file, e.g. {EXAMPLES_DIR}/smoke_extra_allreduce.toml)")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8-sig")  # a UTF-8 byte-order mark (Windows editors) is accepted
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise ScenarioError(f"{p}: not UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start} (line {line}, column {col}) "
                            "cannot be decoded; save the file as UTF-8") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{p}: not valid TOML: {e}") from None
    try:
        return Scenario.model_validate(data)
    except ValidationError as e:
        raise ScenarioError(_format_validation(p, e, data)) from None


def compile_plan(
    scenario: Scenario,
    variant: Variant,
    out_dir: Union[str, Path],
    arm_file: Union[str, Path],
    *,
    ledger: Optional[bool] = None,
    ledger_max_records: int = 20_000,
    tick_function: str = "",
    injector_profile: Optional[dict[str, Any]] = None,
    faulthandler_signal: str = "SIGUSR2",
    state_probes: Optional[dict[str, Any]] = None,
    fork_ranks: Optional[dict[str, str]] = None,
    engine: Optional[dict[str, str]] = None,
) -> dict[str, Any]:
    """Compile one variant into the plain-JSON plan read by ``injectors/repro_injector``.

    Args:
        out_dir: folder where each process writes ``loaded-<pid>.json``, ``fires-<pid>.jsonl`` (and ledgers).
        arm_file: path of the arm file; its content (one injection id per line) arms those injections.
        ledger: record every collective (default: the scenario's ``ledger`` field).
        tick_function: ``module:qualname`` of the engine's per-tick function (the adapter's ``tick_function_for``
            the server's args), for tick counts.
        injector_profile: the adapter's ``InjectorProfile.to_plan()`` (``coordinators``, ``alias_prefixes``,
            ``comm_module_prefixes``), merged into the plan's ``ledger``; None: the injector's own fallbacks.
        faulthandler_signal: signal name on which every process dumps all threads' stacks (py-spy fallback).
        state_probes: the engine's lockstep state probes per release (``Adapter.state_probe_plan()``:
            ``{"package", "releases": {version: [probe, ...]}}``), merged into the plan's ``ledger.digest``; the
            injector uses the installed release's list. None or no release: no digest.
        fork_ranks: the adapter's ``InjectorProfile.fork_plan()`` (``{"caller", "device"}``): which launcher call the
            injector may switch from spawn to fork under ``REPRO_FORK_RANKS=1``; None / {}: never.
        engine: which engine the server runs (``repro.runner.engine_plan``: ``{"name", "package",
            "distribution"}``): the injector records that package's version in its loaded markers.
    Returns:
        A dict with keys ``version``, ``scenario``, ``variant``, ``out_dir``, ``arm_file``, ``arm_poll_s``,
        ``injections`` (list of ``{id, site: {alternatives, aliases}, gate, action}``), ``ledger``,
        ``faulthandler_signal``, ``fork_ranks``, ``engine``.
    """
    injections = []
    for inj in variant.injections:
        injections.append(
            {
                "id": inj.id,
                "site": {"alternatives": list(inj.site), "aliases": list(inj.aliases)},
                "gate": inj.gate.model_dump(),
                "action": {**inj.action.model_dump(), "nature": nature_of(inj.action)},
            }
        )
    return {
        "version": PLAN_VERSION,
        "scenario": scenario.name,
        "variant": variant.name,
        "out_dir": str(Path(out_dir).resolve()),
        "arm_file": str(Path(arm_file).resolve()),
        "arm_poll_s": 0.1,
        "injections": injections,
        "ledger": {
            "enabled": scenario.ledger_enabled if ledger is None else ledger,
            "max_records": ledger_max_records,
            "tick_function": tick_function,
            **(injector_profile or {}),
            "digest": {"enabled": scenario.digest_enabled and bool((state_probes or {}).get("releases")),
                       "ring": 2000, **(state_probes or {})},
        },
        "faulthandler_signal": faulthandler_signal,
        "fork_ranks": dict(fork_ranks or {}),
        "engine": dict(engine or {}),
    }
