"""Paged attention over the shared pool: write this step's K/V, then attend."""

from __future__ import annotations

import torch
from torch import nn

from runtime import kernels
from runtime.context import get_forward_context


class PagedAttention(nn.Module):
    """Holds no weights: the model's attention block projects, this layer caches and attends.

    Implements runtime.cache.protocol.KVCacheLayer.
    """

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_size: int, scale: float):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale = scale
        self.group = -1  # attention group, set when the pool is bound
        self.k_cache: torch.Tensor | None = None  # (num_pages, block_size, num_kv_heads, head_size) view
        self.v_cache: torch.Tensor | None = None

    def kv_shape(self) -> tuple[int, int]:
        return self.num_kv_heads, self.head_size

    def bind(self, group: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.group, self.k_cache, self.v_cache = group, k_cache, v_cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (T, num_heads, head_size); k, v: (T, num_kv_heads, head_size) -> (T, num_heads * head_size)."""
        ctx = get_forward_context()
        kernels.store_kv(k, v, self.k_cache, self.v_cache, ctx.slot_mappings[self.group])
        out = torch.empty_like(q)
        kernels.paged_attention(q, self.k_cache, self.v_cache, ctx.block_tables[self.group], ctx.attention,
                                self.scale, out)
        return out.flatten(1)
