"""Causal attention of packed new tokens over a paged KV cache (decode and prefill over a cached prefix).

The reference gathers each sequence's keys and calls torch's scaled_dot_product_attention: in
float32 for prefill chunks, in bfloat16 for decodes from a bfloat16 cache (torch accumulates in float32).
Decodes (one new token) are batched, padded to the longest in their group, in groups whose
gathered keys stay under DECODE_GATHER_ELEMENTS; prefill chunks are done one sequence at a
time, which bounds memory by the largest sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.kernels._triton_utils import dot_dtype, tl, triton
from runtime.kernels.metadata import AttentionMetadata

# Decodes are batched in groups whose padded K gather holds at most this many elements (64 MiB of
# float32, as much again for V), so a large decode batch with long contexts does not gather its
# whole KV at once.
DECODE_GATHER_ELEMENTS = 1 << 24

# Keys per step of the Triton kernel's loop (vLLM's choice): fewer for decodes, whose single query
# row makes each step cheap, so that short contexts waste less of a tile.
DECODE_TILE, PREFILL_TILE = 16, 32
LOG2_E = 1.4426950408889634


def paged_attention_ref(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: Tensor,
) -> Tensor:
    """Attention of the new tokens over their sequences' cached keys and values.

    q, out: (T, Hq, D) packed new tokens; k_cache, v_cache: (num_pages, block_size, Hkv, D) strided
    views; block_table: (S, max_blocks) int32 page ids. Query i of sequence s sits at position
    seq_len - query_len + i and attends keys 0..that position, already written by store_kv.
    Hq is a multiple of Hkv (query head h uses KV head h // (Hq // Hkv)); any block_size.
    Writes out and returns it.
    """
    return _attend(q, k_cache, v_cache, block_table, meta, scale, out, torch.float32)


def paged_attention_bf16_prefill(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: Tensor,
) -> Tensor:
    """paged_attention_ref for a bfloat16 cache, with its prefill chunks in bfloat16 (same arguments).

    torch's bfloat16 attention (AMX where the CPU has it) ran prefills 2.6-2.8x faster than the float32
    one the reference uses, and rounds its probabilities to bfloat16 before multiplying the values, as
    HF's bfloat16 models do. Chunks go in runs of consecutive sequences with one query and one sequence
    length (a batch of fresh prompts of one length is one call), whose gathered keys stay under
    DECODE_GATHER_ELEMENTS. Decodes are the reference's.
    """
    assert k_cache.dtype == v_cache.dtype == torch.bfloat16
    return _attend(q, k_cache, v_cache, block_table, meta, scale, out, torch.bfloat16)


def _attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, meta: AttentionMetadata,
            scale: float, out: Tensor, prefill_dtype: torch.dtype) -> Tensor:
    """Decodes in gather groups; prefill chunks in `prefill_dtype`: in bfloat16 in runs of one length, in
    float32 one sequence a call (runs were slower there: 163 against 134 ms for 32 x 128 tokens)."""
    _check_args(q, k_cache, v_cache, block_table, meta, out)
    per_token = k_cache.shape[2] * q.shape[2]
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    query_lens = [end - start for start, end in zip(starts, starts[1:])]
    decodes = [s for s, n in enumerate(query_lens) if n == 1]
    for group in _decode_groups(decodes, seq_lens, per_token):
        _decode_attention(q, k_cache, v_cache, block_table, meta, scale, out, group)
    prefills = [s for s, n in enumerate(query_lens) if n > 1]
    if prefill_dtype == torch.bfloat16:
        runs = _prefill_runs(prefills, query_lens, seq_lens, per_token)
    else:
        runs = [[s] for s in prefills]
    for run in runs:
        first, count, num_new = run[0], len(run), query_lens[run[0]]
        tokens = slice(starts[first], starts[first] + count * num_new)
        chunks = q[tokens].view(count, num_new, *q.shape[1:])
        o = _chunks_attention(chunks, k_cache, v_cache, block_table[first : first + count], seq_lens[first], scale,
                              prefill_dtype)
        out[tokens] = o.flatten(0, 1)
    return out


def _prefill_runs(prefills: list[int], query_lens: list[int], seq_lens: list[int], per_token: int) -> list[list[int]]:
    """Runs of consecutive prefill chunks with the same query and sequence lengths whose gathered keys fit
    in DECODE_GATHER_ELEMENTS (a run always holds at least one chunk)."""
    runs: list[list[int]] = []
    for s in prefills:
        lengths = (query_lens[s], seq_lens[s])
        same = bool(runs) and runs[-1][-1] == s - 1 and lengths == (query_lens[s - 1], seq_lens[s - 1])
        if same and (len(runs[-1]) + 1) * seq_lens[s] * per_token <= DECODE_GATHER_ELEMENTS:
            runs[-1].append(s)
        else:
            runs.append([s])
    return runs


def paged_attention_triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: Tensor,
) -> Tensor:
    """paged_attention_ref as one Triton kernel for decodes and prefill chunks alike (same shapes).

    A program takes BLOCK_Q query positions of one sequence times the Hq // Hkv query heads of one
    KV head, so the heads of a group share each K/V load (rows = position x head). It walks the keys
    in tiles of TILE tokens, independent of the page size: each key looks up its own page.
    """
    _check_args(q, k_cache, v_cache, block_table, meta, out)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    queries_per_kv = num_q_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(queries_per_kv))  # tl.dot needs 16 rows on a GPU
    block_q = block_m // queries_per_kv
    # Sequence s owns query blocks from query_start_loc[s] // BLOCK_Q + s on, so this bounds their
    # number without reading query lengths on the host; surplus programs return at once.
    grid = (num_tokens // block_q + meta.num_sequences, num_kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, block_table, meta.query_start_loc, meta.seq_lens, out, scale * LOG2_E,
        meta.num_sequences, k_cache.shape[1], *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(),
        block_table.stride(0),
        QUERIES_PER_KV=queries_per_kv, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m, BLOCK_Q=block_q, TILE=DECODE_TILE if meta.max_query_len == 1 else PREFILL_TILE,
        DOT_DTYPE=dot_dtype(q.dtype),
    )  # fmt: skip
    return out


def _check_args(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, meta: AttentionMetadata,
                out: Tensor) -> None:
    num_q_heads, head_dim = q.shape[1:]
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim
    assert num_q_heads % k_cache.shape[2] == 0
    assert out.shape == q.shape and block_table.shape[0] == meta.num_sequences


def _decode_groups(decodes: list[int], seq_lens: list[int], per_token: int) -> list[list[int]]:
    """Runs of consecutive decodes whose K gather, padded to the run's longest sequence, fits in
    DECODE_GATHER_ELEMENTS (a run always holds at least one decode)."""
    groups: list[list[int]] = []
    longest = 0
    for s in decodes:
        padded = max(longest, seq_lens[s])
        if groups and (len(groups[-1]) + 1) * padded * per_token <= DECODE_GATHER_ELEMENTS:
            groups[-1].append(s)
            longest = padded
        else:
            groups.append([s])
            longest = seq_lens[s]
    return groups


def _gather_pages(cache: Tensor, pages: Tensor, dtype: torch.dtype) -> Tensor:
    """(..., num_blocks) page ids -> (..., num_blocks * block_size, Hkv, D) tokens in `dtype`."""
    tokens = cache[pages]
    return tokens.flatten(-4, -3).to(dtype)


def _gather_tokens(cache: Tensor, pages: Tensor, offsets: Tensor) -> Tensor:
    """cache[pages, offsets]: (..., Hkv, D) for page ids and in-page offsets of the same shape (...).

    When the pool's page stride is a whole number of tokens, the pages are one strided row of
    token slots and index_select gathers them, several times faster than two-tensor indexing.
    """
    per_token = cache.stride(1)
    if cache.stride(0) % per_token or not cache[0].is_contiguous():
        return cache[pages, offsets]
    tokens_per_page = cache.stride(0) // per_token
    num_slots = (cache.shape[0] - 1) * tokens_per_page + cache.shape[1]
    slots = cache.as_strided((num_slots, *cache.shape[2:]), (per_token, *cache.stride()[2:]))
    return slots.index_select(0, (pages * tokens_per_page + offsets).flatten()).view(*pages.shape, *cache.shape[2:])


def _chunks_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, pages: Tensor, seq_len: int, scale: float, dtype: torch.dtype
) -> Tensor:
    """Prefill chunks of B sequences of one length: q (B, n, Hq, D) are the last n of each one's seq_len
    positions; pages (B, max_blocks). Returns (B, n, Hq, D) in `dtype`, the dtype the attention runs in."""
    num_blocks = -(-seq_len // k_cache.shape[1])
    pages = pages[:, :num_blocks].long()
    k = _gather_pages(k_cache, pages, dtype)[:, :seq_len]
    v = _gather_pages(v_cache, pages, dtype)[:, :seq_len]
    # SDPA wants (batch, heads, tokens, D); the mask aligns the n queries with the last n keys (what torch's
    # causal_lower_right materializes on a CPU; importing it imports torch._dynamo, 145 MiB resident).
    n = q.shape[1]
    causal = n == seq_len
    mask = None if causal else torch.ones(n, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - n)
    o = F.scaled_dot_product_attention(
        q.to(dtype).transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return o.transpose(1, 2)


def _decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: Tensor,
    decodes: list[int],
) -> None:
    """All one-token sequences at once, padded to the longest; the new token attends every cached key.

    Gathers token by token up to the longest context only, not whole pages: pages are sized to a
    Mamba state and can hold several times the tokens a sequence has.
    """
    seqs = torch.tensor(decodes, device=q.device)
    tokens = meta.query_start_loc[seqs].long()
    seq_lens = meta.seq_lens[seqs].long()
    positions = torch.arange(int(seq_lens.max()), device=q.device)
    valid = positions < seq_lens[:, None]  # (S, L)
    # A position past a sequence's end reads that sequence's last key instead, so the gather only
    # touches written (finite) slots of pages it owns; the mask then leaves it out of the softmax.
    positions = torch.minimum(positions, seq_lens[:, None] - 1)
    block_size = k_cache.shape[1]
    pages = block_table[seqs].long().gather(1, positions // block_size)
    offsets = positions % block_size
    # bfloat16 stays bfloat16: torch's attention accumulates in float32 itself, and converting the
    # gathered keys and values first took longer than the attention. float16 is widened: torch rounds
    # its probabilities to float16, which is further from the Triton kernel than its tests allow.
    compute = torch.bfloat16 if k_cache.dtype == torch.bfloat16 else torch.float32
    k = _gather_tokens(k_cache, pages, offsets).to(compute)  # (S, L, Hkv, D)
    v = _gather_tokens(v_cache, pages, offsets).to(compute)
    o = F.scaled_dot_product_attention(
        q[tokens][:, :, None].to(compute),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    out[tokens] = o[:, :, 0].to(out.dtype)


@triton.jit
def _paged_attention_kernel(
    q, k_cache, v_cache, block_table, query_start_loc, seq_lens, out, scale_log2, num_seqs, block_size,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
    stride_kp, stride_ks, stride_kh, stride_kd, stride_vp, stride_vs, stride_vh, stride_vd, stride_bt,
    QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, TILE: tl.constexpr, DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    q_block, kv_head = tl.program_id(0), tl.program_id(1)
    # Binary search for the last sequence whose first query block is <= q_block.
    lo, hi = 0, num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        owns_from = tl.load(query_start_loc + mid) // BLOCK_Q + mid
        lo = tl.where(owns_from <= q_block, mid + 1, lo)
        hi = tl.where(owns_from <= q_block, hi, mid)
    seq = lo - 1
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    first_q = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if first_q >= q_len:
        return
    context_len = tl.load(seq_lens + seq) - q_len

    rows = tl.arange(0, BLOCK_M)
    q_pos = first_q + rows // QUERIES_PER_KV  # among the sequence's new tokens
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    # BLOCK_M may exceed BLOCK_Q * QUERIES_PER_KV when the group size is not a power of 2.
    row_ok = (rows // QUERIES_PER_KV < BLOCK_Q) & (q_pos < q_len)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    token = (q_start + q_pos).to(tl.int64)
    q_tile = tl.load(q + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
                     mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)
    last_key = context_len + q_pos  # causal: each row sees keys 0..last_key
    num_keys = context_len + tl.minimum(first_q + BLOCK_Q, q_len)  # what the block's last row sees

    # Online softmax in float32, base 2. A finite start for the running max keeps exp2(m_old - m_new)
    # at 1, not NaN, for rows that see nothing yet (padding rows never do); every real row sees key 0.
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, num_keys, TILE):
        pos = start + tl.arange(0, TILE)
        pos_ok = pos < num_keys
        # Per-key page lookup: TILE need not divide, or be divided by, the page size.
        page = tl.load(block_table + seq * stride_bt + pos // block_size, mask=pos_ok, other=0).to(tl.int64)
        offset = pos % block_size
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        # Masked loads return 0, never the stale (possibly NaN) bytes past a sequence's end.
        k = tl.load(k_cache + page[:, None] * stride_kp + offset[:, None] * stride_ks + kv_head * stride_kh
                    + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        s = tl.dot(q_tile, tl.trans(k.to(DOT_DTYPE)), input_precision="ieee") * scale_log2
        s = tl.where(row_ok[:, None] & (pos[None, :] <= last_key[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache + page[:, None] * stride_vp + offset[:, None] * stride_vs + kv_head * stride_vh
                    + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision="ieee")
        m_i = m_new
    acc = acc / tl.where(row_ok, l_i, 1.0)[:, None]
    tl.store(out + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od, acc,
             mask=row_ok[:, None] & d_ok[None, :])
