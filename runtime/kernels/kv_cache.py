"""Writing the new tokens' keys and values into the paged KV cache (vLLM's `reshape_and_cache_flash`)."""

from __future__ import annotations

from torch import Tensor

from runtime.kernels._triton_utils import tl, triton

# Elements one program of the Triton kernel copies per tensor: a few tokens of Hkv * D each.
STORE_ELEMENTS = 4096


def store_kv_ref(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Scatter each token's K and V to its cache slot.

    key, value: (T, Hkv, D); k_cache, v_cache: (num_pages, block_size, Hkv, D) strided views into
    the page pool; slot_mapping: (T,) int64, slot = page * block_size + offset; slot -1 is skipped.
    """
    _check_args(key, value, k_cache, v_cache, slot_mapping)
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    # Two-axis indexing writes through the strided views; reshaping a cache would not.
    page, offset = slots // block_size, slots % block_size
    k_cache[page, offset] = key[keep].to(k_cache.dtype)
    v_cache[page, offset] = value[keep].to(v_cache.dtype)


def store_kv_triton(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """store_kv_ref as one Triton kernel: (T, Hkv, D) K and V into (num_pages, block_size, Hkv, D) views."""
    _check_args(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_hd = triton.next_power_of_2(num_kv_heads * head_dim)
    block_t = max(1, min(triton.next_power_of_2(num_tokens), STORE_ELEMENTS // block_hd))
    _store_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        key, value, k_cache, v_cache, slot_mapping, num_tokens, k_cache.shape[1],
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_T=block_t, BLOCK_HD=block_hd,
    )  # fmt: skip


def _check_args(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    assert key.shape == value.shape and key.dim() == 3
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == key.shape[1:]
    assert slot_mapping.shape == key.shape[:1]


@triton.jit
def _store_kv_kernel(
    key, value, k_cache, v_cache, slot_mapping, num_tokens, block_size,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_kcp, stride_kcs, stride_kch, stride_kcd, stride_vcp, stride_vcs, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr,
):  # fmt: skip
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = tl.load(slot_mapping + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    # One row per token covers all its KV heads: element e is head e // D, dim e % D.
    e = tl.arange(0, BLOCK_HD)
    head, dim = e // HEAD_DIM, e % HEAD_DIM
    mask = (slots >= 0)[:, None] & (e < NUM_KV_HEADS * HEAD_DIM)[None, :]
    # int64 page offsets: a pool larger than 2 GiB overflows 32-bit element offsets.
    page, offset = (slots // block_size)[:, None], (slots % block_size)[:, None]
    t = tokens[:, None]
    k = tl.load(key + t * stride_kt + head * stride_kh + dim * stride_kd, mask=mask)
    tl.store(k_cache + page * stride_kcp + offset * stride_kcs + head * stride_kch + dim * stride_kcd, k, mask=mask)
    v = tl.load(value + t * stride_vt + head * stride_vh + dim * stride_vd, mask=mask)
    tl.store(v_cache + page * stride_vcp + offset * stride_vcs + head * stride_vch + dim * stride_vcd, v, mask=mask)
