"""store_kv_ref: tokens land in their (page, offset) slots of strided pool views; slot -1 is skipped."""

import pytest
import torch

from runtime.kernels.kv_cache import store_kv_ref

NUM_PAGES, HKV, HEAD = 6, 2, 8


@pytest.mark.parametrize("block_size", [16, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_only_its_slots(page_pool, block_size, dtype):
    torch.manual_seed(0)
    layer_bytes = block_size * HKV * HEAD * dtype.itemsize
    # Two layer slabs per page id; this layer is slab 1, with padding before K and after V.
    pool = page_pool(NUM_PAGES, 2, 2 * layer_bytes + 96)
    k_cache = pool.view(1, 32, dtype, (block_size, HKV, HEAD))
    v_cache = pool.view(1, 32 + layer_bytes, dtype, (block_size, HKV, HEAD))
    slot_mapping = torch.tensor([3 * block_size + 5, -1, 0, 5 * block_size + block_size - 1, 2 * block_size + 7])
    key, value = torch.randn(2, len(slot_mapping), HKV, HEAD, dtype=dtype)
    pages, offsets = slot_mapping[slot_mapping >= 0] // block_size, slot_mapping[slot_mapping >= 0] % block_size
    pool.allow_writes(k_cache, (pages, offsets))
    pool.allow_writes(v_cache, (pages, offsets))
    before = pool.snapshot()

    store_kv_ref(key, value, k_cache, v_cache, slot_mapping)

    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // block_size, slot % block_size], key[t])
            assert torch.equal(v_cache[slot // block_size, slot % block_size], value[t])
    pool.assert_untouched_outside_allowed(before)
