"""Host-side per-step metadata, built once per step and shared by every layer and both backends.

The batch is packed: the new tokens of S sequences lie back to back, with offsets in
`query_start_loc` (S+1,) int32. Mamba prefill additionally splits every sequence into logical
chunks that never span two sequences and whose boundaries fall on absolute positions that are
multiples of the chunk size Q (vLLM's chunk-aligned varlen design): a resumed sequence whose
cached prefix is not a multiple of Q gets a short first chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor


@dataclass(frozen=True)
class AttentionMetadata:
    num_sequences: int
    query_start_loc: Tensor  # (S+1,) int32: offsets of each sequence's new tokens in the packed batch
    seq_lens: Tensor  # (S,) int32: cached prefix + new tokens per sequence
    max_query_len: int
    max_seq_len: int


@dataclass(frozen=True)
class MambaPrefillMetadata:
    num_sequences: int
    query_start_loc: Tensor  # (S+1,) int32, offsets within the prefill tokens passed to the op
    has_initial_state: Tensor  # (S,) bool: start from the cached state (a resumed prefill chunk) or from zeros
    chunk_size: int  # Q, from the model config
    cu_chunk_seqlens: Tensor  # (C+1,) int32: logical chunks; a chunk never spans two sequences
    chunk_seq_idx: Tensor  # (C,) int32: the sequence of each chunk
    last_chunk_indices: Tensor  # (S,) int64: each sequence's last chunk
    max_query_len: int


def _offsets(lengths: list[int]) -> list[int]:
    return [0, *accumulate(lengths)]


def build_attention_metadata(
    query_lens: list[int], seq_lens: list[int], device: torch.device | str
) -> AttentionMetadata:
    assert len(query_lens) == len(seq_lens) > 0
    assert all(0 < q <= s for q, s in zip(query_lens, seq_lens)), "each sequence needs 1..seq_len new tokens"
    return AttentionMetadata(
        num_sequences=len(query_lens),
        query_start_loc=torch.tensor(_offsets(query_lens), dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def chunk_lengths(num_computed: int, num_new: int, chunk_size: int) -> list[int]:
    """Lengths of one sequence's logical chunks; every boundary is an absolute multiple of chunk_size."""
    lengths = []
    position, end = num_computed, num_computed + num_new
    while position < end:
        chunk_end = min((position // chunk_size + 1) * chunk_size, end)
        lengths.append(chunk_end - position)
        position = chunk_end
    return lengths


def build_mamba_prefill_metadata(
    query_lens: list[int], num_computed_tokens: list[int], chunk_size: int, device: torch.device | str
) -> MambaPrefillMetadata:
    assert len(query_lens) == len(num_computed_tokens) > 0
    assert all(q > 0 for q in query_lens) and all(n >= 0 for n in num_computed_tokens)
    assert chunk_size > 0
    lengths: list[int] = []
    seq_idx: list[int] = []
    last_chunks: list[int] = []
    for i, (num_new, num_computed) in enumerate(zip(query_lens, num_computed_tokens)):
        per_seq = chunk_lengths(num_computed, num_new, chunk_size)
        lengths += per_seq
        seq_idx += [i] * len(per_seq)
        last_chunks.append(len(lengths) - 1)
    return MambaPrefillMetadata(
        num_sequences=len(query_lens),
        query_start_loc=torch.tensor(_offsets(query_lens), dtype=torch.int32, device=device),
        has_initial_state=torch.tensor([n > 0 for n in num_computed_tokens], dtype=torch.bool, device=device),
        chunk_size=chunk_size,
        cu_chunk_seqlens=torch.tensor(_offsets(lengths), dtype=torch.int32, device=device),
        chunk_seq_idx=torch.tensor(seq_idx, dtype=torch.int32, device=device),
        last_chunk_indices=torch.tensor(last_chunks, dtype=torch.int64, device=device),
        max_query_len=max(query_lens),
    )
