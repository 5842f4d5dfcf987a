"""store_kv_triton and paged_attention_triton against their torch references.

Caches are strided views into a page pool of random bytes (NaN patterns included) with another
layer's slab and padding around them; pages are shuffled and block tables padded with -1, so a
read of a slot past a sequence's end or a write outside its slots shows up.
"""

import math

import pytest
import torch
from triton_helpers import DEVICE, assert_close, needs_device, on_device

from runtime.kernels.kv_cache import store_kv_ref, store_kv_triton
from runtime.kernels.metadata import build_attention_metadata
from runtime.kernels.paged_attention import paged_attention_ref, paged_attention_triton

# numpy warnings from the interpreter (invalid value, overflow) often mean an unmasked load read garbage.
pytestmark = [needs_device, pytest.mark.filterwarnings("error::RuntimeWarning")]
HKV, HEAD = 2, 16
# (query_len, seq_len) per sequence: decodes, prefill chunks over a cached prefix, fresh prefills.
BATCHES = {
    "decode": [(1, 1), (1, 17), (1, 40), (1, 75)],
    "mixed": [(1, 33), (7, 7), (1, 1), (12, 45), (21, 560)],
}


def kv_pool(page_pool, dtype, block_size, num_pages, head_dim=HEAD):
    """K and V views in slab 1 of a 2-slab pool, 32 bytes into each page, with 32 bytes of padding after."""
    layer_bytes = block_size * HKV * head_dim * dtype.itemsize
    pool = on_device(page_pool(num_pages, 2, 2 * layer_bytes + 64, seed=1))
    k_cache = pool.view(1, 32, dtype, (block_size, HKV, head_dim))
    v_cache = pool.view(1, 32 + layer_bytes, dtype, (block_size, HKV, head_dim))
    return pool, k_cache, v_cache


def filled_cache(page_pool, dtype, block_size, lens, head_dim=HEAD):
    """A cache holding random K/V for every position of every sequence, and its block table."""
    blocks = [math.ceil(seq_len / block_size) for _, seq_len in lens]
    num_pages = sum(blocks) + 3  # a few pages nobody owns
    pool, k_cache, v_cache = kv_pool(page_pool, dtype, block_size, num_pages, head_dim)
    block_table = torch.full((len(lens), max(blocks) + 2), -1, dtype=torch.int32)
    pages = torch.randperm(num_pages)
    for s, n in enumerate(blocks):
        block_table[s, :n], pages = pages[:n], pages[n:]
    block_table = block_table.to(DEVICE)
    for s, (_, seq_len) in enumerate(lens):
        positions = torch.arange(seq_len, device=DEVICE)
        slots = block_table[s, positions // block_size].long() * block_size + positions % block_size
        keys, values = (torch.randn(seq_len, HKV, head_dim, device=DEVICE).to(dtype) for _ in range(2))
        store_kv_ref(keys, values, k_cache, v_cache, slots)
    return k_cache, v_cache, block_table


@pytest.mark.parametrize("block_size", [16, 24, 528])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_kv_matches_reference(page_pool, block_size, dtype):
    torch.manual_seed(0)
    num_pages, num_tokens = 4, 37
    pool, k_cache, v_cache = kv_pool(page_pool, dtype, block_size, num_pages)
    slots = torch.randperm(num_pages * block_size)[:num_tokens].to(DEVICE)
    slots[[3, 20]] = -1  # padding tokens: no write
    # K and V as strided slices of one fused projection, as the model produces them.
    kv = torch.randn(num_tokens, 2, HKV, HEAD + 3, device=DEVICE).to(dtype)
    key, value = kv[:, 0, :, 1 : HEAD + 1], kv[:, 1, :, 2 : HEAD + 2]
    pool.allow_writes(k_cache, (slots[slots >= 0] // block_size, slots[slots >= 0] % block_size))
    pool.allow_writes(v_cache, (slots[slots >= 0] // block_size, slots[slots >= 0] % block_size))
    before = pool.snapshot()
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(key, value, expected_k, expected_v, slots)

    store_kv_triton(key, value, k_cache, v_cache, slots)

    # Byte for byte (the pool's random bytes include NaN patterns, which compare unequal as floats).
    assert torch.equal(k_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expected_v.view(torch.uint8))
    pool.assert_untouched_outside_allowed(before)


@pytest.mark.parametrize(
    "batch, block_size, gqa, dtype",
    [
        ("mixed", 16, 2, torch.float32),
        ("mixed", 24, 4, torch.float32),
        ("mixed", 528, 2, torch.float32),
        ("decode", 24, 2, torch.float32),
        ("decode", 528, 4, torch.float32),
        ("mixed", 24, 3, torch.float32),  # a group size that is not a power of 2 leaves rows unused
        ("mixed", 24, 2, torch.float16),
        ("decode", 16, 4, torch.float16),
        ("mixed", 528, 2, torch.bfloat16),
        ("decode", 24, 2, torch.bfloat16),
    ],
)
def test_paged_attention_matches_reference(page_pool, batch, block_size, gqa, dtype):
    torch.manual_seed(0)
    lens = BATCHES[batch]
    k_cache, v_cache, block_table = filled_cache(page_pool, dtype, block_size, lens)
    meta = build_attention_metadata([n for n, _ in lens], [seq_len for _, seq_len in lens], DEVICE)
    # q as a strided slice of a fused projection.
    qkv = torch.randn(sum(n for n, _ in lens), HKV * gqa + 5, HEAD, device=DEVICE).to(dtype)
    q = qkv[:, 2 : 2 + HKV * gqa]
    expected = paged_attention_ref(q, k_cache, v_cache, block_table, meta, 0.3, torch.empty_like(q))
    out = torch.full_like(q, float("nan"))

    result = paged_attention_triton(q, k_cache, v_cache, block_table, meta, 0.3, out)

    assert result is out
    if dtype == torch.bfloat16:
        # The reference decodes a bfloat16 cache in bfloat16 (its probabilities rounded to 8 bits, as the
        # kernel's are on a GPU); the interpreted kernel keeps them in float32: a few 1e-3 apart on unit values.
        torch.testing.assert_close(out.double(), expected.double(), atol=4e-3, rtol=2.0**-7)
    else:
        assert_close(out, expected)


def test_paged_attention_odd_head_dim(page_pool):
    """A head size that is not a power of 2 (masked lanes in the dot products)."""
    torch.manual_seed(1)
    lens = [(3, 20), (1, 9)]
    k_cache, v_cache, block_table = filled_cache(page_pool, torch.float32, 16, lens, head_dim=24)
    meta = build_attention_metadata([3, 1], [20, 9], DEVICE)
    q = torch.randn(4, 2 * HKV, 24, device=DEVICE)
    expected = paged_attention_ref(q, k_cache, v_cache, block_table, meta, 0.2, torch.empty_like(q))
    out = paged_attention_triton(q, k_cache, v_cache, block_table, meta, 0.2, torch.full_like(q, float("nan")))
    assert_close(out, expected)
