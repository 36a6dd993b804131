"""Pure-torch stand-in for the CPU build of sgl-kernel (written for this project; not upstream code).

Why it exists: with ``SGLANG_USE_CPU_ENGINE=1`` sglang (0.5.18 to 0.5.23) imports a few ``*_cpu`` functions from
``sgl_kernel`` at module level. The CPU build of sgl-kernel is not published on the package registry, and the CUDA
wheel (``sglang-kernel``) does not provide these names. This package is put FIRST on the server's PYTHONPATH by the
CPU testbed profile (``repro.targets.sglang.SGLangAdapter.testbed_profile``) so it shadows the CUDA wheel.

It deliberately registers **no** ``torch.ops.sgl_kernel`` ops: sglang's ``_is_intel_amx_backend_available()``
(``sglang/srt/utils/common.py``) checks ``torch.ops.sgl_kernel.convert_weight_packed``, so AMX stays off and every
layer takes its ``forward_native`` path (the TP all_reduce is then a plain torch.distributed gloo collective).

Names served: the union over the releases with a testbed recipe (``[testbeds]`` of
``repro/targets/releases/sglang.toml``), module-level imports under ``if _is_cpu``, found by scanning each installed
wheel; ``scripts/cpu_testbed/setup.sh --release V`` checks that every ``*_cpu`` name release V imports is here:

=========================================  ===================================================  ============  =========
name                                       imported by (sglang/…, 0.5.23 paths)                  here          releases
=========================================  ===================================================  ============  =========
assign_req_to_token_pool_cpu               srt/mem_cache/allocation.py (every prefill batch)    implemented   0.5.18-23
copy_all_layer_kv_cache_cpu                kernels/ops/kvcache/cache_move.py (KV slot moves)    implemented   0.5.18-23
assign_draft_cache_locs_contiguous_cpu     kernels/ops/speculative/cache_locs.py                raises        0.5.18-23
assign_extend_cache_locs_cpu               kernels/ops/speculative/cache_locs.py                raises        0.5.18-23
fill_accept_out_cache_loc_cpu              kernels/ops/speculative/eagle.py                     raises        0.5.18-23
fill_bonus_tokens_cpu                      kernels/ops/speculative/eagle.py                     raises        0.5.18-23
rotate_input_ids_cpu                       kernels/ops/speculative/multi_layer_eagle.py         raises        0.5.18-23
build_tree_kernel_efficient_cpu            kernels/ops/speculative/spec_tree.py                 raises        0.5.18-23
verify_tree_greedy_cpu                     kernels/ops/speculative/spec_tree.py                 raises        0.5.18-23
build_draft_decode_metadata_cpu            srt/layers/attention/intel_amx_backend.py (0.5.18)   raises        0.5.18
=========================================  ===================================================  ============  =========

``sgl_kernel.mamba`` serves the linear-attention names (all raise). Functions that raise do so only when called,
with ``NotImplementedError("<name> is not provided by the CPU stand-in …")``: speculative decoding and
linear-attention models are outside the testbed.
"""

from __future__ import annotations

import ctypes

import torch

__version__ = "0.0.0+repro-cpu-stand-in"


def _not_provided(name: str):
    def _raise(*_args, **_kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not provided by the CPU stand-in (scripts/cpu_testbed/stub/sgl_kernel): "
            f"the testbed serves plain generate only; run this feature on a GPU box"
        )

    _raise.__name__ = name
    _raise.__qualname__ = name
    _raise.__doc__ = f"Placeholder for sgl_kernel.{name}: raises NotImplementedError when called."
    return _raise


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV slot indices into its row of the req→token map (in place).

    Mirrors the triton kernel ``assign_req_to_token_pool`` in sglang 0.5.23 ``srt/mem_cache/allocation.py``:
    for batch entry ``i``, ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` receives the next
    ``end_offset[i] - start_offset[i]`` values of ``out_cache_loc`` (entries are laid out back to back).

    Args:
        req_pool_indices: (batch,) int row index per request.
        req_to_token: (pool_rows, pool_len) int32 map, modified in place.
        start_offset, end_offset: (batch,) int token positions, ``start <= end <= pool_len``.
        out_cache_loc: (sum(end - start),) int KV slot indices.
        pool_len: ``req_to_token.shape[1]`` (kept for signature compatibility).
    """
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    pos = 0
    for row, s, e in zip(rows, starts, ends):
        n = e - s
        if n > 0:
            req_to_token[row, s:e] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Copy KV slots ``src_loc[j] → tgt_loc[j]`` in every layer buffer (in place, CPU memory).

    Mirrors the triton kernel ``copy_all_layer_kv_cache_tiled`` in sglang 0.5.23
    ``kernels/ops/kvcache/cache_move.py``: buffer ``i`` starts at address ``data_ptrs[i]`` and one slot is
    ``strides[i]`` bytes (the tiled copy uses the stride as both slot pitch and copy width).

    Args:
        data_ptrs: (num_buffers,) uint64/int64 base addresses of contiguous CPU KV buffers.
        strides: (num_buffers,) int64 slot size in bytes.
        tgt_loc, src_loc: (n,) int slot indices.
    """
    ptrs = [int(p) for p in data_ptrs.tolist()]
    widths = [int(s) for s in strides.tolist()]
    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist()))
    for base, width in zip(ptrs, widths):
        for tgt, src in pairs:
            if tgt != src:
                ctypes.memmove(base + int(tgt) * width, base + int(src) * width, width)


assign_draft_cache_locs_contiguous_cpu = _not_provided("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _not_provided("assign_extend_cache_locs_cpu")
fill_accept_out_cache_loc_cpu = _not_provided("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _not_provided("fill_bonus_tokens_cpu")
rotate_input_ids_cpu = _not_provided("rotate_input_ids_cpu")
build_tree_kernel_efficient_cpu = _not_provided("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _not_provided("verify_tree_greedy_cpu")
build_draft_decode_metadata_cpu = _not_provided("build_draft_decode_metadata_cpu")

__all__ = [
    "assign_req_to_token_pool_cpu",
    "copy_all_layer_kv_cache_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "build_draft_decode_metadata_cpu",
]
