"""LFM2's gated short convolution: the reference against a plain conv, and the Triton kernels against
the reference (under the interpreter on a CPU), with states in strided views of a random-byte page pool."""

import pytest
import torch
import torch.nn.functional as F
from triton_helpers import DEVICE, assert_close, needs_device, on_device

from runtime.kernels.metadata import build_mamba_prefill_metadata
from runtime.kernels.short_conv import (
    short_conv_fn_ref,
    short_conv_fn_triton,
    short_conv_update_ref,
    short_conv_update_triton,
)

DIM, NUM_SLOTS = 40, 8  # DIM is not a power of two


def inputs(num_tokens, dtype, width, with_bias, device="cpu"):
    # bcx as a strided slice of a wider tensor, as a projection's output may be.
    bcx = torch.randn(num_tokens, 3 * DIM + 8, device=device).to(dtype)[:, 8:]
    weight = (torch.randn(DIM, width, device=device) * 0.5).to(dtype)
    bias = torch.randn(DIM, device=device).to(dtype) if with_bias else None
    return bcx, weight, bias


def plain_short_conv(bcx, weight, bias):
    """HF's computation for one fresh sequence: C * conv1d(B * x) with W-1 zeros of left padding."""
    b, c, x = bcx.double().chunk(3, dim=-1)
    bx = (b * x).T[None]  # (1, D, L)
    y = F.conv1d(F.pad(bx, (weight.shape[1] - 1, 0)), weight.double()[:, None], bias, groups=DIM)
    return c * y[0].T


@pytest.mark.parametrize("with_bias", [False, True])
def test_reference_equals_a_plain_conv_and_carries_its_state(with_bias):
    torch.manual_seed(0)
    width = 3
    bcx, weight, bias = inputs(11, torch.float64, width, with_bias)
    expected = plain_short_conv(bcx, weight, bias)
    states = torch.full((2, width - 1, DIM), float("nan"), dtype=torch.float64)
    slot = torch.tensor([1])
    # Prefill 1 token (shorter than W-1), then 6, then decode the remaining 4 one by one.
    out = [short_conv_fn_ref(bcx[:1], weight, bias, states, slot, build_mamba_prefill_metadata([1], [0], 4, "cpu")),
           short_conv_fn_ref(bcx[1:7], weight, bias, states, slot, build_mamba_prefill_metadata([6], [1], 4, "cpu"))]
    out += [short_conv_update_ref(bcx[t : t + 1], weight, bias, states, slot) for t in range(7, 11)]
    # The ops compute in float32 whatever the inputs' dtype.
    torch.testing.assert_close(torch.cat(out), expected, atol=1e-5, rtol=1e-5)
    b, _, x = bcx.chunk(3, dim=-1)
    torch.testing.assert_close(states[1], (b * x)[-(width - 1):], atol=1e-6, rtol=1e-6)
    assert states[0].isnan().all()


def state_pool(page_pool, dtype, width):
    nbytes = (width - 1) * DIM * dtype.itemsize
    pool = on_device(page_pool(NUM_SLOTS, 2, nbytes + 32, seed=3))
    states = pool.view(1, 16, dtype, (width - 1, DIM))
    states.copy_(torch.randn(states.shape).to(dtype))
    return pool, states


@needs_device
@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("dtype, state_dtype, width, with_bias", [
    (torch.float32, torch.float32, 3, False),
    (torch.float32, torch.float32, 4, True),
    (torch.bfloat16, torch.bfloat16, 3, False),
    (torch.bfloat16, torch.float32, 2, True),
])
def test_prefill_kernel_matches_reference(page_pool, dtype, state_dtype, width, with_bias):
    torch.manual_seed(1)
    pool, states = state_pool(page_pool, state_dtype, width)
    # A one-token resumed sequence (shorter than W-1), a fresh one crossing chunk boundaries, a
    # sequence resumed one token before a boundary, and a padded one.
    query_lens, computed = [1, 13, 5, 3], [4, 0, 7, 0]
    slots = torch.tensor([5, 1, 2, -1], device=DEVICE)
    states[1] = float("nan")  # the fresh sequence's slot: reading it would show
    meta = build_mamba_prefill_metadata(query_lens, computed, chunk_size=8, device=DEVICE)
    bcx, weight, bias = inputs(sum(query_lens), dtype, width, with_bias, DEVICE)
    expected_states = states.clone()
    expected = short_conv_fn_ref(bcx, weight, bias, expected_states, slots, meta)
    pool.allow_writes(states, slots[slots >= 0])
    before = pool.snapshot()

    out = short_conv_fn_triton(bcx, weight, bias, states, slots, meta)

    assert out.dtype == dtype and out.shape == (sum(query_lens), DIM)
    assert_close(out, expected)
    written = slots[slots >= 0]
    assert_close(states[written], expected_states[written])
    pool.assert_untouched_outside_allowed(before)


@needs_device
@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("dtype, width", [(torch.float32, 3), (torch.bfloat16, 4)])
def test_update_kernel_matches_reference(page_pool, dtype, width):
    torch.manual_seed(2)
    pool, states = state_pool(page_pool, dtype, width)
    bcx, weight, bias = inputs(4, dtype, width, True, DEVICE)
    slots = torch.tensor([4, -1, 0, 7], device=DEVICE)
    expected_states = states.clone()
    expected = short_conv_update_ref(bcx, weight, bias, expected_states, slots)
    pool.allow_writes(states, slots[slots >= 0])
    before = pool.snapshot()

    out = short_conv_update_triton(bcx, weight, bias, states, slots)

    assert_close(out, expected)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_close(states[slots[slots >= 0]], expected_states[slots[slots >= 0]])
    pool.assert_untouched_outside_allowed(before)
