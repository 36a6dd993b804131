"""The vLLM adapter package (vllm 0.32.0): :class:`VLLMAdapter` (``adapter``), frame rules and the injector's
profile (``frames``), the CPU testbed's paths and the files a server leaves behind (``testbed``). docs/vllm.md."""

from repro.targets.vllm.adapter import VLLMAdapter

__all__ = ["VLLMAdapter"]
