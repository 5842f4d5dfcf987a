"""The Mamba-1 Triton kernels (selective scan for prefill, one-step update for decode) against their references.

States live in strided views of a random-byte page pool (padding before and after, another
slab beside); fresh sequences' slots hold NaN, and bytes outside the written slots must not change.
"""

import pytest
import torch
from triton_helpers import DEVICE, assert_close, needs_device, on_device

from runtime.kernels.metadata import build_mamba_prefill_metadata
from runtime.kernels.selective_scan import (
    selective_scan_ref,
    selective_scan_triton,
    selective_state_update_mamba1_ref,
    selective_state_update_mamba1_triton,
)

# numpy warnings from the interpreter (invalid value, overflow) often mean an unmasked load read garbage.
pytestmark = [needs_device, pytest.mark.filterwarnings("error::RuntimeWarning")]
DM, N, NUM_SLOTS = 72, 12, 8  # DM spans two channel blocks, the second partly masked; N is not a power of 2


def random_inputs(num_tokens, dtype, gated=True, with_dt_bias=True):
    # x and z as strided slices of one projection, as the mixer splits them.
    xz = torch.randn(num_tokens, 2, DM, device=DEVICE).to(dtype)
    return dict(
        x=xz[:, 0],
        dt=(torch.randn(num_tokens, DM, device=DEVICE) - 1).to(dtype),
        A=-torch.exp(torch.randn(DM, N, device=DEVICE) * 0.5),
        B=torch.randn(num_tokens, N, device=DEVICE).to(dtype),
        C=torch.randn(num_tokens, N, device=DEVICE).to(dtype),
        D=torch.randn(DM, device=DEVICE).to(dtype),
        dt_bias=(torch.rand(DM, device=DEVICE) * 0.5).to(dtype) if with_dt_bias else None,
        z=xz[:, 1] if gated else None,
    )


def state_pool(page_pool, state_dtype):
    nbytes = DM * N * state_dtype.itemsize
    pool = on_device(page_pool(NUM_SLOTS, 2, nbytes + 40, seed=5))
    states = pool.view(1, 24, state_dtype, (DM, N))
    states.copy_(torch.randn(states.shape))
    return pool, states


@pytest.mark.parametrize(
    "dtype, state_dtype, gated, with_dt_bias",
    [
        (torch.float32, torch.float32, True, True),
        (torch.float32, torch.float32, False, False),
        (torch.float16, torch.float32, True, True),
        (torch.bfloat16, torch.bfloat16, True, True),
    ],
)
def test_selective_scan_matches_reference(page_pool, dtype, state_dtype, gated, with_dt_bias):
    torch.manual_seed(0)
    pool, states = state_pool(page_pool, state_dtype)
    query_lens, computed = [7, 1, 12, 3], [0, 4, 9, 0]
    slots = torch.tensor([2, 5, 0, -1], device=DEVICE)
    states[2] = float("nan")  # a fresh sequence must not read its slot
    meta = build_mamba_prefill_metadata(query_lens, computed, 16, DEVICE)
    inputs = random_inputs(sum(query_lens), dtype, gated, with_dt_bias)
    expected_states = states.clone()
    expected = selective_scan_ref(**inputs, ssm_states=expected_states, state_indices=slots, meta=meta,
                                  out=torch.empty_like(inputs["x"]))
    pool.allow_writes(states, slots[slots >= 0])
    before = pool.snapshot()
    out = torch.full_like(inputs["x"], float("nan"))

    result = selective_scan_triton(**inputs, ssm_states=states, state_indices=slots, meta=meta, out=out)

    assert result is out
    assert_close(out, expected)
    assert_close(states[slots[slots >= 0]], expected_states[slots[slots >= 0]])
    pool.assert_untouched_outside_allowed(before)


@pytest.mark.parametrize("dtype, state_dtype, gated", [(torch.float32, torch.float32, True),
                                                       (torch.bfloat16, torch.float32, False)])
def test_state_update_matches_reference(page_pool, dtype, state_dtype, gated):
    torch.manual_seed(1)
    pool, states = state_pool(page_pool, state_dtype)
    slots = torch.tensor([4, -1, 0, 7], device=DEVICE)
    inputs = random_inputs(len(slots), dtype, gated)
    expected_states = states.clone()
    expected = selective_state_update_mamba1_ref(expected_states, **inputs, state_indices=slots,
                                                 out=torch.empty_like(inputs["x"]))
    pool.allow_writes(states, slots[slots >= 0])
    before = pool.snapshot()
    out = torch.full_like(inputs["x"], float("nan"))

    selective_state_update_mamba1_triton(states, **inputs, state_indices=slots, out=out)

    assert_close(out, expected)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_close(states[slots[slots >= 0]], expected_states[slots[slots >= 0]])
    pool.assert_untouched_outside_allowed(before)
