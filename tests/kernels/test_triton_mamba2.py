"""The Mamba-2 Triton kernels against their torch references: decode state update, chunked scan, gated RMSNorm.

SSM states live in strided views of a random-byte page pool: a conv-state-sized gap before
them, padding after, other layers' slabs around. Each test checks every byte outside the slots
an op may write is unchanged; fresh sequences' slots hold NaN, so reading them would show.
"""

import pytest
import torch
from mamba2_oracle import random_ssm_inputs
from triton_helpers import DEVICE, assert_close, needs_device, on_device

from runtime.kernels.rms_norm_gated import rms_norm_gated_ref, rms_norm_gated_triton
from runtime.kernels.ssm_state_update import selective_state_update_ref, selective_state_update_triton

# numpy warnings from the interpreter (invalid value, overflow) often mean an unmasked load read garbage.
pytestmark = [needs_device, pytest.mark.filterwarnings("error::RuntimeWarning")]
H, P, G, N = 4, 8, 2, 16
NUM_SLOTS = 8
NO_LIMIT = (0.0, float("inf"))


def ssm_state_pool(page_pool, state_dtype, head_dim=P, d_state=N, seed=3):
    """(NUM_SLOTS, H, P, N) states in slab 1 of a 3-slab pool, 192 bytes into the page, 40 bytes of padding after."""
    nbytes = H * head_dim * d_state * state_dtype.itemsize
    pool = on_device(page_pool(NUM_SLOTS, 3, nbytes + 232, seed=seed))
    states = pool.view(1, 192, state_dtype, (H, head_dim, d_state))
    states.copy_(torch.randn(states.shape) * 0.5)
    return pool, states


def on(inputs):
    return {k: v.to(DEVICE) for k, v in inputs.items()}


DTYPES = [
    (torch.float32, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
]


@pytest.mark.parametrize("dtype, state_dtype", DTYPES)
@pytest.mark.parametrize("dt_limit, per_channel_d", [(NO_LIMIT, False), ((0.05, 0.8), True)])
def test_state_update_matches_reference(page_pool, dtype, state_dtype, dt_limit, per_channel_d):
    torch.manual_seed(0)
    head_dim = 6  # odd: masked rows in the state tile
    pool, states = ssm_state_pool(page_pool, state_dtype, head_dim=head_dim)
    slots = torch.tensor([3, -1, 0, 5, -1, 7], device=DEVICE)
    inputs = on(random_ssm_inputs(len(slots), H, head_dim, G, N, dtype))
    if per_channel_d:
        inputs["D"] = torch.randn(H, head_dim, device=DEVICE).to(dtype)
    expected_states = states.clone()
    expected = selective_state_update_ref(expected_states, **inputs, dt_limit=dt_limit, state_indices=slots,
                                          out=torch.empty_like(inputs["x"]))
    pool.allow_writes(states, slots[slots >= 0])
    before = pool.snapshot()
    out = torch.full_like(inputs["x"], float("nan"))

    result = selective_state_update_triton(states, **inputs, dt_limit=dt_limit, state_indices=slots, out=out)

    assert result is out
    assert_close(out, expected, dtype)
    assert_close(states[slots[slots >= 0]], expected_states[slots[slots >= 0]], state_dtype)
    pool.assert_untouched_outside_allowed(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gated, group_size", [(True, 24), (False, 48), (True, 96)])
def test_rms_norm_gated_matches_reference(dtype, gated, group_size):
    torch.manual_seed(0)
    xz = torch.randn(13, 2, 96, device=DEVICE).to(dtype) * 2  # x and z as strided slices of one projection
    x, z = xz[:, 0], (xz[:, 1] if gated else None)
    weight = (torch.rand(96, device=DEVICE) + 0.5).to(dtype)
    expected = rms_norm_gated_ref(x, z, weight, 1e-5, group_size)
    out = rms_norm_gated_triton(x, z, weight, 1e-5, group_size)
    assert out.dtype == expected.dtype
    assert_close(out, expected)
