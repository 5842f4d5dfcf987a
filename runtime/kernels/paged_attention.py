"""Causal attention of packed new tokens over a paged KV cache (decode and prefill over a cached prefix).

The reference gathers each sequence's pages and calls torch's scaled_dot_product_attention in
float32. Decodes (one new token) are batched, padded to the longest in their group, in groups
whose gathered keys stay under DECODE_GATHER_ELEMENTS; prefill chunks are done one sequence at
a time, which bounds memory by the largest sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from runtime.kernels.metadata import AttentionMetadata

# Decodes are batched in groups whose padded K gather holds at most this many elements (64 MiB of
# float32, as much again for V), so a large decode batch with long contexts does not gather its
# whole KV at once.
DECODE_GATHER_ELEMENTS = 1 << 24


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
    num_q_heads, head_dim = q.shape[1:]
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim
    assert num_q_heads % k_cache.shape[2] == 0
    assert out.shape == q.shape and block_table.shape[0] == meta.num_sequences
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    query_lens = [end - start for start, end in zip(starts, starts[1:])]
    decodes = [s for s, n in enumerate(query_lens) if n == 1]
    for group in _decode_groups(decodes, seq_lens, k_cache.shape[1], k_cache.shape[2] * head_dim):
        _decode_attention(q, k_cache, v_cache, block_table, meta, scale, out, group)
    for s, num_new in enumerate(query_lens):
        if num_new > 1:
            tokens = slice(starts[s], starts[s] + num_new)
            out[tokens] = _sequence_attention(q[tokens], k_cache, v_cache, block_table[s], seq_lens[s], scale)
    return out


def _decode_groups(decodes: list[int], seq_lens: list[int], block_size: int, per_token: int) -> list[list[int]]:
    """Runs of consecutive decodes whose K gather, padded to the run's longest sequence, fits in
    DECODE_GATHER_ELEMENTS (a run always holds at least one decode)."""
    groups: list[list[int]] = []
    longest = 0
    for s in decodes:
        padded = -(-max(longest, seq_lens[s]) // block_size) * block_size
        if groups and (len(groups[-1]) + 1) * padded * per_token <= DECODE_GATHER_ELEMENTS:
            groups[-1].append(s)
            longest = max(longest, seq_lens[s])
        else:
            groups.append([s])
            longest = seq_lens[s]
    return groups


def _gather_pages(cache: Tensor, pages: Tensor) -> Tensor:
    """(..., num_blocks) page ids -> (..., num_blocks * block_size, Hkv, D) float32 tokens."""
    tokens = cache[pages]
    return tokens.flatten(-4, -3).float()


def _sequence_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, pages: Tensor, seq_len: int, scale: float
) -> Tensor:
    """One sequence: q (n, Hq, D) are the last n of its seq_len positions. Returns (n, Hq, D) float32."""
    num_blocks = -(-seq_len // k_cache.shape[1])
    pages = pages[:num_blocks].long()
    k = _gather_pages(k_cache, pages)[:seq_len]
    v = _gather_pages(v_cache, pages)[:seq_len]
    # SDPA wants (batch, heads, tokens, D); causal_lower_right aligns the n queries with the last n keys.
    o = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=causal_lower_right(q.shape[0], seq_len),
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)


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
    """All one-token sequences at once, padded to the longest; the new token attends every cached key."""
    seqs = torch.tensor(decodes, device=q.device)
    tokens = meta.query_start_loc[seqs].long()
    seq_lens = meta.seq_lens[seqs].long()
    max_len = int(seq_lens.max())
    num_blocks = -(-max_len // k_cache.shape[1])
    # Entries past a sequence's last block may be unset (-1); they are masked below.
    pages = block_table[seqs, :num_blocks].long().clamp(min=0)
    valid = torch.arange(num_blocks * k_cache.shape[1], device=q.device) < seq_lens[:, None]
    # Slots past a sequence's end hold stale or never-written bytes, possibly NaN; masking scores alone
    # would still give 0 * NaN = NaN in probs @ v, so zero them.
    k = _gather_pages(k_cache, pages).masked_fill_(~valid[:, :, None, None], 0.0)
    v = _gather_pages(v_cache, pages).masked_fill_(~valid[:, :, None, None], 0.0)
    o = F.scaled_dot_product_attention(
        q[tokens].float()[:, :, None],
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    out[tokens] = o[:, :, 0].to(out.dtype)
