"""Pure-torch KV copy ops for HiCache's ``direct`` io backend on the CPU testbed (written for this project).

Same names and keyword signatures as the ``sgl_kernel.kvcacheio`` ops that sglang 0.5.23
``srt/mem_cache/pool_host/mha.py`` calls for ``io_backend == "direct"``. Indices are token slots; ``page_size``
only matters for the page-first layout, where host token slot ``t`` lives at page ``t // page_size``, offset
``t % page_size``. Layouts (from ``MHATokenToKVPoolHost.init_kv_buffer``):

- layer_first host buffer per component: ``[layer_num, size, heads, head_dim]`` (callers pass per-layer views);
- page_first_direct host buffer per component: ``[page_num, layer_num, page_size, heads, head_dim]``;
- device buffers: one ``[size, heads, head_dim]`` tensor per layer; the all-layer form lists all K layers, then all V
  layers (``device_k_buffers + device_v_buffers``).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["transfer_kv_direct", "transfer_kv_per_layer_direct_pf_lf", "transfer_kv_all_layer_direct_lf_pf"]


def _idx(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.to(device=like.device, dtype=torch.int64)


def transfer_kv_direct(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """``dst_layers[i][dst_indices] = src_layers[i][src_indices]`` for every i (token-slot gather/scatter).

    Args:
        src_layers, dst_layers: equally long lists of ``[slots, heads, head_dim]`` tensors.
        src_indices, dst_indices: (n,) token slots; n equal on both sides.
        page_size: tokens per page (the GPU kernel copies page runs; the result is the same).
    Raises:
        ValueError: list lengths or index counts differ.
    """
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"transfer_kv_direct: {len(src_layers)} source layers vs {len(dst_layers)} destination layers")
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(f"transfer_kv_direct: {src_indices.numel()} source slots vs {dst_indices.numel()} destination slots")
    if src_indices.numel() == 0:
        return
    for src, dst in zip(src_layers, dst_layers):
        dst[_idx(dst_indices, dst)] = src[_idx(src_indices, src)].to(dst.device)


def _page_split(indices: torch.Tensor, like: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    i = _idx(indices, like)
    return torch.div(i, page_size, rounding_mode="floor"), torch.remainder(i, page_size)


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """Host page-first → device layer-first, one layer: ``dst[j][d] = src[j][t // ps, layer_id, t % ps]``.

    Args:
        src_ptrs: host buffers ``[page_num, layer_num, page_size, heads, head_dim]`` (K, and V when present).
        dst_ptrs: device buffers of layer ``layer_id``, ``[slots, heads, head_dim]``, same count as ``src_ptrs``.
    """
    if len(src_ptrs) != len(dst_ptrs):
        raise ValueError(f"transfer_kv_per_layer_direct_pf_lf: {len(src_ptrs)} sources vs {len(dst_ptrs)} destinations")
    if src_indices.numel() == 0:
        return
    for src, dst in zip(src_ptrs, dst_ptrs):
        page, off = _page_split(src_indices, src, page_size)
        dst[_idx(dst_indices, dst)] = src[page, layer_id, off].to(dst.device)


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Device layer-first → host page-first, all layers: ``dst[j][t // ps, l, t % ps] = src[j * L + l][s]``.

    Args:
        src_ptrs: device per-layer buffers, all K layers then all V layers (``len = len(dst_ptrs) * L``).
        dst_ptrs: host buffers ``[page_num, L, page_size, heads, head_dim]`` (K, and V when present).
    Raises:
        ValueError: ``len(src_ptrs)`` is not a multiple of ``len(dst_ptrs)``.
    """
    if not dst_ptrs or len(src_ptrs) % len(dst_ptrs):
        raise ValueError(
            f"transfer_kv_all_layer_direct_lf_pf: {len(src_ptrs)} device layers do not split over {len(dst_ptrs)} host buffers"
        )
    if src_indices.numel() == 0:
        return
    n_layers = len(src_ptrs) // len(dst_ptrs)
    for j, dst in enumerate(dst_ptrs):
        page, off = _page_split(dst_indices, dst, page_size)
        for layer in range(n_layers):
            src = src_ptrs[j * n_layers + layer]
            dst[page, layer, off] = src[_idx(src_indices, src)].to(dst.device)
