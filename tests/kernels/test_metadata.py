"""Host-side metadata: packed offsets, and chunk boundaries on absolute multiples of the chunk size."""

import sys

import pytest
import torch

from runtime.kernels.metadata import build_attention_metadata, build_mamba_prefill_metadata, chunk_lengths


def test_attention_metadata():
    meta = build_attention_metadata([1, 5, 1], [7, 5, 30], "cpu")
    assert meta.num_sequences == 3
    assert meta.query_start_loc.dtype == torch.int32 and meta.query_start_loc.tolist() == [0, 1, 6, 7]
    assert meta.seq_lens.dtype == torch.int32 and meta.seq_lens.tolist() == [7, 5, 30]
    assert (meta.max_query_len, meta.max_seq_len) == (5, 30)


@pytest.mark.skipif(sys.flags.optimize > 0, reason="an invariant's assert, which python -O removes")
def test_attention_metadata_rejects_more_new_tokens_than_the_sequence_has():
    with pytest.raises(AssertionError):
        build_attention_metadata([4], [3], "cpu")


@pytest.mark.parametrize(
    "num_computed, num_new, expected",
    [
        (0, 5, [5]),  # shorter than Q
        (0, 16, [16]),
        (0, 37, [16, 16, 5]),
        (5, 30, [11, 16, 3]),  # resumed off-boundary: a short first chunk realigns to 16
        (16, 20, [16, 4]),  # resumed on a boundary
        (13, 2, [2]),  # stays inside one chunk
        (15, 1, [1]),
    ],
)
def test_chunk_lengths_align_to_absolute_multiples(num_computed, num_new, expected):
    assert chunk_lengths(num_computed, num_new, 16) == expected
    ends = [num_computed + sum(expected[: i + 1]) for i in range(len(expected))]
    assert all(end % 16 == 0 for end in ends[:-1])


def test_mamba_prefill_metadata():
    # Sequences: fresh 37 tokens; resumed at 5 with 30 new; resumed at 32 with 3 new; fresh 4.
    meta = build_mamba_prefill_metadata([37, 30, 3, 4], [0, 5, 32, 0], chunk_size=16, device="cpu")
    assert meta.num_sequences == 4 and meta.chunk_size == 16 and meta.max_query_len == 37
    assert meta.query_start_loc.dtype == torch.int32 and meta.query_start_loc.tolist() == [0, 37, 67, 70, 74]
    assert meta.has_initial_state.dtype == torch.bool
    assert meta.has_initial_state.tolist() == [False, True, True, False]
    # chunk lengths: [16, 16, 5] [11, 16, 3] [3] [4]
    assert meta.cu_chunk_seqlens.dtype == torch.int32
    assert meta.cu_chunk_seqlens.tolist() == [0, 16, 32, 37, 48, 64, 67, 70, 74]
    assert meta.chunk_seq_idx.dtype == torch.int32 and meta.chunk_seq_idx.tolist() == [0, 0, 0, 1, 1, 1, 2, 3]
    assert meta.last_chunk_indices.dtype == torch.int64 and meta.last_chunk_indices.tolist() == [2, 5, 6, 7]
