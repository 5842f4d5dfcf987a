"""Writing the new tokens' keys and values into the paged KV cache (vLLM's `reshape_and_cache_flash`)."""

from __future__ import annotations

from torch import Tensor


def store_kv_ref(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Scatter each token's K and V to its cache slot.

    key, value: (T, Hkv, D); k_cache, v_cache: (num_pages, block_size, Hkv, D) strided views into
    the page pool; slot_mapping: (T,) int64, slot = page * block_size + offset; slot -1 is skipped.
    """
    assert key.shape == value.shape and key.dim() == 3
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == key.shape[1:]
    assert slot_mapping.shape == key.shape[:1]
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    # Two-axis indexing writes through the strided views; reshaping a cache would not.
    page, offset = slots // block_size, slots % block_size
    k_cache[page, offset] = key[keep].to(k_cache.dtype)
    v_cache[page, offset] = value[keep].to(v_cache.dtype)
