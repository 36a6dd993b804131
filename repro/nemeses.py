"""Workload nemeses and server configurations for ``repro hunt`` (Jepsen's generator + its nemesis of the client side).

A quiet burst of fresh prompts is not what a production server sees. A *workload* says, as data, what the clients
do during one burst; the driver (``repro.driver.BurstDriver``) carries it out and records every act in
``requests.jsonl``:

- ``mix``: mixed prompt lengths, output lengths and sampling parameters, cycled over the request index;
- ``client_abort``: every k-th request's client disconnects mid-stream after n output tokens;
- ``deadlines``: every k-th request has a client-side deadline (a per-request timeout): its client gives up and
  disconnects after ``deadline_s`` seconds, answered or not;
- ``admin``: admin endpoints called while requests are in flight (``/flush_cache?timeout=…``, HiCache storage
  attach/detach, a weight update), each recorded with its HTTP status, time and answer;
- ``after``: requests sent once the burst is over (the server must still serve: a consistency check after the
  nemesis);
- the mass abort (``repro.driver.AbortPlan``, a scenario's ``abort``) is the PD issue's action, reused as is.

Requests ended on purpose by the workload (client abort, deadline) are recorded ``aborted`` with the reason, like
the mass abort's, and are not failures; every other request must still succeed.

Server-side nemeses (a small KV pool that forces retraction, chunked prefill) and the hunt's *configurations*
(HiCache prefetch/write policy, radix cache off, chunked-prefill size, schedule policy) are engine flags, data in
the adapter's workload file (``scenarios/sglang/hunt_workloads.toml``, loaded by :func:`load_nemeses`).
Workloads whose flags agree share one server (:func:`server_groups`).

No engine import and no engine names here: flags, paths and sampling parameter names are data.
"""

from __future__ import annotations
from repro.resources import EXAMPLES_DIR

import random
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, model_validator

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

QUIET = "quiet"  # the base scenario's own burst, no nemesis: every hunt's first workload


class NemesisError(Exception):
    """A workload file or option is wrong; the message names the file, the field, what was expected and the fix."""


StrictInt = Annotated[int, Strict()]  # a list item written as a number (``ok_status = ["200"]`` is refused)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MassAbort(_Strict):
    """The driver's mass-abort action (a nemesis of the client side): once ``when_in_flight`` requests are in flight
    at the same time — sent, no output token yet (``before_first_token``: in prefill or in the KV transfer of a PD
    stack) or any (False) — the clients of ``count`` of them disconnect at the same instant (their sockets closed,
    as a load balancer or a user's browser does). Those requests end ``aborted`` (expected, not an error); the
    others must still succeed. Used by scenarios and the hunt's nemeses (``repro.driver.AbortPlan``)."""

    count: int = Field(..., strict=True, ge=1)
    when_in_flight: int = Field(..., strict=True, ge=1)
    before_first_token: bool = Field(True, strict=True)
    timeout_s: float = Field(60.0, strict=True, gt=0, description="give up waiting for that many in flight after this many seconds")
    delay_s: float = Field(0.0, strict=True, ge=0, description="seconds to wait once that many are in flight before disconnecting "
                           "(a request a router has not forwarded yet never reaches the servers)")

    @model_validator(mode="after")
    def _count_fits(self) -> "MassAbort":
        if self.count > self.when_in_flight:
            raise ValueError(f"abort.count ({self.count}) must be ≤ abort.when_in_flight ({self.when_in_flight}): "
                             "only requests in flight can be aborted")
        return self


class RequestMix(_Strict):
    """Mixed requests: request ``i`` takes element ``i % len`` of each non-empty list (else the burst's value).

    ``sampling``: extra sampling parameters merged into the request body by the adapter (``with_sampling``), e.g.
    ``{ temperature = 0.8, top_p = 0.9 }``; names are the engine's (data).
    """

    input_lens: list[StrictInt] = Field(default_factory=list)
    max_new_tokens: list[StrictInt] = Field(default_factory=list)
    sampling: list[dict[str, Any]] = Field(default_factory=list)

    @model_validator(mode="after")
    def _positive(self) -> "RequestMix":
        for name in ("input_lens", "max_new_tokens"):
            bad = [x for x in getattr(self, name) if x < 1]
            if bad:
                raise ValueError(f"mix.{name}: every length must be ≥ 1, got {bad}")
        return self


class ClientAbort(_Strict):
    """Client aborts mid-stream: requests with ``index % every == offset`` disconnect after ``after_tokens`` ids."""

    every: int = Field(..., strict=True, ge=1)
    offset: int = Field(0, strict=True, ge=0)
    after_tokens: int = Field(..., strict=True, ge=1)


class Deadlines(_Strict):
    """Per-request timeouts: requests with ``index % every == offset`` are given up by their client (socket
    closed) ``deadline_s`` seconds after they were sent."""

    every: int = Field(..., strict=True, ge=1)
    offset: int = Field(0, strict=True, ge=0)
    deadline_s: float = Field(..., strict=True, gt=0)


class AdminCall(_Strict):
    """An admin endpoint called during the burst, once ``when_in_flight`` requests are in flight (the server has
    them: answered with headers, which SGLang sends at once and a PD router with the first token; 0: at the
    burst's start), ``delay_s`` later; ``repeat`` times, ``interval_s`` apart; each call bounded by ``timeout_s``.
    ``ok_status``: HTTP statuses that mean the engine answered as designed (a refusal under load included)."""

    method: Literal["GET", "POST", "PUT", "DELETE"] = "POST"
    path: str = Field(..., pattern=r"^/[A-Za-z0-9_./-]*$")
    query: dict[str, Any] = Field(default_factory=dict)
    body: Optional[dict[str, Any]] = None
    headers: dict[str, str] = Field(default_factory=dict)
    when_in_flight: int = Field(1, strict=True, ge=0)
    delay_s: float = Field(0.0, strict=True, ge=0)
    repeat: int = Field(1, strict=True, ge=1, le=100)
    interval_s: float = Field(0.5, strict=True, ge=0)
    timeout_s: float = Field(30.0, strict=True, gt=0)
    wait_s: float = Field(60.0, strict=True, gt=0, description="give up waiting for that many in flight after this many seconds")
    ok_status: list[StrictInt] = Field(default_factory=lambda: [200])
    fill_from: Optional[str] = Field(None, pattern=r"^/[A-Za-z0-9_./-]*$",
                                     description="GET this path first; its JSON answer fills {name} placeholders in body strings")

    def filled_body(self, info: dict) -> Optional[dict]:
        """``body`` with ``{name}`` placeholders in its string values replaced from ``info`` (``fill_from``'s answer).

        Raises:
            KeyError: a placeholder names a key ``info`` lacks (the message names it).
        """
        if self.body is None:
            return None

        def fill(v: Any) -> Any:
            if isinstance(v, str):
                return re.sub(r"\{([A-Za-z0-9_]+)\}", lambda m: str(info[m.group(1)]), v)
            if isinstance(v, dict):
                return {k: fill(x) for k, x in v.items()}
            if isinstance(v, list):
                return [fill(x) for x in v]
            return v

        return fill(self.body)


class WarmStorage(_Strict):
    """A storage-warm workload: the ``after`` requests repeat the first burst prompts, and before they are sent the
    driver waits ``wait_s`` seconds (write-through backups to the storage backend) and calls ``flush_path`` (the
    device and host caches are flushed; a storage backend keeps its pages), so their prefixes are found in storage
    only: a HiCache storage prefetch with page transfers. Recorded as an admin call named ``warm_storage``."""

    wait_s: float = Field(2.0, strict=True, ge=0, le=600, description="seconds after the burst before the flush")
    flush_path: str = Field("/flush_cache", pattern=r"^/[A-Za-z0-9_./-]*$")
    headers: dict[str, str] = Field(default_factory=dict)
    timeout_s: float = Field(30.0, strict=True, gt=0)


class Workload(_Strict):
    """What the clients do during one burst (module docstring). Optional overrides of the burst's sizes."""

    requests: Optional[int] = Field(None, strict=True, ge=1, le=10_000)
    concurrency: Optional[int] = Field(None, strict=True, ge=1, le=1024)
    input_len: Optional[int] = Field(None, strict=True, ge=1)
    max_new_tokens: Optional[int] = Field(None, strict=True, ge=1)
    mix: Optional[RequestMix] = None
    client_abort: Optional[ClientAbort] = None
    deadlines: Optional[Deadlines] = None
    admin: list[AdminCall] = Field(default_factory=list)
    after: int = Field(0, strict=True, ge=0, le=100, description="requests sent after every other one ended")
    warm_storage: Optional[WarmStorage] = Field(None, description="the after requests repeat the burst's first "
                                                "prompts after a cache flush: found in storage only (needs after >= 1)")
    repeat_first: bool = Field(False, strict=True, description="the after requests repeat the burst's first prompts as they are, "
                               "no flush: with a burst larger than the device KV pool their prefixes were evicted to "
                               "HiCache's host pool and are loaded back (needs after >= 1)")

    @model_validator(mode="after")
    def _warm_needs_after(self) -> "Workload":
        if self.warm_storage is not None and self.after < 1:
            raise ValueError("warm_storage repeats burst prompts as the 'after' requests: set after >= 1 (e.g. after = 4)")
        if self.repeat_first and self.after < 1:
            raise ValueError("repeat_first repeats burst prompts as the 'after' requests: set after >= 1 (e.g. after = 4)")
        return self

    def request_plan(self, i: int, input_len: int, max_new_tokens: int) -> "RequestPlan":
        """Request ``i``'s shape under this workload (``input_len``/``max_new_tokens``: the burst's values)."""
        m = self.mix
        il = m.input_lens[i % len(m.input_lens)] if m and m.input_lens else input_len
        mn = m.max_new_tokens[i % len(m.max_new_tokens)] if m and m.max_new_tokens else max_new_tokens
        sp = dict(m.sampling[i % len(m.sampling)]) if m and m.sampling else {}
        ca = self.client_abort
        cut = ca.after_tokens if ca and i % ca.every == ca.offset % ca.every else None
        dl = self.deadlines
        deadline = dl.deadline_s if dl and i % dl.every == dl.offset % dl.every else None
        return RequestPlan(il, mn, sp, cut, deadline)


@dataclass(frozen=True)
class RequestPlan:
    """One request's shape: lengths, extra sampling parameters, abort after n tokens, client deadline (s)."""

    input_len: int
    max_new_tokens: int
    sampling: dict = field(default_factory=dict)
    abort_after_tokens: Optional[int] = None
    deadline_s: Optional[float] = None


def request_plans(count: int, input_len: int, max_new_tokens: int, workload: Optional[Workload]) -> list[RequestPlan]:
    """The plans of ``count`` burst requests plus the workload's ``after`` requests (plain, the burst's sizes)."""
    if workload is None:
        return [RequestPlan(input_len, max_new_tokens) for _ in range(count)]
    plans = [workload.request_plan(i, input_len, max_new_tokens) for i in range(count)]
    return plans + [RequestPlan(input_len, max_new_tokens) for _ in range(workload.after)]


def warm_prompts(prompts: Sequence[list[int]], workload: Optional[Workload]) -> list[list[int]]:
    """Under a ``warm_storage`` or ``repeat_first`` workload the last ``after`` prompts repeat the first ``after``
    burst prompts (their pages are then in storage, or in the host pool); otherwise the prompts unchanged."""
    out = [list(p) for p in prompts]
    if workload is None or (workload.warm_storage is None and not workload.repeat_first) or not workload.after:
        return out
    n_burst = len(out) - workload.after
    for k in range(workload.after):
        out[n_burst + k] = list(out[k % n_burst])
    return out


def make_prompts_for(plans: Sequence[RequestPlan], seed: int, token_range: tuple[int, int]) -> list[list[int]]:
    """Distinct token-id prompts of each plan's length, reproducible from ``seed`` (cf. ``driver.make_prompts``)."""
    rng = random.Random(seed)
    lo, hi = token_range
    seen: set[tuple[int, ...]] = set()
    out: list[list[int]] = []
    for plan in plans:
        while True:
            p = [rng.randrange(lo, hi) for _ in range(plan.input_len)]
            if tuple(p) not in seen:
                seen.add(tuple(p))
                out.append(p)
                break
    return out


def effective_sizes(burst: Any, workload: Optional[Workload]) -> tuple[int, int, int, int]:
    """(requests, concurrency, input_len, max_new_tokens) of a ``repro.scenario.Burst`` under ``workload``."""
    w = workload
    pick = (lambda name: getattr(w, name) if w is not None and getattr(w, name) is not None else getattr(burst, name))
    return pick("requests"), pick("concurrency"), pick("input_len"), pick("max_new_tokens")


# ------------------------------------------------------------------------------------------------- catalogue data
@dataclass(frozen=True)
class NemesisSpec:
    """One named workload of the workload file: what it says, its engine flags (``server_args``, set over the
    base scenario's; a flag already there takes the new value), the mass abort (``abort``, a
    :class:`MassAbort` table) and the driver's :class:`Workload`."""

    name: str
    says: str
    server_args: tuple[str, ...] = ()
    abort: Optional[dict] = None
    workload: Optional[Workload] = None
    expect_log: tuple[str, ...] = ()  # regexes the server log should show when the nemesis took effect (e.g. a retraction)


@dataclass(frozen=True)
class ServerConfig:
    """A server configuration axis: engine flags set over the base scenario's (``args``) or removed (``remove``,
    a flag and its value). ``needs``: flags the base must already have for the config to make sense."""

    name: str
    says: str
    args: tuple[str, ...] = ()
    remove: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()


@dataclass(frozen=True)
class NemesisCatalogue:
    """The workload file: workloads, configurations, and what the testbed cannot run (``not_run``: name → why)."""

    path: Path
    workloads: dict[str, NemesisSpec]
    configs: dict[str, ServerConfig]
    not_run: dict[str, str] = field(default_factory=dict)
    switches: frozenset[str] = frozenset()  # flags that take no value (for set_args/remove)

    def workload(self, name: str) -> NemesisSpec:
        if name == QUIET:
            return NemesisSpec(QUIET, "the base scenario's burst, no nemesis")
        if name not in self.workloads:
            why = f" ({self.not_run[name]})" if name in self.not_run else ""
            raise NemesisError(f"{self.path}: no workload {name!r}{why}; known: {', '.join([QUIET, *self.workloads])}")
        return self.workloads[name]

    def config(self, name: str) -> ServerConfig:
        if name not in self.configs:
            raise NemesisError(f"{self.path}: no configuration {name!r}; known: {', '.join(self.configs)}")
        return self.configs[name]


def _strs(v: Any, where: str) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(x, (str, int, float)) for x in v):
        raise NemesisError(f"{where}: expected a list of strings, e.g. [\"--chunked-prefill-size\", \"64\"]")
    return tuple(str(x) for x in v)


def load_nemeses(path: Path) -> NemesisCatalogue:
    """Read and check a workload file (``scenarios/sglang/hunt_workloads.toml``).

    Raises:
        NemesisError: missing file, bad TOML, or a bad field, named as ``workloads.NAME.field`` with what was expected.
    """
    p = Path(path)
    if not p.is_file():
        raise NemesisError(f"{p}: workload file not found (expected a TOML file like {EXAMPLES_DIR}/hunt_workloads.toml)")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise NemesisError(f"{p}: not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise NemesisError(f"{p}: not a UTF-8 text file (binary?); pass a TOML file like {EXAMPLES_DIR}/hunt_workloads.toml") from None
    wls: dict[str, NemesisSpec] = {}
    for name, spec in (data.get("workloads") or {}).items():
        where = f"{p}: workloads.{name}"
        if not re.fullmatch(r"[A-Za-z0-9_-]+", name) or name == QUIET:
            raise NemesisError(f"{where}: a workload name uses letters, digits, '_', '-' only and is not {QUIET!r}")
        if not isinstance(spec, dict):
            raise NemesisError(f"{where}: expected a table")
        unknown = sorted(set(spec) - {"says", "server_args", "abort", "workload", "expect_log"})
        if unknown:
            raise NemesisError(f"{where}: unknown field(s) {unknown}; expected says, server_args, abort, workload, expect_log")
        part = "abort"  # the table whose error it is (an abort error was named workload.* when both were set)
        try:
            abort = MassAbort.model_validate(spec["abort"]).model_dump() if spec.get("abort") is not None else None
            part = "workload"
            wl = Workload.model_validate(spec["workload"]) if spec.get("workload") is not None else None
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"])
            raise NemesisError(f"{where}.{part}{'.' + loc if loc else ''}: {err['msg']}") from None
        wls[name] = NemesisSpec(name, str(spec.get("says", name)), _strs(spec.get("server_args"), f"{where}.server_args"),
                                abort, wl, _strs(spec.get("expect_log"), f"{where}.expect_log"))
    cfgs: dict[str, ServerConfig] = {}
    for name, spec in (data.get("configs") or {}).items():
        where = f"{p}: configs.{name}"
        if not re.fullmatch(r"[A-Za-z0-9_-]+", name) or not isinstance(spec, dict):
            raise NemesisError(f"{where}: expected a table named with letters, digits, '_', '-'")
        unknown = sorted(set(spec) - {"says", "args", "remove", "needs"})
        if unknown:
            raise NemesisError(f"{where}: unknown field(s) {unknown}; expected says, args, remove, needs")
        cfgs[name] = ServerConfig(name, str(spec.get("says", name)), _strs(spec.get("args"), f"{where}.args"),
                                  _strs(spec.get("remove"), f"{where}.remove"), _strs(spec.get("needs"), f"{where}.needs"))
    not_run = {str(k): str(v) for k, v in (data.get("not_run") or {}).items()}
    switches = frozenset(_strs(data.get("switches"), f"{p}: switches"))
    return NemesisCatalogue(p, wls, cfgs, not_run, switches)


def default_workload_file(catalogue_path: Path) -> Path:
    """The workload file beside an adapter's hunt catalogue (``hunt_workloads.toml``)."""
    return Path(catalogue_path).with_name("hunt_workloads.toml")


# ----------------------------------------------------------------------------------------------- engine flags
def _split(args: Sequence[str], switches: frozenset[str]) -> list[tuple[str, Optional[str]]]:
    """``["--a", "1", "--b", "--c", "x"]`` → ``[("--a","1"), ("--b",None), ("--c","x")]`` (switches take no value)."""
    out: list[tuple[str, Optional[str]]] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("--") and "=" in a:
            k, v = a.split("=", 1)
            out.append((k, v))
            i += 1
        elif a.startswith("--") and a not in switches and i + 1 < len(args) and not args[i + 1].startswith("--"):
            out.append((a, args[i + 1]))
            i += 2
        else:
            out.append((a, None))
            i += 1
    return out


def set_args(base: Sequence[str], new: Sequence[str], remove: Sequence[str] = (),
             switches: frozenset[str] = frozenset()) -> list[str]:
    """Engine flags ``base`` with each flag of ``new`` set (replacing the base's value, else appended) and each
    flag of ``remove`` dropped (with its value). Order of the base is kept."""
    pairs = [kv for kv in _split(list(base), switches) if kv[0] not in set(remove)]
    for k, v in _split(list(new), switches):
        idx = next((i for i, (bk, _) in enumerate(pairs) if bk == k), None)
        if idx is None:
            pairs.append((k, v))
        else:
            pairs[idx] = (k, v)
    out: list[str] = []
    for k, v in pairs:
        out.append(k)
        if v is not None:
            out.append(v)
    return out


@dataclass(frozen=True)
class ServerGroup:
    """Workloads that run on one server: the configuration, the engine flags, the workloads (in order)."""

    config: str
    args: tuple[str, ...]
    workloads: tuple[str, ...]

    @property
    def label(self) -> str:
        return self.config if len(self.workloads) != 1 or self.workloads == (QUIET,) else f"{self.config}-{self.workloads[0]}"


def config_args(base_args: Sequence[str], cat: NemesisCatalogue, config: Optional[str]) -> list[str]:
    """The base scenario's flags under a configuration (``None`` / ``"base"``: as they are).

    Raises:
        NemesisError: the configuration needs a flag the base scenario lacks (says which, and the fix).
    """
    if not config or config == "base":
        return list(base_args)
    c = cat.config(config)
    missing = [f for f in c.needs if f not in base_args]
    if missing:
        raise NemesisError(f"{cat.path}: configs.{c.name} needs {missing} in the base scenario's server.args "
                           f"(it changes how that feature behaves); choose a base scenario with them or drop --config {c.name}")
    return set_args(base_args, c.args, c.remove, cat.switches)


def server_groups(base_args: Sequence[str], cat: NemesisCatalogue, configs: Sequence[str],
                  workloads: Sequence[str]) -> list[ServerGroup]:
    """One group per configuration × distinct engine flags: workloads whose flags agree share a server.

    ``configs``: configuration names (``"base"`` = the base scenario as it is); ``workloads``: names (``quiet``
    first when listed). Groups keep the order of ``configs``, then of each group's first workload.
    """
    groups: list[ServerGroup] = []
    for c in configs:
        cargs = config_args(base_args, cat, c)
        by: dict[tuple[str, ...], list[str]] = {}
        for w in workloads:
            spec = cat.workload(w)
            by.setdefault(tuple(set_args(cargs, spec.server_args, (), cat.switches)), []).append(w)
        groups += [ServerGroup(c or "base", k, tuple(v)) for k, v in by.items()]
    return groups
