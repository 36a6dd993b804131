"""SGLang PD disaggregation: the prefill + decode + router topology and the router's adapter (sglang 0.5.23).

A scenario with ``[server] topology = "pd"`` runs three servers (``docs/pd.md``):

- ``prefill``: ``sglang.launch_server --disaggregation-mode prefill --disaggregation-bootstrap-port B`` with the
  scenario's ``tp_size`` (``server.roles.prefill`` may override it);
- ``decode``: ``--disaggregation-mode decode``, TP ``server.roles.decode.tp_size`` (default 1);
- ``router``: SGLang's router, ``python -m sglang_router.launch_router --pd-disaggregation --prefill URL B --decode
  URL`` (package ``sglang-router`` 0.3.2; sglang 0.5.23 has no in-tree load balancer). It receives the burst and
  forwards each request to both servers with a bootstrap room; the KV moves from prefill to decode over the
  transfer backend (Mooncake on TCP on the CPU testbed).

Facts mirrored (read in sglang 0.5.23 / sglang-router 0.3.2, measured on the CPU testbed):

- the Rust router answers ``GET /health`` 200 seconds before it has registered its workers; ``GET /workers``
  answers ``{"workers": [{"url", "worker_type": "prefill"|"decode", "is_healthy", "bootstrap_port"?, …}], …}``
  and the stack is ready only when it lists both servers healthy (a request sent before gets 503 "No prefill
  workers available");
- the router's ``/generate`` answers in the engine's shapes (non-stream JSON, SSE lines ending ``data: [DONE]``),
  forwarded from the decode server, so the SGLang adapter parses them;
- the router runs no rank processes (its title is its command line).

Never imports sglang or the router.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import requests

from repro.procs import ProcInfo
from repro.targets.base import AdapterBase, LaunchSpec, ServerRole, Topology, flag_value

PD_TOPOLOGY = "pd"
PREFILL, DECODE, ROUTER = "prefill", "decode", "router"
BOOTSTRAP_FLAG = "--disaggregation-bootstrap-port"
MODE_FLAG = "--disaggregation-mode"
TRANSFER_FLAG = "--disaggregation-transfer-backend"
DEFAULT_TRANSFER_BACKEND = "mooncake"
DEFAULT_DECODE_TP = 1
WORKERS_PATH = "/workers"
PROMETHEUS_PORT_FLAG = "--prometheus-port"  # the router's metrics listener (default 29000, one per machine)


def pd_topology(server: Any) -> Topology:
    """The three roles of a ``topology = "pd"`` server spec, in start order (prefill, decode, router).

    Args:
        server: the scenario's ``ServerSpec`` (``tp_size`` = the prefill TP; ``roles.{prefill,decode,router}``
            override ``tp_size`` and add ``args`` / ``env``).
    Returns:
        ``Topology((prefill, decode, router), entry="router")``; the engine roles' args start with
        ``--disaggregation-mode <role>`` and, unless the scenario names one, ``--disaggregation-transfer-backend
        mooncake``.
    """
    roles = dict(getattr(server, "roles", {}) or {})
    shared = list(getattr(server, "args", []) or [])

    def engine(name: str, tp_default: int) -> ServerRole:
        o = roles.get(name)
        args = [MODE_FLAG, name]
        extra = [*shared, *(o.args if o else [])]
        if flag_value(extra, TRANSFER_FLAG) is None:
            args += [TRANSFER_FLAG, DEFAULT_TRANSFER_BACKEND]
        tp = (o.tp_size if o and o.tp_size else None) or tp_default
        return ServerRole(name, "engine", tp, tuple([*args, *(o.args if o else [])]), dict(o.env) if o else {})

    r = roles.get(ROUTER)
    router = ServerRole(ROUTER, "router", None, tuple(r.args) if r else (), dict(r.env) if r else {})
    return Topology((engine(PREFILL, int(getattr(server, "tp_size", 1) or 1)), engine(DECODE, DEFAULT_DECODE_TP), router),
                    entry=ROUTER)


def router_args(prefill_url: str, bootstrap_port: int, decode_url: str) -> list[str]:
    """The router's worker arguments: ``--pd-disaggregation --prefill URL B --decode URL``."""
    return ["--pd-disaggregation", "--prefill", prefill_url, str(bootstrap_port), "--decode", decode_url]


def workers_ready(body: Any, want_urls: Sequence[str]) -> tuple[bool, str]:
    """Whether a router's ``GET /workers`` answer lists every URL in ``want_urls`` as healthy.

    Returns:
        (ready, what is missing in words, e.g. ``"http://127.0.0.1:31100 not registered"``; "" when ready).
    """
    workers = body.get("workers") if isinstance(body, dict) else None
    if not isinstance(workers, list):
        return False, f"unexpected /workers answer: {str(body)[:200]}"
    by_url = {str(w.get("url", "")).rstrip("/"): w for w in workers if isinstance(w, dict)}
    missing = []
    for u in want_urls:
        w = by_url.get(u.rstrip("/"))
        if w is None:
            missing.append(f"{u} not registered")
        elif not w.get("is_healthy", False):
            missing.append(f"{u} not healthy")
    return not missing, "; ".join(missing)


def router_workers(url: str, timeout_s: float = 2.0) -> Optional[list[dict]]:
    """The router's workers (``GET <url>/workers`` → ``workers``), or None when it does not answer that shape.

    Each item has at least ``url`` and ``worker_type`` (``prefill`` / ``decode``); prefill workers carry
    ``bootstrap_port``.
    """
    try:
        r = requests.get(url.rstrip("/") + WORKERS_PATH, timeout=timeout_s)
        body = r.json() if r.status_code == 200 else None
    except (requests.RequestException, ValueError):
        return None
    workers = body.get("workers") if isinstance(body, dict) else None
    return [w for w in workers if isinstance(w, dict)] if isinstance(workers, list) else None


class SGLangRouterAdapter(AdapterBase):
    """Adapter for SGLang's router (``sglang_router.launch_router``, sglang-router 0.3.2) as one role of a stack.

    It starts the router and parses the engine's HTTP shapes (the router forwards them); it has no rank processes.
    Every other hook is the base adapter's default (no testbed, no leftover files, no sampling parameters …).
    The launcher's second free port (``nccl_port``) becomes the router's ``--prometheus-port``: its default, 29000,
    is fixed, and a second stack on the machine died at start-up on it (measured: "failed to install Prometheus
    metrics exporter … Address already in use").
    """

    name = "sglang-router"
    health_path = "/health"
    generate_path = "/generate"
    tick_function = ""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def launch_command(self, spec: LaunchSpec) -> list[str]:
        """``[python, -m, sglang_router.launch_router, --host, H, --port, P, *spec.args, --prometheus-host, H,
        --prometheus-port, spec.nccl_port]`` (args from :func:`router_args`; the metrics port is left to the args
        when they name one, or when ``nccl_port`` is 0).

        Raises:
            ValueError: ``spec.port`` is still 0.
        """
        if spec.port == 0:
            raise ValueError("launch_command needs a concrete port; start the router with repro.launcher.start_server")
        metrics = []
        if spec.nccl_port and flag_value(list(spec.args), PROMETHEUS_PORT_FLAG) is None:
            metrics = ["--prometheus-host", spec.host, PROMETHEUS_PORT_FLAG, str(spec.nccl_port)]
        return [spec.python, "-m", "sglang_router.launch_router", "--host", spec.host, "--port", str(spec.port),
                *spec.args, *metrics]

    def launch_env(self, spec: LaunchSpec, base_env: dict[str, str]) -> dict[str, str]:
        """The engine adapter's environment rules (``spec.env`` over ``base_env``, PYTHONPATH prepend)."""
        return self._engine.launch_env(spec, base_env)

    def generate_body(self, input_ids: Sequence[int], max_new_tokens: int, stream: bool) -> dict[str, Any]:
        return self._engine.generate_body(input_ids, max_new_tokens, stream)

    def parse_stream_line(self, line):
        return self._engine.parse_stream_line(line)

    def parse_response(self, body: Any):
        return self._engine.parse_response(body)

    def parse_title(self, title: str):
        return None

    def rank_of_title(self, title: str) -> Optional[int]:
        return None

    def rank_pids(self, procs: Sequence[ProcInfo]) -> dict[int, int]:
        """The router has no rank processes: always ``{}``."""
        return {}

