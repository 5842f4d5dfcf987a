"""store_kv: tokens land in their (page, offset) slots of strided pool views; slot -1 is skipped. The native
CPU copy meets the same test, with keys and values as strided views of one projection."""

import pytest
import torch

from runtime.kernels import cpu_native
from runtime.kernels.kv_cache import store_kv_ref

IMPLEMENTATIONS = {
    "ref": store_kv_ref,
    "native": pytest.param(cpu_native.store_kv_native, marks=pytest.mark.skipif(
        not cpu_native.available(), reason="the native CPU kernels do not build here")),
}

NUM_PAGES, HKV, HEAD = 6, 2, 8


@pytest.mark.parametrize("block_size", [16, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("store", IMPLEMENTATIONS.values(), ids=IMPLEMENTATIONS.keys())
def test_store_kv_writes_only_its_slots(page_pool, block_size, dtype, store):
    torch.manual_seed(0)
    layer_bytes = block_size * HKV * HEAD * dtype.itemsize
    # Two layer slabs per page id; this layer is slab 1, with padding before K and after V.
    pool = page_pool(NUM_PAGES, 2, 2 * layer_bytes + 96)
    k_cache = pool.view(1, 32, dtype, (block_size, HKV, HEAD))
    v_cache = pool.view(1, 32 + layer_bytes, dtype, (block_size, HKV, HEAD))
    slot_mapping = torch.tensor([3 * block_size + 5, -1, 0, 5 * block_size + block_size - 1, 2 * block_size + 7])
    # K and V as the strided halves of one (tokens, 2 * Hkv * D) projection, as the attention layer has them.
    key, value = torch.randn(len(slot_mapping), 2 * HKV * HEAD, dtype=dtype).view(-1, 2 * HKV, HEAD).chunk(2, dim=1)
    pages, offsets = slot_mapping[slot_mapping >= 0] // block_size, slot_mapping[slot_mapping >= 0] % block_size
    pool.allow_writes(k_cache, (pages, offsets))
    pool.allow_writes(v_cache, (pages, offsets))
    before = pool.snapshot()

    store(key, value, k_cache, v_cache, slot_mapping)

    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // block_size, slot % block_size], key[t])
            assert torch.equal(v_cache[slot // block_size, slot % block_size], value[t])
    pool.assert_untouched_outside_allowed(before)


@pytest.mark.skipif(not cpu_native.available(), reason="the native CPU kernels do not build here")
def test_native_store_casts_through_the_reference(page_pool):
    """float32 keys into a bfloat16 cache: the copy cannot cast, so the reference does it."""
    pool = page_pool(NUM_PAGES, 2, 2 * 16 * HKV * HEAD * 2 + 96)
    k_cache = pool.view(1, 32, torch.bfloat16, (16, HKV, HEAD))
    v_cache = pool.view(1, 32 + 16 * HKV * HEAD * 2, torch.bfloat16, (16, HKV, HEAD))
    key, value = torch.randn(2, 3, HKV, HEAD)
    slots = torch.tensor([1, 17, 40])
    cpu_native.store_kv_native(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[2, 8], key[2].bfloat16()) and torch.equal(v_cache[1, 1], value[1].bfloat16())
