"""paged_attention_ref against dense causal attention over each whole sequence.

The cache lives in strided views of a page pool full of random bytes (some of them NaN patterns),
pages are shuffled, and block tables are padded with -1, so a read of any slot past a sequence's
end or of a page it does not own would show up in the output.
"""

import importlib
import math

import pytest
import torch

from runtime.kernels import cpu_native
from runtime.kernels.kv_cache import store_kv_ref
from runtime.kernels.metadata import build_attention_metadata
from runtime.kernels.paged_attention import paged_attention_bf16_prefill, paged_attention_ref

HKV, HEAD = 2, 16
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 8e-3)}
# (query_len, seq_len) per sequence: decodes, prefill chunks over a cached prefix, fresh prefills.
BATCHES = {
    "decode": [(1, 1), (1, 17), (1, 40), (1, 600)],
    "mixed": [(1, 33), (7, 7), (1, 1), (12, 45), (30, 560)],
    # Runs of prefill chunks with one query and sequence length, which the bfloat16 prefill takes in one call.
    "runs": [(9, 9), (9, 9), (9, 9), (1, 20), (5, 30), (5, 30), (5, 31), (9, 9)],
}


def dense_attention(q, k, v, scale):
    """q (n, Hq, D) are the last n of the L positions of k, v (L, Hkv, D); float64."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    n, length = q.shape[0], k.shape[0]
    future = torch.arange(length)[None, :] > torch.arange(length - n, length)[:, None]
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


# The native CPU kernel (decode-only steps; it hands others to the bfloat16 prefill or the reference) meets
# the same oracle.
IMPLEMENTATIONS = {
    "ref": paged_attention_ref,
    "native": pytest.param(cpu_native.paged_attention_native, marks=pytest.mark.skipif(
        not cpu_native.available(), reason="the native CPU kernels do not build here")),
}


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("block_size", [16, 24, 528])
# 12 query heads per KV head: more than the native kernel holds in registers at once (ATTEND_HEADS = 8).
@pytest.mark.parametrize("gqa", [2, 4, 12])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("attention", IMPLEMENTATIONS.values(), ids=IMPLEMENTATIONS.keys())
# 12: a head dim the native kernel's 8-wide vector path cannot take (it falls back to a row at a time).
@pytest.mark.parametrize("head", [HEAD, 12])
def test_paged_matches_dense(page_pool, batch, block_size, gqa, dtype, attention, head):
    assert_paged_matches_dense(page_pool, batch, block_size, gqa, dtype, attention, head)



@pytest.mark.skipif(not cpu_native.available(), reason="the native CPU kernels do not build here")
@pytest.mark.parametrize("batch", ["decode", "mixed"])
# 1 to 5 query heads per KV head: the AVX-512 passes take them in blocks of 3 (scores) and 4 (values).
@pytest.mark.parametrize("gqa", [1, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Whole 16-lane vectors for the AVX-512 value pass (64: four at a time; 96: four, then two); whole 32s for
# the bfloat16 score pass on vdpbf16ps; 48: the score pass's 8-wide path with the 16-lane value pass.
@pytest.mark.parametrize("head", [64, 96, 48])
def test_native_vector_widths_match_dense(page_pool, batch, gqa, dtype, head):
    assert_paged_matches_dense(page_pool, batch, 16, gqa, dtype, cpu_native.paged_attention_native, head)

@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("block_size", [16, 528])
@pytest.mark.parametrize("gqa", [2, 12])
@pytest.mark.parametrize("head", [HEAD, 12])
def test_bfloat16_prefill_matches_dense(page_pool, batch, block_size, gqa, head):
    """Prefill chunks in bfloat16, runs of one length in one call (bfloat16 caches only)."""
    assert_paged_matches_dense(page_pool, batch, block_size, gqa, torch.bfloat16, paged_attention_bf16_prefill, head)


def assert_paged_matches_dense(page_pool, batch, block_size, gqa, dtype, attention, head):
    torch.manual_seed(0)
    lens = BATCHES[batch]
    blocks = [math.ceil(seq_len / block_size) for _, seq_len in lens]
    num_pages = sum(blocks) + 3  # a few pages nobody owns
    layer_bytes = block_size * HKV * head * dtype.itemsize
    pool = page_pool(num_pages, 2, 2 * layer_bytes + 64, seed=1)
    k_cache = pool.view(0, 64, dtype, (block_size, HKV, head))
    v_cache = pool.view(0, 64 + layer_bytes, dtype, (block_size, HKV, head))

    block_table = torch.full((len(lens), max(blocks) + 2), -1, dtype=torch.int32)
    pages = torch.randperm(num_pages)
    for s, n in enumerate(blocks):
        block_table[s, :n], pages = pages[:n], pages[n:]
    keys = [torch.randn(seq_len, HKV, head, dtype=dtype) for _, seq_len in lens]
    values = [torch.randn(seq_len, HKV, head, dtype=dtype) for _, seq_len in lens]
    for s, (_, seq_len) in enumerate(lens):
        positions = torch.arange(seq_len)
        slots = block_table[s, positions // block_size].long() * block_size + positions % block_size
        store_kv_ref(keys[s], values[s], k_cache, v_cache, slots)

    queries = [torch.randn(n, HKV * gqa, head, dtype=dtype) for n, _ in lens]
    meta = build_attention_metadata([n for n, _ in lens], [seq_len for _, seq_len in lens], "cpu")
    scale = 0.7 / math.sqrt(head)
    q = torch.cat(queries)
    out = torch.full_like(q, float("nan"))

    result = attention(q, k_cache, v_cache, block_table, meta, scale, out)

    assert result is out and out.dtype == dtype
    expected = torch.cat([dense_attention(queries[s], keys[s], values[s], scale) for s in range(len(lens))])
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)


def test_decodes_split_into_gather_groups_match_one_group(page_pool, monkeypatch):
    """A gather budget of 3 blocks forces several decode groups; the result must not change."""
    # runtime.kernels.paged_attention is also the name of the bound op, so fetch the module itself.
    pa = importlib.import_module("runtime.kernels.paged_attention")

    torch.manual_seed(1)
    block_size, lens = 16, [5, 40, 17, 1, 33]
    pool = page_pool(12, 1, 2 * block_size * HKV * HEAD * 4, seed=2)
    k_cache = pool.view(0, 0, torch.float32, (block_size, HKV, HEAD))
    v_cache = pool.view(0, block_size * HKV * HEAD * 4, torch.float32, (block_size, HKV, HEAD))
    k_cache.normal_()
    v_cache.normal_()
    block_table = torch.randperm(12).view(4, 3).repeat(2, 1)[: len(lens)].int()  # pages may be shared
    meta = build_attention_metadata([1] * len(lens), lens, "cpu")
    q = torch.randn(len(lens), 2 * HKV, HEAD)
    one_group = paged_attention_ref(q, k_cache, v_cache, block_table, meta, 0.3, torch.empty_like(q))
    monkeypatch.setattr(pa, "DECODE_GATHER_ELEMENTS", 3 * block_size * HKV * HEAD)
    assert len(pa._decode_groups(list(range(len(lens))), lens, HKV * HEAD)) > 2
    groups = paged_attention_ref(q, k_cache, v_cache, block_table, meta, 0.3, torch.empty_like(q))
    torch.testing.assert_close(groups, one_group, atol=1e-6, rtol=1e-6)  # padding differs per group


@pytest.mark.parametrize("gap", [2 * HKV * HEAD, 7])
def test_token_gather_matches_indexing(page_pool, gap):
    """The strided-slot gather equals plain indexing, whether or not the page stride is a whole number
    of tokens (a gap of 7 elements makes it fall back to indexing)."""
    pa = importlib.import_module("runtime.kernels.paged_attention")
    block_size, num_pages = 24, 6
    layer = block_size * HKV * HEAD
    pool = page_pool(num_pages, 1, (layer + gap) * 4, seed=3)
    cache = pool.view(0, 0, torch.float32, (block_size, HKV, HEAD))
    cache.copy_(torch.randn(cache.shape))
    pages = torch.randint(0, num_pages, (5, 9))
    offsets = torch.randint(0, block_size, (5, 9))
    torch.testing.assert_close(pa._gather_tokens(cache, pages, offsets), cache[pages, offsets], atol=0, rtol=0)


def test_prefill_runs_take_consecutive_chunks_of_one_length_under_the_gather_budget(monkeypatch):
    pa = importlib.import_module("runtime.kernels.paged_attention")
    query_lens, seq_lens = [9, 9, 9, 1, 5, 5, 5, 9], [9, 9, 9, 20, 30, 30, 31, 9]
    prefills = [0, 1, 2, 4, 5, 6, 7]
    assert pa._prefill_runs(prefills, query_lens, seq_lens, 1) == [[0, 1, 2], [4, 5], [6], [7]]
    monkeypatch.setattr(pa, "DECODE_GATHER_ELEMENTS", 2 * 9)
    assert pa._prefill_runs(prefills, query_lens, seq_lens, 1) == [[0, 1], [2], [4], [5], [6], [7]]
