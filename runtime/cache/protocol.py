"""What the pool needs from a layer that caches: the shapes it expects, and a place to receive its views.

The layers implement these protocols (runtime.layers.attention.PagedAttention, the Mamba mixers);
the cache package never imports them, so the arrows of the import graph point from the model
side to the cache, not back.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class KVCacheLayer(Protocol):
    """An attention layer: K and V pages of (block_size, num_kv_heads, head_size) each."""

    layer_idx: int

    def kv_shape(self) -> tuple[int, int]:
        """(num_kv_heads, head_size) on this rank."""
        ...

    def bind(self, group: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None: ...


@runtime_checkable
class StateCacheLayer(Protocol):
    """A recurrent layer: one state page per sequence, holding the tensors `state_shapes` gives, in order."""

    layer_idx: int

    def state_shapes(self) -> tuple[tuple[int, ...], ...]: ...

    def bind(self, group: int, *states: torch.Tensor) -> None: ...
