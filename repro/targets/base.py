"""What the harness needs to know about a serving engine, independent of which engine it is: the engine seam.

An adapter turns a :class:`LaunchSpec` into a command line and environment, knows the HTTP endpoints and request /
response shapes, maps process titles to ranks (:class:`RankTitle`, the ONE title parser of its engine), names the
function its scheduler calls once per tick, and carries the data the engine-neutral modules read instead of naming
engine internals: :class:`FrameRules` (analysis), :class:`InjectorProfile` (the plan → the injector),
:class:`RefLocation` (compare), the hunt catalogue and :class:`WatchDefaults` (watch). The harness never imports the
engine: everything engine-specific goes through an adapter in ``repro/targets/`` (SGLang: ``repro.targets.sglang``).

How to add an engine (see ``docs/adapters.md``):

1. subclass :class:`AdapterBase` (defaults for everything but launch, HTTP shapes and :meth:`AdapterBase.parse_title`),
   fill its data attributes;
2. register it: ``repro.targets.registry.register("name", factory)`` in code, or an entry point in the group
   ``repro.adapters`` (``name = "pkg.module:AdapterClass"``) in your package's ``pyproject.toml``;
3. scenarios select it with ``[server] adapter = "name"``.

Topologies: a scenario's server is one engine server by default (:meth:`AdapterBase.topology` →
:meth:`Topology.single`). An engine that serves one endpoint from several servers (prefill + decode + router)
returns a :class:`Topology` with one :class:`ServerRole` per server: each role says its kind (``engine`` servers
have ranks to capture, a ``router`` has none), its own extra flags / env / TP size, and which role receives the burst
(``Topology.entry``). The launcher starts the roles in order, waits for every role's health, and the session
captures every role that has ranks (rank processes named apart by role, e.g. ``prefill`` TP k and ``decode`` TP k).
"""

from __future__ import annotations

from dataclasses import dataclass, field
import json
import os
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Protocol, Sequence, Union, runtime_checkable

from repro.procs import ProcInfo
from repro.targets.release_data import EngineReleases, adapter_releases


@dataclass(frozen=True)
class LaunchSpec:
    """How to start one server.

    Attributes:
        python: interpreter that runs the server (see ``repro.interpreter.choose_python``).
        model: model path or hub id (the CPU testbed's tiny model for tests).
        tp_size: tensor-parallel world size (one scheduler process per TP rank).
        host: bind address of the HTTP server.
        port: HTTP port; 0 = pick a free one at launch.
        nccl_port: port of the torch.distributed rendezvous (gloo/NCCL); 0 = pick a free one at launch.
        args: extra engine flags, passed through verbatim after the adapter's own.
        env: extra environment variables for the server (override the inherited ones).
        pythonpath_prepend: folders put first on the server's PYTHONPATH (stand-ins, injector, overlays), in order.
    """

    python: str
    model: str
    tp_size: int = 2
    host: str = "127.0.0.1"
    port: int = 0
    nccl_port: int = 0
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    pythonpath_prepend: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Copy the containers so a caller mutating its own list later cannot change a frozen spec.
        object.__setattr__(self, "args", [str(a) for a in self.args])
        object.__setattr__(self, "pythonpath_prepend", [str(p) for p in self.pythonpath_prepend])
        object.__setattr__(self, "env", {str(k): str(v) for k, v in self.env.items()})
        if self.tp_size < 1:
            raise ValueError(f"LaunchSpec.tp_size must be >= 1, got {self.tp_size}")
        for name in ("port", "nccl_port"):
            v = getattr(self, name)
            if not 0 <= v <= 65535:
                raise ValueError(f"LaunchSpec.{name} must be 0 (pick a free port) or 1..65535, got {v}")


@dataclass(frozen=True)
class StreamUpdate:
    """Progress of one request, from one streamed chunk or a whole non-stream response.

    Attributes:
        output_ids: total number of output token ids generated so far (cumulative, not the chunk's); None for the
            stream's end marker (``[DONE]``), which carries no count.
        finish_reason: the engine's finish reason type (e.g. ``"length"``, ``"stop"``, ``"abort"``) once finished,
            else None.
        done: the stream ended (``[DONE]``) or the response is final.
        error: error message the engine returned in the body, if any.
    """

    output_ids: Optional[int]
    finish_reason: Optional[str]
    done: bool
    error: Optional[str] = None


@dataclass(frozen=True)
class RankTitle:
    """What a rank process's title says about its place in the job (one parse of one title).

    Attributes:
        tp: rank in the TP group (0 when the title names no TP dimension, e.g. TP=1).
        pp: pipeline stage, or None when the title has no PP part.
        dp: data-parallel replica, or None when the title has no DP part.
        role: the process's role in its server (``scheduler`` for SGLang's rank processes, ``worker`` …).
        extra: other dimensions the engine writes (``{"EP": 0, "ATTN_CP": 1}``), name → index.
    """

    tp: int
    pp: Optional[int] = None
    dp: Optional[int] = None
    role: str = "scheduler"
    extra: Mapping[str, int] = field(default_factory=dict)

    def rank(self, tp_size: int = 1) -> int:
        """Global rank in a TP×PP layout: ``pp * tp_size + tp`` (``tp`` alone without a PP part).

        Args:
            tp_size: number of TP ranks per pipeline stage (only used with a PP part).
        """
        return (self.pp or 0) * max(1, tp_size) + self.tp


@dataclass(frozen=True)
class CommRule:
    """One frame → communication-layer rule of :class:`FrameRules` (first matching rule wins, in order).

    A frame matches when every given condition holds; an empty condition is not checked. Paths are the frame's
    module or file with ``/`` separators.

    Attributes:
        layer: the layer's name in reports (``broadcast_pyobj``, ``GroupCoordinator``, ``pynccl`` …).
        path_contains: some of these is a substring of the path.
        path_endswith: the path ends with one of these.
        basename_contains: the file's base name contains one of these.
        function_prefix: the (qualified) function name starts with one of these.
        function_suffix: the short function name ends with one of these.
        function_equals: the short function name is one of these.
    """

    layer: str
    path_contains: tuple[str, ...] = ()
    path_endswith: tuple[str, ...] = ()
    basename_contains: tuple[str, ...] = ()
    function_prefix: tuple[str, ...] = ()
    function_suffix: tuple[str, ...] = ()
    function_equals: tuple[str, ...] = ()

    def matches(self, path: str, basename: str, function: str, short_function: str) -> bool:
        """True when the frame (given by its path, base name, qualified and short function name) matches."""
        checks = (
            (self.path_contains, lambda: any(x in path for x in self.path_contains)),
            (self.path_endswith, lambda: path.endswith(self.path_endswith)),
            (self.basename_contains, lambda: any(x in basename for x in self.basename_contains)),
            (self.function_prefix, lambda: function.startswith(self.function_prefix)),
            (self.function_suffix, lambda: short_function.endswith(self.function_suffix)),
            (self.function_equals, lambda: short_function in self.function_equals),
        )
        given = [ok for cond, ok in checks if cond]
        return bool(given) and all(ok() for ok in given)


@dataclass(frozen=True)
class FrameRules:
    """What an engine's frames mean to the stack analysis (``repro.analysis`` reads these; it names no engine).

    Attributes:
        idle_waits: ``(path substring or base name, short function or None = any, wait kind)``: frames where the
            engine waits for work (checked after the generic Python waits: zmq, select, queue get, …).
        object_comm: rules for the engine's object-passing collectives, checked BEFORE ``torch.distributed``
            (e.g. ``broadcast_pyobj``, which wraps ``dist.broadcast``).
        comm_layers: rules for the engine's other communication layers, checked after ``torch.distributed``
            (device communicators, group coordinators).
        request_broadcast_layers: ``via`` layers of the request broadcast (``broadcast_pyobj``).
        request_broadcast_callers: caller functions of the request broadcast (an idle rank waits there).
        idle_loop_callers: caller functions of the scheduler's idle path (the idle sleep).
        spin_waits: rules for frames that wait for a peer by spinning on the CPU (vLLM's CPU shm ops, NCCL's proxy
            loop): a hot rank whose innermost frames match one, unchanged across two captures, is blocked, not busy.
    """

    idle_waits: tuple[tuple[str, Optional[str], str], ...] = ()
    object_comm: tuple[CommRule, ...] = ()
    comm_layers: tuple[CommRule, ...] = ()
    request_broadcast_layers: frozenset = frozenset()
    request_broadcast_callers: frozenset = frozenset()
    idle_loop_callers: frozenset = frozenset()
    spin_waits: tuple[CommRule, ...] = ()

    def merged(self, other: "FrameRules") -> "FrameRules":
        """These rules followed by ``other``'s (for reading dumps of any registered engine)."""
        return FrameRules(
            idle_waits=self.idle_waits + tuple(x for x in other.idle_waits if x not in self.idle_waits),
            object_comm=self.object_comm + tuple(x for x in other.object_comm if x not in self.object_comm),
            comm_layers=self.comm_layers + tuple(x for x in other.comm_layers if x not in self.comm_layers),
            request_broadcast_layers=self.request_broadcast_layers | other.request_broadcast_layers,
            request_broadcast_callers=self.request_broadcast_callers | other.request_broadcast_callers,
            idle_loop_callers=self.idle_loop_callers | other.idle_loop_callers,
            spin_waits=self.spin_waits + tuple(x for x in other.spin_waits if x not in self.spin_waits),
        )


@dataclass(frozen=True)
class EngineDumpRules:
    """How the engine's own state dumps look in its log, for ``repro analyze`` (``repro.readers.engine_records``
    reads them; it names no engine). A *block* is a per-rank record of several lines: a header line (its rank from
    the log prefix, ``repro.readers.prefixes``) and figure lines under it until a line that is none; an *event* is
    one line (a checker's verdict, a leak error) carrying its rank in its log prefix.

    Attributes:
        engine: the engine's name, for messages (``sglang 0.5.23``).
        block_header: regex of a block's header text (after the log prefix); its ``name`` group names the block
            (``Scheduler debug info``).
        block_figures: ``(group, regex)``: a figure line inside a block; ``group`` prefixes the figures it holds
            (``full`` → ``full.available``). A regex with a ``value`` group holds one figure named ``group``; one
            with a ``pairs`` group holds ``key=value, key=value`` figures; one with a ``members`` group holds a list
            whose ids are ``member_id`` matches (compared as a set, its size the figure).
        member_id: regex with one group: an id inside a ``members`` list (``rid=(...)``).
        events: ``(kind, label, regex)``: a one-line event; ``label`` is its name for people, the regex's named
            groups are its figures.
        timeout_line: regex of the line the engine prints after a block (not a record; counted per rank).
        gate_substrings: at least one is in every header, event and timeout line (a cheap test per log line).
    """

    engine: str = ""
    block_header: str = ""
    block_figures: tuple[tuple[str, str], ...] = ()
    member_id: str = ""
    events: tuple[tuple[str, str, str], ...] = ()
    timeout_line: str = ""
    gate_substrings: tuple[str, ...] = ()


@dataclass(frozen=True)
class InjectorProfile:
    """What the injector needs to know about the engine, carried to it in the plan (the injector never imports
    ``repro``): the plan's ``ledger`` gets ``coordinators``, ``alias_prefixes`` and ``comm_module_prefixes``.

    Attributes:
        coordinators: ``module:Class`` of the engine's process-group wrappers whose methods are recorded too
            (their device paths can bypass ``torch.distributed``).
        alias_prefixes: module-name prefixes whose ``from torch.distributed import all_reduce`` copies are rebound.
        comm_module_prefixes: module-name prefixes of the engine's communication layers (never a call site).
        fork_caller: ``module:function`` of the engine's launcher whose ``multiprocessing.set_start_method("spawn")``
            call the injector may switch to ``fork`` under the ``REPRO_FORK_RANKS=1`` opt-in
            (``injectors/repro_injector/_fork.py``); "" = this engine's ranks are never forked.
        fork_device: ``local.attr`` path, in that function's frame, of the device the server runs on: the switch
            happens only when it is ``"cpu"`` (forking after CUDA initialisation is unsafe).
    """

    coordinators: tuple[str, ...] = ()
    alias_prefixes: tuple[str, ...] = ()
    comm_module_prefixes: tuple[str, ...] = ()
    fork_caller: str = ""
    fork_device: str = ""

    def to_plan(self) -> dict[str, list[str]]:
        """The plan's ``ledger`` keys: ``{"coordinators": [...], "alias_prefixes": [...], "comm_module_prefixes": [...]}``."""
        return {"coordinators": list(self.coordinators), "alias_prefixes": list(self.alias_prefixes),
                "comm_module_prefixes": list(self.comm_module_prefixes)}

    def fork_plan(self) -> dict[str, str]:
        """The plan's ``fork_ranks``: ``{"caller": "module:function", "device": "local.attr"}`` ({} without a caller)."""
        return {"caller": self.fork_caller, "device": self.fork_device} if self.fork_caller else {}


@dataclass(frozen=True)
class RefLocation:
    """Where the engine's Python package lives, for ``repro compare``'s REFs (installed / patch / git / python).

    Attributes:
        package: the importable top-level package (its folder is overlaid for ``patch:``).
        checkout_subdir: the folder of a source checkout that holds ``package/`` (put on PYTHONPATH for ``git:``);
            ``""`` when the package is at the checkout's root.
        version_key: the key of the engine's version in the injector's loaded markers / env.json.
    """

    package: str
    checkout_subdir: str = ""
    version_key: str = ""


@dataclass(frozen=True)
class WatchDefaults:
    """What ``repro watch`` assumes about a live server of this engine when not told otherwise.

    Attributes:
        title_match: a piece of every rank process's title (used to find ranks on this host).
        title_example: a rank title for messages (``sglang::scheduler_TP<k>``).
        health_timeout_s: seconds a ``/health`` probe may take (above the engine's own health timeout).
        metrics_path: Prometheus endpoint kept raw in the evidence.
        metrics_note: why that endpoint may not answer 200 (kept with the evidence when it does not), "" = none.
    """

    title_match: str
    title_example: str = ""
    health_timeout_s: float = 25.0
    metrics_path: str = "/metrics"
    metrics_note: str = ""


ServerKind = Literal["engine", "router"]


@dataclass(frozen=True)
class ServerRole:
    """One server of a :class:`Topology`.

    Attributes:
        name: the role's name, unique in the topology (``server`` for a single server; ``prefill``, ``decode``,
            ``router`` for PD disaggregation); names the role's evidence sub-folder and its ranks in reports.
        kind: ``engine`` (has rank processes to capture, takes the injector) or ``router`` (no ranks).
        tp_size: TP size of this role (None: the scenario's ``server.tp_size``).
        args: extra engine flags for this role only (after the scenario's), e.g. ``--disaggregation-mode prefill``.
        env: extra environment for this role only.
    """

    name: str
    kind: ServerKind = "engine"
    tp_size: Optional[int] = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Topology:
    """The servers one scenario runs, in start order, and the role that receives the burst.

    Single-server (the default, :meth:`single`): one ``engine`` role named ``server``. A multi-server topology
    lists every role (e.g. prefill, decode, router with ``entry="router"``); roles are started in order.

    Raises:
        ValueError: role names repeat, or ``entry`` names no role.
    """

    roles: tuple[ServerRole, ...]
    entry: str = "server"

    def __post_init__(self) -> None:
        names = [r.name for r in self.roles]
        if len(set(names)) != len(names):
            raise ValueError(f"Topology role names repeat: {names}")
        if self.entry not in names:
            raise ValueError(f"Topology.entry {self.entry!r} names no role ({', '.join(names)})")

    @classmethod
    def single(cls, tp_size: Optional[int] = None) -> "Topology":
        """One engine server, the burst sent to it."""
        return cls((ServerRole("server", "engine", tp_size),), "server")

    @property
    def is_single(self) -> bool:
        return len(self.roles) == 1

    def engines(self) -> list[ServerRole]:
        """The roles with rank processes (to capture, to arm), in start order."""
        return [r for r in self.roles if r.kind == "engine"]

    def role(self, name: str) -> ServerRole:
        """The role named ``name``. Raises KeyError naming the roles there are."""
        for r in self.roles:
            if r.name == name:
                return r
        raise KeyError(f"no role {name!r} in the topology ({', '.join(r.name for r in self.roles)})")


@runtime_checkable
class Adapter(Protocol):
    """Engine adapter: the one place that knows an engine (see the module docstring; :class:`AdapterBase` gives
    defaults for everything but the launch command, the HTTP shapes and :meth:`parse_title`)."""

    name: str
    health_path: str
    generate_path: str
    tick_function: str
    frame_rules: FrameRules
    injector_profile: InjectorProfile
    ref_location: RefLocation
    watch_defaults: WatchDefaults
    hunt_catalogue: Optional[Path]
    discover_rules: Optional[Path]
    demo_scenario: Optional[Path]
    title_namespace: str
    engine_dump_rules: Optional[EngineDumpRules]
    releases_dir: Optional[Path]

    def launch_command(self, spec: LaunchSpec) -> list[str]:
        """argv that starts the server (``spec.port``/``nccl_port`` must already be concrete, not 0)."""

    def launch_env(self, spec: LaunchSpec, base_env: dict[str, str]) -> dict[str, str]:
        """Environment for the server: ``base_env`` + ``spec.env`` with ``spec.pythonpath_prepend`` first."""

    def generate_body(self, input_ids: Sequence[int], max_new_tokens: int, stream: bool) -> dict[str, Any]:
        """JSON body of a greedy generate request producing exactly ``max_new_tokens`` ids."""

    def parse_stream_line(self, line: Union[bytes, str]) -> Optional[StreamUpdate]:
        """Parse one line of a streamed response; None for lines that carry no update."""

    def parse_response(self, body: Any) -> StreamUpdate:
        """Parse a whole non-stream response body (decoded JSON)."""

    def parse_title(self, title: str) -> Optional[RankTitle]:
        """The ONE title parser of this engine: a rank process's title → :class:`RankTitle`, else None."""

    def rank_of_title(self, title: str) -> Optional[int]:
        """TP rank of a process from its title, or None when it is not a rank process."""

    def rank_pids(self, procs: Sequence[ProcInfo]) -> dict[int, int]:
        """rank -> pid for the rank processes among ``procs``."""

    def tick_function_for(self, args: Sequence[str]) -> str:
        """``module:qualname`` called once per scheduler tick by a server started with ``args``."""

    def topology(self, server: Any) -> Topology:
        """The servers a scenario's ``[server]`` table runs (default :meth:`Topology.single`)."""

    def testbed_profile(
        self, spec: LaunchSpec, scenario_args: Sequence[str]
    ) -> tuple[list[str], dict[str, str], list[str]]:
        """(extra args, extra env, PYTHONPATH prepend) to run this engine on the CPU testbed."""

    def owned_dirs(self, env: dict[str, str]) -> list[Path]:
        """Folders a server launched with ``env`` owns (removed after it stops)."""

    def leftover_files(self, server_log: Path) -> list[Path]:
        """Files a stopped server left behind, found from its log."""

    def testbed_python(self) -> Optional[Path]:
        """The CPU testbed's interpreter when it is set up, else None (no testbed, or not set up)."""

    def testbed_model(self) -> Optional[Path]:
        """The CPU testbed's tiny model, else None."""

    def testbed_setup_command(self) -> str:
        """The command that sets up the CPU testbed ("" without one)."""

    def with_sampling(self, body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        """``body`` with extra sampling parameters; ValueError when the engine adds none."""

    def router_workers(self, url: str, timeout_s: float = 2.0) -> Optional[list]:
        """The workers behind a router at ``url``, else None."""

    def multinode(self, nnodes: int, node_rank: int, dist_init_addr: str, host_ip: str = "",
                  ifname: Optional[str] = None) -> Optional[tuple[list[str], dict[str, str]]]:
        """(args, env) of one node of a server spanning hosts; None when the engine cannot."""

    def state_probe_plan(self) -> Optional[dict[str, Any]]:
        """The plan's lockstep state probes per release, else None."""


def flag_value(args: Sequence[str], flag: str) -> Optional[str]:
    """The value of ``flag`` in an argv list (``--f v`` or ``--f=v``), else None."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


class AdapterBase:
    """Defaults for an :class:`Adapter`: generic environment, ranks from :meth:`parse_title`, one tick function,
    a single-server topology, no CPU testbed, no router, no multi-node launch, no sampling parameters, no hunt
    catalogue / discover rules / demo, no release data. Subclasses set the data attributes and override what
    differs; the harness calls every hook plainly (docs/adapters.md lists them with their defaults)."""

    name = ""
    health_path = "/health"
    generate_path = "/generate"
    tick_function = ""
    frame_rules = FrameRules()
    engine_dump_rules: Optional[EngineDumpRules] = None  # the engine's own state dumps in its log (repro analyze)
    injector_profile = InjectorProfile()
    ref_location = RefLocation(package="")
    watch_defaults = WatchDefaults(title_match="")
    hunt_catalogue: Optional[Path] = None
    discover_rules: Optional[Path] = None  # `repro discover`'s rules (None: discover_rules.toml next to the catalogue)
    demo_scenario: Optional[Path] = None  # the scenario `repro demo` runs (None: this engine has no demo)
    title_namespace = ""  # prefix of every process title the engine sets (``sglang::``); "" = none
    # ``module:qualname`` globs of the engine's storage backend methods: the only sites where the natural storage
    # actions ``miss`` / ``fail`` are an answer from outside the replicated state (repro.scenario.storage_action_problem)
    storage_sites: tuple[str, ...] = ()

    @staticmethod
    def check_generate_args(input_ids: Sequence[int], max_new_tokens: int) -> None:
        """The arguments every engine's ``generate_body`` refuses.

        Raises:
            ValueError: empty ``input_ids`` or ``max_new_tokens < 1``.
        """
        if not input_ids:
            raise ValueError("generate_body: input_ids must not be empty")
        if max_new_tokens < 1:
            raise ValueError(f"generate_body: max_new_tokens must be >= 1, got {max_new_tokens}")

    def parse_stream_line(self, line: Union[bytes, str]) -> Optional[StreamUpdate]:
        """One line of a server-sent-events stream (both SGLang's ``/generate`` and vLLM's ``/v1/completions``
        stream this way): ``data: {...}`` → ``self._update(body, done=False)`` (the engine's chunk reader),
        ``data: [DONE]`` → done with ``output_ids=None`` (the previous count stands); an unparseable chunk → done
        with an error; blank, comment and other lines → None."""
        if isinstance(line, bytes):
            line = line.decode("utf-8", errors="replace")
        line = line.strip()
        if not line.startswith("data:"):
            return None
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            return StreamUpdate(output_ids=None, finish_reason=None, done=True)
        try:
            body = json.loads(payload)
        except json.JSONDecodeError:
            return StreamUpdate(0, None, True, error=f"unparseable stream chunk: {payload[:200]}")
        if not isinstance(body, dict):
            return None
        return self._update(body, done=False)

    @staticmethod
    def _update(body: dict[str, Any], done: bool) -> StreamUpdate:  # pragma: no cover - engines with a stream override it
        """One decoded response or stream chunk → :class:`StreamUpdate` (the engine's answer shape)."""
        raise NotImplementedError("this adapter reads no generate responses")

    def parse_title(self, title: str) -> Optional[RankTitle]:  # pragma: no cover - every engine overrides it
        raise NotImplementedError(f"adapter {self.name!r} does not parse process titles")

    def rank_of_title(self, title: str) -> Optional[int]:
        """TP rank from :meth:`parse_title` (None for a process that is not a rank)."""
        t = self.parse_title(title)
        return None if t is None else t.tp

    def rank_pids(self, procs: Sequence[ProcInfo]) -> dict[int, int]:
        """rank → pid of the rank processes among ``procs`` (titles from ``/proc/PID/cmdline``).

        The rank is :meth:`RankTitle.rank` with tp_size = the number of distinct TP ranks seen (TP and TP×PP
        layouts).

        Raises:
            ValueError: two processes map to the same rank (e.g. several DP replicas); names both titles.
        """
        parsed = [(p, self.parse_title(p.title)) for p in procs]
        parsed = [(p, t) for p, t in parsed if t is not None]
        tp_size = len({t.tp for _, t in parsed}) or 1
        out: dict[int, int] = {}
        titles: dict[int, str] = {}
        for p, t in parsed:
            rank = t.rank(tp_size)
            if rank in out and out[rank] != p.pid:
                raise ValueError(
                    f"two {t.role} processes map to rank {rank}: {titles[rank]!r} (pid {out[rank]}) and "
                    f"{p.title!r} (pid {p.pid}); rank mapping supports TP and TP×PP layouts only"
                )
            out[rank] = p.pid
            titles[rank] = p.title
        return dict(sorted(out.items()))

    def state_probe_plan(self) -> Optional[dict[str, Any]]:
        """The plan's lockstep state probes per release: every release file's ``[state]`` in :attr:`releases_dir`
        (``EngineReleases.plan_probes``; the injector picks the installed release's list). None: this engine
        declares none (no digest).

        Raises:
            ReleaseDataError: a release file fails its schema (names the file and the field).
        """
        data = self.release_data()
        return None if data is None else data.plan_probes(self.ref_location.package or self.name)

    def release_data(self) -> Optional["EngineReleases"]:
        """This engine's per-release data (:attr:`releases_dir`: the release index, CPU compatibility, site
        alternatives and state probes per release), or None when it has none.

        Raises:
            ReleaseDataError: a file fails its schema (names the file and the field).
        """
        return adapter_releases(self)

    def tick_function_for(self, args: Sequence[str]) -> str:
        """The per-tick function (the same for every ``args`` unless the engine overrides this)."""
        return self.tick_function

    def topology(self, server: Any) -> Topology:
        """A single server of ``server.tp_size`` ranks."""
        return Topology.single(getattr(server, "tp_size", None))

    def launch_env(self, spec: LaunchSpec, base_env: dict[str, str]) -> dict[str, str]:
        """``base_env`` updated with ``spec.env``; PYTHONPATH = ``spec.pythonpath_prepend`` first, then the rest.

        The rest is ``spec.env["PYTHONPATH"]`` if given, else ``base_env["PYTHONPATH"]``. Also sets
        ``PYTHONUNBUFFERED=1`` so the server log is written as it happens.
        """
        env = dict(base_env)
        env.update(spec.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        parts: list[str] = []
        for p in [*spec.pythonpath_prepend, *rest]:
            if p not in parts:
                parts.append(p)
        if parts:
            env["PYTHONPATH"] = os.pathsep.join(parts)
        else:
            env.pop("PYTHONPATH", None)
        return env

    def testbed_profile(self, spec: Optional[LaunchSpec], scenario_args: Sequence[str],
                        storage_dir: Optional[str] = None) -> tuple[list[str], dict[str, str], list[str]]:
        """Nothing to add (an engine with a CPU testbed overrides this)."""
        return [], {}, []

    def owned_dirs(self, env: dict[str, str]) -> list[Path]:
        """No folders of its own."""
        return []

    def leftover_files(self, server_log: Path) -> list[Path]:
        """Files a stopped server of this engine left behind, found from its log (removed after every stop, also
        by ``repro cleanup``); only the ones the server that wrote ``server_log`` created. Default: none."""
        return []

    # ---- the CPU testbed of this engine (``repro.interpreter.choose_python``, ``repro.runner.prepare``) ---------
    # The base adapter has none: an engine with a CPU testbed overrides all three (SGLang: repro.targets.sglang.testbed).
    def testbed_python(self) -> Optional[Path]:
        """The CPU testbed's interpreter for this engine when it is set up, else None (default: no testbed)."""
        return None

    def testbed_model(self) -> Optional[Path]:
        """The tiny model the CPU testbed serves when the scenario names none; None without a testbed."""
        return None

    def testbed_setup_command(self) -> str:
        """The command that sets up this engine's CPU testbed (for error messages); "" without a testbed."""
        return ""

    # ---- optional capabilities (the harness calls them plainly; the defaults say "this engine has none") --------
    def with_sampling(self, body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        """``body`` (from :meth:`generate_body`) with extra sampling parameters (a workload's ``mix.sampling``).

        Default: ``body`` unchanged when ``params`` is empty.

        Raises:
            ValueError: ``params`` is not empty and this engine adds none (names the adapter and the fix).
        """
        if not params:
            return body
        raise ValueError(f"workload.mix.sampling: the {self.name or type(self).__name__} adapter adds no sampling "
                         "parameters (no with_sampling); drop mix.sampling for this engine")

    def router_workers(self, url: str, timeout_s: float = 2.0) -> Optional[list]:
        """The workers behind a router of this engine at ``url`` (``repro watch`` on a router finds their ranks
        this way), else None. Default: None (no router)."""
        return None

    def multinode(self, nnodes: int, node_rank: int, dist_init_addr: str, host_ip: str = "",
                  ifname: Optional[str] = None) -> Optional[tuple[list[str], dict[str, str]]]:
        """(args to append, env to add) for node ``node_rank`` of one server spanning ``nnodes`` hosts
        (``repro.remote_run``); None: this engine cannot run one server across hosts (the default)."""
        return None

    # ---- releases (``repro.releases``): ``release:V`` REFs, ``--release``, reproduce's inference, bisect -------
    # The per-release data beside the adapter (``repro/targets/<engine>/releases/``: ``index.toml`` + ``<V>.toml``,
    # schema in ``repro.targets.release_data``); None: this engine has none (no index, no probes, no CPU data).
    releases_dir: Optional[Path] = None

    def release_testbed_dir(self, version: str) -> Path:
        """The folder where release ``version`` of this engine is set up (``venv/bin/python`` + ``.setup-stamp``):
        ``${XDG_CACHE_HOME:-~/.cache}/tp-deadlock-repro/testbed/<engine>-<version>``."""
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        return cache / "tp-deadlock-repro" / "testbed" / f"{self.name}-{version}"

    # ---- several servers (a Topology with more than one role): used by repro.pd ------------------------------
    def role_adapter(self, role: ServerRole) -> "AdapterBase":
        """The adapter that launches and talks to ``role``'s server (default: this one; a router has its own)."""
        return self

    def wire_roles(self, roles: Sequence[ServerRole], specs: dict[str, LaunchSpec], port: Any) -> dict[str, LaunchSpec]:
        """Connect the roles of a topology: given every role's spec with concrete ports (``port()`` picks another
        free port), return the specs with the flags that make them find each other (default: unchanged)."""
        return dict(specs)

    def stack_ready(self, router_url: str, engine_urls: Sequence[str]) -> tuple[bool, str]:
        """Whether the entry role (a router at ``router_url``) serves through every engine server; (ok, why not).
        Default: ready once every role's health answered."""
        return True, ""
