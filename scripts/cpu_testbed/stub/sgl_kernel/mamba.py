"""``sgl_kernel.mamba`` names imported by sglang 0.5.23's linear-attention backends on CPU
(``srt/layers/attention/linear/{gdn_backend,kda_backend,kernels/gdn_triton}.py``). None is provided: each raises
NotImplementedError when called (linear-attention models are outside the CPU testbed)."""

from . import _not_provided

causal_conv1d_fn_cpu = _not_provided("mamba.causal_conv1d_fn_cpu")
causal_conv1d_update_cpu = _not_provided("mamba.causal_conv1d_update_cpu")
chunk_gated_delta_rule_cpu = _not_provided("mamba.chunk_gated_delta_rule_cpu")
