"""What the harness needs to know about a serving engine, independent of which engine it is.

An adapter turns a :class:`LaunchSpec` into a command line and environment, knows the HTTP endpoints and request /
response shapes, and maps process titles to ranks. The harness never imports the engine: everything engine-specific
goes through an adapter (one place that knows SGLang: ``repro.targets.sglang``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence, Union, runtime_checkable

from repro.procs import ProcInfo


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


@runtime_checkable
class Adapter(Protocol):
    """Engine adapter: the one place that knows an engine's command line, HTTP API and process titles."""

    name: str
    health_path: str
    generate_path: str
    tick_function: str

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

    def rank_of_title(self, title: str) -> Optional[int]:
        """Rank of a process from its title, or None when it is not a rank (scheduler) process."""

    def rank_pids(self, procs: Sequence[ProcInfo]) -> dict[int, int]:
        """rank -> pid for the rank processes among ``procs``."""

    def testbed_profile(
        self, spec: LaunchSpec, scenario_args: Sequence[str]
    ) -> tuple[list[str], dict[str, str], list[str]]:
        """(extra args, extra env, PYTHONPATH prepend) to run this engine on the CPU testbed."""
