"""causal_conv1d_fn_triton / causal_conv1d_update_triton against their torch references.

Conv states live in strided views of a random-byte page pool (padding before and after them,
another layer's slab beside); fresh sequences' slots hold NaN, so reading them would show, and
every byte outside the slots an op may write must stay unchanged.
"""

import pytest
import torch
from triton_helpers import DEVICE, assert_close, needs_device, on_device

from runtime.kernels.causal_conv1d import (
    causal_conv1d_fn_ref,
    causal_conv1d_fn_triton,
    causal_conv1d_update_ref,
    causal_conv1d_update_triton,
)
from runtime.kernels.metadata import build_mamba_prefill_metadata

# numpy warnings from the interpreter (invalid value, overflow) often mean an unmasked load read garbage.
pytestmark = [needs_device, pytest.mark.filterwarnings("error::RuntimeWarning")]
DIM, NUM_SLOTS = 200, 8  # DIM is not a multiple of the channel block


def state_pool(page_pool, dtype, width):
    nbytes = (width - 1) * DIM * dtype.itemsize
    pool = on_device(page_pool(NUM_SLOTS, 2, nbytes + 48, seed=2))
    states = pool.view(1, 16, dtype, (width - 1, DIM))
    states.copy_(torch.randn(states.shape).to(dtype))
    return pool, states


def conv_inputs(num_tokens, dtype, width, with_bias):
    # x as a strided slice of a wider projection, as the mixer passes it.
    x = torch.randn(num_tokens, DIM + 40, device=DEVICE).to(dtype)[:, 24 : 24 + DIM]
    weight = (torch.randn(DIM, width, device=DEVICE) * 0.5).to(dtype)
    bias = torch.randn(DIM, device=DEVICE).to(dtype) if with_bias else None
    return x, weight, bias


@pytest.mark.parametrize(
    "dtype, state_dtype, width, activation, with_bias",
    [
        (torch.float32, torch.float32, 4, "silu", True),
        (torch.float32, torch.float32, 2, None, False),
        (torch.float16, torch.float16, 4, "silu", True),
        (torch.bfloat16, torch.bfloat16, 4, "silu", True),
        (torch.bfloat16, torch.float32, 3, "silu", False),
    ],
)
def test_prefill_matches_reference(page_pool, dtype, state_dtype, width, activation, with_bias):
    torch.manual_seed(0)
    pool, states = state_pool(page_pool, state_dtype, width)
    x_all, weight, bias = conv_inputs(52, dtype, width, with_bias)
    # Lengths 1 and 2 (< W-1: the old state shifts); resumed one token before a chunk boundary (a
    # one-token first chunk, so the next chunk also reads the old state); a padded sequence.
    query_lens, computed = [1, 19, 2, 5, 13, 12], [4, 0, 3, 0, 7, 10]
    slots = torch.tensor([5, 1, 6, -1, 2, 0], device=DEVICE)
    for s, n in enumerate(computed):
        if n == 0 and slots[s] >= 0:
            states[slots[s]] = float("nan")
    meta = build_mamba_prefill_metadata(query_lens, computed, chunk_size=8, device=DEVICE)
    x = x_all[: sum(query_lens)]
    expected_states = states.clone()
    expected = causal_conv1d_fn_ref(x, weight, bias, expected_states, slots, meta, activation=activation)
    pool.allow_writes(states, slots[slots >= 0])
    before = pool.snapshot()

    out = causal_conv1d_fn_triton(x, weight, bias, states, slots, meta, activation=activation)

    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, expected)
    written = slots[slots >= 0]
    assert_close(states[written], expected_states[written])
    pool.assert_untouched_outside_allowed(before)


@pytest.mark.parametrize("dtype, width", [(torch.float32, 4), (torch.float32, 2), (torch.bfloat16, 4)])
def test_update_matches_reference(page_pool, dtype, width):
    torch.manual_seed(2)
    pool, states = state_pool(page_pool, dtype, width)
    x, weight, bias = conv_inputs(5, dtype, width, with_bias=True)
    slots = torch.tensor([4, -1, 0, 7, 3], device=DEVICE)
    expected_states = states.clone()
    expected = causal_conv1d_update_ref(x, weight, bias, expected_states, slots)
    pool.allow_writes(states, slots[slots >= 0])
    before = pool.snapshot()

    out = causal_conv1d_update_triton(x, weight, bias, states, slots)

    assert_close(out, expected)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(states[slots[slots >= 0]], expected_states[slots[slots >= 0]])  # a pure shift: exact
    pool.assert_untouched_outside_allowed(before)
