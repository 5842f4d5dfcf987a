"""causal_conv1d_fn_ref / causal_conv1d_update_ref against a per-token oracle, split vs one shot, and HF.

Conv states live in strided views of a random-byte page pool; the slots of fresh sequences are
filled with NaN so that reading them (instead of starting from zeros) would show.
"""

import pytest
import torch
import torch.nn.functional as F

from runtime.kernels.causal_conv1d import causal_conv1d_fn_ref, causal_conv1d_update_ref
from runtime.kernels.metadata import build_mamba_prefill_metadata

DIM, WIDTH, NUM_SLOTS = 24, 4, 8
TOLERANCES = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (1e-2, 8e-3)}


def conv_oracle(x, weight, bias, state, activation):
    """One sequence, one token at a time: x (L, D), state (W-1, D) -> out (L, D), new state; float64."""
    window = state.double()
    outs = []
    for token in x.double():
        window = torch.cat([window, token[None]])
        y = (window * weight.double().T).sum(0) + (0 if bias is None else bias.double())
        outs.append(F.silu(y) if activation else y)
        window = window[1:]
    return torch.stack(outs), window


def state_pool(page_pool, dtype):
    """A (NUM_SLOTS, W-1, D) conv-state view in slab 1 of a 2-slab pool, padding around it."""
    nbytes = (WIDTH - 1) * DIM * dtype.itemsize
    pool = page_pool(NUM_SLOTS, 2, nbytes + 48, seed=2)
    states = pool.view(1, 16, dtype, (WIDTH - 1, DIM))
    states.copy_(torch.randn(states.shape, dtype=dtype))
    return pool, states


def random_weights(dtype, with_bias=True):
    weight = torch.randn(DIM, WIDTH, dtype=dtype) * 0.5
    return weight, (torch.randn(DIM, dtype=dtype) if with_bias else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation, with_bias", [("silu", True), (None, False)])
def test_prefill_matches_per_token_oracle(page_pool, dtype, activation, with_bias):
    torch.manual_seed(0)
    pool, states = state_pool(page_pool, dtype)
    weight, bias = random_weights(dtype, with_bias)
    # Lengths cover 1 and 2 (< W-1: the old state shifts), and longer; one padded sequence (slot -1).
    query_lens, computed = [1, 9, 2, 5, 6], [4, 0, 3, 0, 10]
    slots = torch.tensor([5, 1, 6, -1, 2])
    for s, n in enumerate(computed):
        if n == 0 and slots[s] >= 0:
            states[slots[s]] = float("nan")
    meta = build_mamba_prefill_metadata(query_lens, computed, chunk_size=4, device="cpu")
    x = torch.randn(sum(query_lens), DIM, dtype=dtype)
    initial = states.clone()
    written = slots[slots >= 0]
    pool.allow_writes(states, written)
    before = pool.snapshot()

    out = causal_conv1d_fn_ref(x, weight, bias, states, slots, meta, activation=activation)

    assert out.dtype == dtype and out.shape == x.shape
    atol, rtol = TOLERANCES[dtype]
    starts = meta.query_start_loc.tolist()
    for s, slot in enumerate(slots.tolist()):
        piece = slice(starts[s], starts[s + 1])
        start_state = initial[slot] if slot >= 0 and computed[s] else torch.zeros(WIDTH - 1, DIM)
        expected, new_state = conv_oracle(x[piece], weight, bias, start_state, activation)
        torch.testing.assert_close(out[piece].double(), expected, atol=atol, rtol=rtol)
        if slot >= 0:
            torch.testing.assert_close(states[slot].double(), new_state, atol=0, rtol=0)
    pool.assert_untouched_outside_allowed(before)


def test_split_prefill_then_decode_equals_one_shot(page_pool):
    torch.manual_seed(1)
    _, states = state_pool(page_pool, torch.float32)
    weight, bias = random_weights(torch.float32)
    total = [20, 11]
    slots = torch.tensor([3, 6])
    x = [torch.randn(n, DIM) for n in total]

    one_shot = causal_conv1d_fn_ref(
        torch.cat(x), weight, bias, states, slots, build_mamba_prefill_metadata(total, [0, 0], 4, "cpu")
    )
    one_shot_states = states[slots].clone()

    # The same sequences as a fresh piece, a resumed piece (the 2-token one is shorter than W-1), then decodes.
    pieces = [(0, 7), (0, 5)], [(7, 15), (5, 7)]
    outs = [[], []]
    for i, piece in enumerate(pieces):
        lens = [end - start for start, end in piece]
        meta = build_mamba_prefill_metadata(lens, [start for start, _ in piece], 4, "cpu")
        assert meta.has_initial_state.tolist() == [i > 0, i > 0]
        tokens = torch.cat([x[s][start:end] for s, (start, end) in enumerate(piece)])
        y = causal_conv1d_fn_ref(tokens, weight, bias, states, slots, meta)
        outs[0].append(y[: lens[0]])
        outs[1].append(y[lens[0] :])
    prefilled = [end for _, end in pieces[-1]]
    for step in range(max(n - done for n, done in zip(total, prefilled))):
        active = [s for s in range(2) if prefilled[s] + step < total[s]]
        tokens = torch.stack([x[s][prefilled[s] + step] for s in active])
        y = causal_conv1d_update_ref(tokens, weight, bias, states, slots[active])
        for row, s in enumerate(active):
            outs[s].append(y[row : row + 1])

    torch.testing.assert_close(torch.cat(outs[0] + outs[1]), one_shot, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(states[slots], one_shot_states, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_matches_oracle_and_skips_padding(page_pool, dtype):
    torch.manual_seed(2)
    pool, states = state_pool(page_pool, dtype)
    weight, bias = random_weights(dtype)
    slots = torch.tensor([4, -1, 0, 7])
    x = torch.randn(4, DIM, dtype=dtype)
    initial = states.clone()
    pool.allow_writes(states, slots[slots >= 0])
    before = pool.snapshot()

    out = causal_conv1d_update_ref(x, weight, bias, states, slots)

    atol, rtol = TOLERANCES[dtype]
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            assert torch.equal(out[row], torch.zeros(DIM, dtype=dtype))
            continue
        expected, new_state = conv_oracle(x[row : row + 1], weight, bias, initial[slot], "silu")
        torch.testing.assert_close(out[row].double(), expected[0], atol=atol, rtol=rtol)
        torch.testing.assert_close(states[slot].double(), new_state, atol=0, rtol=0)
    pool.assert_untouched_outside_allowed(before)


def test_matches_hf_conv_fallbacks():
    """HF's causal_conv1d_fn / _update torch fallbacks (channels first; HF's cache keeps W columns, ours W-1)."""
    from transformers.models.bamba import modeling_bamba as hf

    torch.manual_seed(3)
    weight, bias = random_weights(torch.float32)
    x = torch.randn(10, DIM)
    states = torch.zeros(1, WIDTH - 1, DIM)
    meta = build_mamba_prefill_metadata([9], [0], 4, "cpu")
    ours = causal_conv1d_fn_ref(x[:9], weight, bias, states, torch.tensor([0]), meta)
    theirs = hf.causal_conv1d_fn(x[:9].T[None], weight, bias, activation="silu")[0].T
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)

    hf_state = x[9 - WIDTH : 9].T[None].clone()  # the last W inputs, channels first
    ours = causal_conv1d_update_ref(x[9:], weight, bias, states, torch.tensor([0]))
    theirs = hf.causal_conv1d_update(x[9:].T[None], hf_state, weight, bias, activation="silu")[:, :, 0]
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(states[0], hf_state[0, :, 1:].T, atol=0, rtol=0)
