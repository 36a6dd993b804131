"""The SGLang adapter: command line, HTTP API, process titles and the CPU testbed profile (sglang 0.5.23).

Never imports sglang: the server runs under its own interpreter (``LaunchSpec.python``); everything here is strings,
JSON and process titles. Facts mirrored (read in the sglang 0.5.23 wheel):

- launch: ``python -m sglang.launch_server --model-path M --tp-size N --host H --port P --nccl-port Q …``;
- ``GET /health`` answers 200 once the warm-up request passed (503 while a generate is stuck for 20 s);
- ``POST /generate`` with ``{"input_ids": [...], "sampling_params": {...}, "stream": bool}``; the non-stream answer
  is ``{"output_ids": [...], "meta_info": {"finish_reason": {"type": "length", ...}, "completion_tokens": n}}``;
  streaming answers are SSE lines ``data: {same shape, output_ids cumulative}`` ending with ``data: [DONE]``;
- titles: ``srt/managers/scheduler.py`` ``run_scheduler_process`` calls
  ``setproctitle(f"sglang::scheduler{prefix}")`` with prefix built from ``_DP{d}``, ``_PP{p}``, ``_ATTN_CP{c}``,
  ``_MOE_DP{m}``, ``_TP{t}``, ``_EP{e}`` (each only when that dimension is in use); the detokenizer is
  ``sglang::detokenizer``; the HTTP/tokenizer process keeps its command line.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import repro.targets.sglang.testbed as testbed
from repro.procs import ProcInfo
from repro.targets.sglang.dumps import SGLANG_DUMP_RULES
from repro.targets.base import (
    AdapterBase,
    CommRule,
    FrameRules,
    InjectorProfile,
    LaunchSpec,
    RankTitle,
    RefLocation,
    StreamUpdate,
    WatchDefaults,
    flag_value,
)

TITLE_NAMESPACE = "sglang::"
SCHEDULER_TITLE_PREFIX = "sglang::scheduler"
HICACHE_FLAG = "--enable-hierarchical-cache"
HICACHE_STORAGE_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
HICACHE_TMP_PREFIX = "repro-hicache-"

# Title suffix tokens, e.g. "_DP0_PP1_TP3" -> {"DP": 0, "PP": 1, "TP": 3}. ATTN_CP / MOE_DP contain an underscore.
# The title is found as a whole word anywhere in the string (a platform may keep arguments after it, a log or a quote
# may put a prefix before it).
_TITLE_RE = re.compile(r"(?<![\w.:])sglang::scheduler((?:_(?:DP|PP|ATTN_CP|MOE_DP|TP|EP)\d+)*)(?!\w)")
_TOKEN_RE = re.compile(r"_(DP|PP|ATTN_CP|MOE_DP|TP|EP)(\d+)")

# Flags of the CPU testbed profile (docs/sglang.md, measured on sglang 0.5.23). (flag, value or None for a switch).
_CPU_FLAGS: tuple[tuple[str, Optional[str]], ...] = (
    ("--device", "cpu"),
    ("--attention-backend", "torch_native"),
    ("--sampling-backend", "pytorch"),
    ("--disable-cuda-graph", None),
    ("--disable-overlap-schedule", None),
    ("--max-total-tokens", "4096"),
    ("--max-running-requests", "8"),
    ("--context-length", "1024"),
    ("--sleep-on-idle", None),
    ("--load-format", "dummy"),
    ("--skip-tokenizer-init", None),
    # sglang's watchdog kills the whole tree after this many seconds of a stuck batch; the harness must capture
    # first, so keep it far above any budget_s (one day).
    ("--watchdog-timeout", "86400"),
    ("--random-seed", "0"),
)
# HiCache on the CPU testbed (docs/sglang.md, measured): the `direct` io backend with the compat layer's pure-torch ops.
_HICACHE_CPU_FLAGS: tuple[tuple[str, Optional[str]], ...] = (
    ("--hicache-io-backend", "direct"),
    ("--hicache-mem-layout", "layer_first"),
    ("--hicache-ratio", "2"),
    ("--hicache-storage-backend-extra-config", json.dumps({"prefetch_threshold": 16}, separators=(",", ":"))),
)
# PD disaggregation on the CPU testbed (measured with sglang 0.5.23, mooncake-transfer-engine-non-cuda 0.3.13.post1):
# Mooncake's transfer engine over TCP on 127.0.0.1 (no RDMA device), on both servers.
PD_MODE_FLAG = "--disaggregation-mode"
_PD_CPU_ENV: tuple[tuple[str, str], ...] = (
    ("MOONCAKE_PROTOCOL", "tcp"),
    ("MC_FORCE_TCP", "1"),
    ("SGLANG_HOST_IP", "127.0.0.1"),
)
# The decode server's default retraction backup (host_pool) registers host memory with CUDA and dies at start-up.
_PD_DECODE_CPU_FLAGS: tuple[tuple[str, Optional[str]], ...] = (
    ("--disaggregation-decode-retraction-backup", "cpu_tensor"),
)


@dataclass(frozen=True)
class SchedulerTitle:
    """A parsed scheduler title; each field is None when that dimension is absent from the title."""

    tp: Optional[int]
    dp: Optional[int] = None
    pp: Optional[int] = None
    ep: Optional[int] = None
    attn_cp: Optional[int] = None
    moe_dp: Optional[int] = None


def parse_scheduler_title(title: str) -> Optional[SchedulerTitle]:
    """Parse ``sglang::scheduler[_DP{d}][_PP{p}][_ATTN_CP{c}][_MOE_DP{m}][_TP{t}][_EP{e}]``; None if not a scheduler.

    Plain ``sglang::scheduler`` (TP=1) gives ``tp=0``. The title is one whitespace-separated word of ``title``
    (arguments a platform keeps after it, or a log prefix before it, are ignored). This is the one SGLang title
    parser: :meth:`SGLangAdapter.parse_title` and everything that reads titles (``repro.stacks``,
    ``repro.injection_records``, the watch) go through it via the adapter registry.
    """
    m = _TITLE_RE.search(title or "")
    if not m:
        return None
    tokens = {k: int(v) for k, v in _TOKEN_RE.findall(m.group(1))}
    return SchedulerTitle(
        tp=tokens.get("TP", 0),
        dp=tokens.get("DP"),
        pp=tokens.get("PP"),
        ep=tokens.get("EP"),
        attn_cp=tokens.get("ATTN_CP"),
        moe_dp=tokens.get("MOE_DP"),
    )


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


_flag_value = flag_value


def _add_missing(out: list[str], have: Sequence[str], flags: Sequence[tuple[str, Optional[str]]]) -> None:
    for flag, value in flags:
        if _has_flag(have, flag):
            continue
        out.append(flag)
        if value is not None:
            out.append(value)


# What sglang's frames mean to the stack analysis (checked in sglang 0.5.23): idle ranks sit in the request broadcast
# (``broadcast_pyobj`` ← ``_broadcast_reqs_across_ranks`` in managers/scheduler_components/request_receiver.py, or
# ``recv_requests`` before 0.5.21) or, with ``--sleep-on-idle``, in the IdleSleeper's zmq poll
# (``idle_sleeper.py`` ``maybe_sleep``, reached from ``on_idle`` / ``maybe_sleep_on_idle``); the collectives go
# through ``GroupCoordinator`` (distributed/parallel_state.py, communication_op.py) and the device communicators
# (distributed/device_communicators/: pynccl, custom_all_reduce, …).
FRAME_RULES = FrameRules(
    idle_waits=(("idle_sleeper.py", "maybe_sleep", "zmq poll/recv"),),
    object_comm=(
        CommRule("broadcast_pyobj", function_suffix=("broadcast_pyobj",)),  # also attn_cp_tp_broadcast_pyobj
        CommRule("point_to_point_pyobj", function_equals=("point_to_point_pyobj",)),
    ),
    comm_layers=(
        CommRule("pynccl", path_contains=("device_communicators/",), basename_contains=("pynccl",)),
        CommRule("custom_all_reduce", path_contains=("device_communicators/",), basename_contains=("custom_all_reduce",)),
        CommRule("device_communicator", path_contains=("device_communicators/",)),
        CommRule("GroupCoordinator", path_endswith=("distributed/parallel_state.py", "distributed/communication_op.py")),
        CommRule("GroupCoordinator", function_prefix=("GroupCoordinator.",)),
        CommRule("pynccl", function_prefix=("PyNcclCommunicator.", "NCCLLibrary.")),
    ),
    request_broadcast_layers=frozenset({"broadcast_pyobj"}),
    request_broadcast_callers=frozenset({"recv_requests", "_broadcast_reqs_across_ranks"}),
    idle_loop_callers=frozenset({"on_idle", "maybe_sleep_on_idle", "maybe_sleep"}),
)

# The injector's view of sglang (0.5.23): GroupCoordinator methods can bypass torch.distributed (pynccl, custom
# all-reduce; sglang #36802), sglang modules copy torch.distributed functions (``from torch.distributed import …``),
# and sglang.srt.distributed frames are communication plumbing, never a call site. The launcher's
# ``_set_envs_and_config`` (sglang/srt/entrypoints/engine.py, ~line 1995 in 0.5.23) calls
# ``mp.set_start_method("spawn", force=True)`` before the scheduler processes start; its ``server_args.device`` says
# the device (the fork-ranks opt-in, injectors/repro_injector/_fork.py).
INJECTOR_PROFILE = InjectorProfile(
    coordinators=("sglang.srt.distributed.parallel_state:GroupCoordinator",),
    alias_prefixes=("sglang.",),
    comm_module_prefixes=("sglang.srt.distributed",),
    fork_caller="sglang.srt.entrypoints.engine:_set_envs_and_config",
    fork_device="server_args.device",
)


class SGLangAdapter(AdapterBase):
    """Adapter for SGLang's HTTP server (``sglang.launch_server``), checked against sglang 0.5.23.

    Attributes:
        tick_function: ``module:qualname`` called exactly once per scheduler tick: ``event_loop_normal`` and
            ``event_loop_overlap`` each call ``Scheduler.get_next_batch_to_run`` once per loop iteration
            (sglang 0.5.23 ``srt/managers/scheduler.py``); :meth:`tick_function_for` picks the PD loops' own.
        frame_rules / injector_profile: see :data:`FRAME_RULES`, :data:`INJECTOR_PROFILE`.
        ref_location: the ``sglang`` package; a source checkout holds it in ``python/``.
        hunt_catalogue: ``scenarios/sglang/hunt_catalogue.toml``.
        watch_defaults: rank processes are titled ``sglang::scheduler…``; ``/health`` answers 503 after 20 s.
    """

    name = "sglang"
    health_path = "/health"
    generate_path = "/generate"
    tick_function = "sglang.srt.managers.scheduler:Scheduler.get_next_batch_to_run"
    # PD disaggregation replaces the event loop (sglang 0.5.23 srt/disaggregation/{prefill,decode}.py): its loops
    # call these once per tick instead (mixin methods of Scheduler), and never get_next_batch_to_run.
    disagg_tick_functions = {
        "prefill": "sglang.srt.disaggregation.prefill:SchedulerDisaggregationPrefillMixin.get_next_disagg_prefill_batch_to_run",
        "decode": "sglang.srt.disaggregation.decode:SchedulerDisaggregationDecodeMixin.get_next_disagg_decode_batch_to_run",
    }
    frame_rules = FRAME_RULES
    engine_dump_rules = SGLANG_DUMP_RULES  # its watchdog blocks, consensus checker and leak lines (dumps.py)
    injector_profile = INJECTOR_PROFILE
    # HiCache's L3 backends: HiCacheFile & co. in mem_cache/hicache_storage.py, the others under mem_cache/storage/
    # (0.5.23; each a HiCacheStorage subclass): `miss` / `fail` anywhere else would force the engine's bookkeeping
    storage_sites = ("sglang.srt.mem_cache.hicache_storage:*", "sglang.srt.mem_cache.storage.*:*")
    ref_location = RefLocation(package="sglang", checkout_subdir="python", version_key="sglang")

    @property
    def hunt_catalogue(self) -> Path:  # type: ignore[override]
        """``scenarios/sglang/hunt_catalogue.toml`` of a clone, or the installed wheel's copy (``repro.resources``)."""
        from repro import resources

        return resources.engine_file(self.name, "hunt_catalogue.toml")

    @property
    def demo_scenario(self) -> Path:  # type: ignore[override]
        """``scenarios/sglang/smoke_extra_allreduce.toml``: the scenario ``repro demo`` runs (its armed deadlock and
        its control)."""
        from repro import resources

        return resources.engine_file(self.name, "smoke_extra_allreduce.toml")

    @property
    def discover_rules(self) -> Path:  # type: ignore[override]
        """``scenarios/sglang/discover_rules.toml`` (``repro discover``'s rules), next to the hunt catalogue."""
        return self.hunt_catalogue.parent / "discover_rules.toml"

    watch_defaults = WatchDefaults(title_match=SCHEDULER_TITLE_PREFIX, title_example="sglang::scheduler_TP<k>",
                                   health_timeout_s=25.0, metrics_path="/metrics",
                                   metrics_note="sglang serves /metrics only with --enable-metrics")
    title_namespace = TITLE_NAMESPACE

    def topology(self, server: Any) -> "Topology":
        """``server.topology``: ``single`` (one server of ``tp_size`` ranks) or ``pd`` (prefill of ``tp_size`` ranks,
        decode, router: ``repro.targets.sglang.pd.pd_topology``).

        Raises:
            ValueError: another topology name (the message lists the known ones).
        """
        name = getattr(server, "topology", "single") or "single"
        if name == "single":
            return super().topology(server)
        from repro.targets.sglang.pd import PD_TOPOLOGY, pd_topology

        if name == PD_TOPOLOGY:
            return pd_topology(server)
        raise ValueError(f"server.topology {name!r} is not known to the sglang adapter; expected 'single' or 'pd'")

    def router_workers(self, url: str, timeout_s: float = 2.0) -> Optional[list]:
        """The workers of an SGLang router at ``url`` (``GET /workers``; ``repro.targets.sglang.pd.router_workers``),
        else None: ``repro watch`` on a PD router finds the ranks of every worker this way."""
        from repro.targets.sglang.pd import router_workers

        return router_workers(url, timeout_s)

    releases_dir = Path(__file__).resolve().parent / "releases"

    # ---- the CPU testbed (repro.targets.sglang.testbed; scripts/cpu_testbed/setup.sh) ------------------------
    def testbed_python(self) -> Optional[Path]:
        """The CPU testbed's interpreter when it is set up (python and ``.setup-stamp``), else None."""
        return testbed.testbed_python() if testbed.is_set_up() else None

    def testbed_model(self) -> Optional[Path]:
        """The config-only tiny Llama the testbed serves (``scripts/cpu_testbed/tiny_llama``)."""
        return testbed.tiny_model_dir()

    def testbed_setup_command(self) -> str:
        """``bash scripts/cpu_testbed/setup.sh`` in a clone (the bundled script's full path when installed)."""
        return testbed.setup_command()

    def release_testbed_dir(self, version: str) -> Path:
        """The CPU testbed's folder for the release it is written for (``repro.testbed.testbed_dir``, honouring
        ``$REPRO_TESTBED_DIR``), else ``<cache>/tp-deadlock-repro/testbed/sglang-<version>``."""
        if version == testbed.SGLANG_VERSION:
            return testbed.testbed_dir()
        return super().release_testbed_dir(version)

    def tick_function_for(self, args: Sequence[str]) -> str:
        """The per-tick function for a server started with ``args`` (``--disaggregation-mode`` picks the loop)."""
        mode = flag_value(args, "--disaggregation-mode")
        return self.disagg_tick_functions.get(mode or "", self.tick_function)

    def role_adapter(self, role: Any) -> Any:
        """The router role's adapter is sglang-router's (``repro.targets.sglang.pd.SGLangRouterAdapter``)."""
        if getattr(role, "kind", "engine") != "engine":
            from repro.targets.sglang.pd import SGLangRouterAdapter

            return SGLangRouterAdapter(self)
        return self

    def wire_roles(self, roles: Sequence[Any], specs: dict, port: Any) -> dict:
        """PD: the prefill server gets a bootstrap port (``--disaggregation-bootstrap-port``, unless given), the
        router the prefill URL + bootstrap port and the decode URL (``repro.targets.sglang.pd.router_args``)."""
        import dataclasses

        from repro.targets.sglang.pd import BOOTSTRAP_FLAG, MODE_FLAG, router_args

        out = dict(specs)
        prefill_url = decode_url = ""
        bootstrap = 0
        for r in roles:
            if getattr(r, "kind", "engine") != "engine" or r.name not in out:
                continue
            spec = out[r.name]
            mode = flag_value(spec.args, MODE_FLAG)
            if mode == "prefill":
                given = flag_value(spec.args, BOOTSTRAP_FLAG)
                bootstrap = int(given or 0) or port()
                if given is None:
                    spec = dataclasses.replace(spec, args=[*spec.args, BOOTSTRAP_FLAG, str(bootstrap)])
                prefill_url = f"http://127.0.0.1:{spec.port}"
            elif mode == "decode":
                decode_url = f"http://127.0.0.1:{spec.port}"
            out[r.name] = spec
        for r in roles:
            if getattr(r, "kind", "engine") == "engine" or r.name not in out:
                continue
            spec = out[r.name]
            out[r.name] = dataclasses.replace(spec, args=[*router_args(prefill_url, bootstrap, decode_url), *spec.args])
        return out

    def stack_ready(self, router_url: str, engine_urls: Sequence[str]) -> tuple[bool, str]:
        """The router's ``GET /workers`` lists every engine server healthy (it answers /health before that)."""
        from repro.targets.sglang.pd import router_workers, workers_ready

        workers = router_workers(router_url)
        return workers_ready({"workers": workers} if workers is not None else None, engine_urls)

    def parse_title(self, title: str) -> Optional[RankTitle]:
        """A scheduler title → RankTitle (role ``scheduler``; ATTN_CP / MOE_DP / EP in ``extra``), else None.

        ``sglang::scheduler_TP1`` → tp 1; ``…_PP1_TP0`` → pp 1, tp 0; plain ``sglang::scheduler`` (TP=1) → tp 0;
        ``sglang::detokenizer`` and the HTTP server's command line → None.
        """
        t = parse_scheduler_title(title)
        if t is None:
            return None
        extra = {k: v for k, v in (("ATTN_CP", t.attn_cp), ("MOE_DP", t.moe_dp), ("EP", t.ep)) if v is not None}
        return RankTitle(tp=t.tp or 0, pp=t.pp, dp=t.dp, role="scheduler", extra=extra)

    # ---- launching -------------------------------------------------------------------------------------------
    def launch_command(self, spec: LaunchSpec) -> list[str]:
        """argv: ``[python, -m, sglang.launch_server, --model-path, …, --tp-size, …, --host, --port, --nccl-port, *args]``.

        Raises:
            ValueError: ``spec.port`` or ``spec.nccl_port`` is still 0 (the launcher picks free ports first).
        """
        if spec.port == 0 or spec.nccl_port == 0:
            raise ValueError("launch_command needs concrete ports; start the server with repro.launcher.start_server")
        return [
            spec.python, "-m", "sglang.launch_server",
            "--model-path", spec.model,
            "--tp-size", str(spec.tp_size),
            "--host", spec.host,
            "--port", str(spec.port),
            "--nccl-port", str(spec.nccl_port),
            *spec.args,
        ]

    def multinode(self, nnodes: int, node_rank: int, dist_init_addr: str, host_ip: str = "",
                  ifname: Optional[str] = None) -> tuple[list[str], dict[str, str]]:
        """Flags and environment of one node of a server spanning ``nnodes`` hosts (``repro.remote_run``).

        sglang 0.5.23 (``srt/server_args.py``, ``srt/entrypoints/engine.py``, measured on the CPU testbed): every node
        runs ``launch_server`` with the same ``--tp-size`` and ``--nnodes N --node-rank K --dist-init-addr
        HOST0:PORT``; node 0 serves HTTP, nodes ≥ 1 run only their schedulers plus a dummy ``/health`` and ignore
        SIGTERM (node 0's shutdown stops them; end their process group after). Gloo binds the interface named by
        ``GLOO_SOCKET_IFNAME`` (else the hostname's address); ``SGLANG_HOST_IP`` is the address sglang advertises.

        Returns:
            (args to append, env to add).
        """
        args = ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--dist-init-addr", dist_init_addr]
        env = {"SGLANG_HOST_IP": host_ip} if host_ip else {}
        if ifname:
            env["GLOO_SOCKET_IFNAME"] = ifname
        return args, env

    def testbed_profile(
        self, spec: Optional[LaunchSpec], scenario_args: Sequence[str], storage_dir: Optional[str] = None
    ) -> tuple[list[str], dict[str, str], list[str]]:
        """What to add to run ``spec`` on the CPU testbed (docs/sglang.md). Scenario files stay CPU-free.

        Flags already present in ``scenario_args`` (or ``spec.args``) are not repeated, so a scenario's own value
        wins. With ``--enable-hierarchical-cache`` in the scenario args, also adds the HiCache CPU flags, sets
        ``REPRO_TESTBED_COMPAT=1`` (enables ``scripts/cpu_testbed/compat`` via the venv's .pth) and a file-storage
        folder in ``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``: ``storage_dir`` if given, else a new temporary
        folder named ``repro-hicache-*`` that :meth:`owned_dirs` reports so the launcher removes it at stop.
        A PD role (``--disaggregation-mode prefill|decode``) gets Mooncake over TCP (``MOONCAKE_PROTOCOL=tcp``,
        ``MC_FORCE_TCP=1``, ``SGLANG_HOST_IP=127.0.0.1``) and the compat layer (its Mooncake switch); the decode
        role also ``--disaggregation-decode-retraction-backup cpu_tensor`` (the default backup registers host memory
        with CUDA). See ``docs/pd.md``.

        ``spec`` may be None (the profile is then computed before the spec exists): the OpenMP bind list then
        covers up to 64 ranks (sglang only requires at least one entry per rank).

        Returns:
            (extra_args, extra_env, pythonpath_prepend): args to append, env to add, folders to put first on
            PYTHONPATH (the ``sgl_kernel`` stand-in).
        """
        spec_args = list(spec.args) if spec is not None else []
        spec_env = dict(spec.env) if spec is not None else {}
        n_ranks = spec.tp_size if spec is not None else 64
        have = [*spec_args, *scenario_args]
        args: list[str] = []
        _add_missing(args, have, _CPU_FLAGS)
        ncpu = os.cpu_count() or 1
        env = {
            "SGLANG_USE_CPU_ENGINE": "1",
            # With the CUDA torch wheel pynccl would load libnccl and fail on CPU tensors; a missing path disables it.
            "SGLANG_NCCL_SO_PATH": "/nonexistent/repro-no-nccl/libnccl.so",
            # One OpenMP core per rank, round-robin over the machine's cores ("0|1" for TP=2 on 2 cores).
            "SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(i % ncpu) for i in range(n_ranks)),
        }
        if spec is not None and spec.python:
            # A recipe-made testbed built sglang's JIT torch extensions in its own folder at set-up
            # (scripts/cpu_testbed/setup.sh): never compile (nor wait on a stale lock) in a shared one at run time.
            ext = Path(spec.python).parent.parent.parent / "torch_extensions"
            if ext.is_dir() and "TORCH_EXTENSIONS_DIR" not in spec_env:
                env["TORCH_EXTENSIONS_DIR"] = str(ext)
        pd_mode = flag_value(have, PD_MODE_FLAG)
        if pd_mode in ("prefill", "decode"):
            # The compat layer's Mooncake switch (MooncakeKVSender.supports_host_tensor_indices=False) and TCP.
            env.update(_PD_CPU_ENV)
            env[testbed.COMPAT_ENV] = "1"
            env[testbed.COMPAT_DIR_ENV] = str(testbed.compat_dir())
            if pd_mode == "decode":
                _add_missing(args, have, _PD_DECODE_CPU_FLAGS)
        if _has_flag(have, HICACHE_FLAG):
            _add_missing(args, have, _HICACHE_CPU_FLAGS)
            env[testbed.COMPAT_ENV] = "1"
            env[testbed.COMPAT_DIR_ENV] = str(testbed.compat_dir())
            given = storage_dir or spec_env.get(HICACHE_STORAGE_ENV)
            env[HICACHE_STORAGE_ENV] = given or tempfile.mkdtemp(prefix=HICACHE_TMP_PREFIX)
        return args, env, [str(testbed.stub_dir())]

    def owned_dirs(self, env: dict[str, str]) -> list[Path]:
        """Folders a server launched with ``env`` owns and that must be removed after it stops.

        Only the HiCache storage folder created by :meth:`testbed_profile` (a ``repro-hicache-*`` folder directly
        in the system temp dir); a user-given storage folder is never listed.
        """
        d = env.get(HICACHE_STORAGE_ENV)
        if not d:
            return []
        p = Path(d)
        if p.name.startswith(HICACHE_TMP_PREFIX) and p.parent == Path(tempfile.gettempdir()):
            return [p]
        return []

    # ---- requests --------------------------------------------------------------------------------------------
    def generate_body(self, input_ids: Sequence[int], max_new_tokens: int, stream: bool) -> dict[str, Any]:
        """Greedy request (temperature 0) that yields exactly ``max_new_tokens`` ids (``ignore_eos``).

        Raises:
            ValueError: empty ``input_ids`` or ``max_new_tokens < 1``.
        """
        self.check_generate_args(input_ids, max_new_tokens)
        return {
            "input_ids": [int(i) for i in input_ids],
            "sampling_params": {"max_new_tokens": int(max_new_tokens), "temperature": 0.0, "ignore_eos": True},
            "stream": bool(stream),
        }

    def with_sampling(self, body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        """``body`` (from :meth:`generate_body`) with extra sampling parameters (a workload's ``mix.sampling``,
        ``repro.nemeses``), e.g. ``{"temperature": 0.8, "top_p": 0.9}``; names as sglang 0.5.23's
        ``SamplingParams`` (``sglang/srt/sampling/sampling_params.py``). ``max_new_tokens``/``ignore_eos`` stay."""
        sp = {**body.get("sampling_params", {}), **params}
        sp["max_new_tokens"] = body.get("sampling_params", {}).get("max_new_tokens", sp.get("max_new_tokens"))
        sp["ignore_eos"] = True
        return {**body, "sampling_params": sp}

    def parse_response(self, body: Any) -> StreamUpdate:
        """Parse a non-stream ``/generate`` JSON answer (a dict, or a one-element list for batched input).

        ``output_ids`` = ``meta_info.completion_tokens`` when present, else ``len(output_ids)``.
        """
        if isinstance(body, list):
            if len(body) != 1:
                return StreamUpdate(0, None, True, error=f"expected one answer, got a list of {len(body)}")
            body = body[0]
        if not isinstance(body, dict):
            return StreamUpdate(0, None, True, error=f"unexpected /generate answer: {str(body)[:200]}")
        return self._update(body, done=True)

    @staticmethod
    def _update(body: dict[str, Any], done: bool) -> StreamUpdate:
        err = body.get("error")
        if isinstance(err, dict):
            err = err.get("message") or json.dumps(err)
        meta = body.get("meta_info") or {}
        ids = body.get("output_ids")
        n = meta.get("completion_tokens")
        if not isinstance(n, int):
            n = len(ids) if isinstance(ids, list) else 0
        fr = meta.get("finish_reason")
        reason = fr.get("type") if isinstance(fr, dict) else (fr if isinstance(fr, str) else None)
        if reason == "abort" and not err and isinstance(fr, dict):
            err = fr.get("message") or "aborted"
        return StreamUpdate(output_ids=n, finish_reason=reason, done=done or reason is not None,
                            error=str(err) if err else None)
