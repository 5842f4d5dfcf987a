"""selective_state_update_ref: one recurrence step per sequence, padding rows skipped, and HF parity."""

import pytest
import torch
from mamba2_oracle import random_ssm_inputs, recurrence_oracle, select_tokens

from runtime.kernels.ssm_state_update import selective_state_update_ref

H, P, G, N = 4, 8, 2, 16
NUM_SLOTS = 6
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 1e-2)}


def ssm_state_view(page_pool, state_dtype):
    nbytes = H * P * N * state_dtype.itemsize
    pool = page_pool(NUM_SLOTS, 2, nbytes + 64, seed=4)
    states = pool.view(1, 64, state_dtype, (H, P, N))
    states.copy_(torch.randn(states.shape) * 0.5)
    return pool, states


@pytest.mark.parametrize(
    "dtype, state_dtype",
    [(torch.float32, torch.float32), (torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)],
)
@pytest.mark.parametrize("dt_limit", [(0.0, float("inf")), (0.05, 0.8)])
def test_step_matches_recurrence_and_skips_padding(page_pool, dtype, state_dtype, dt_limit):
    torch.manual_seed(0)
    pool, states = ssm_state_view(page_pool, state_dtype)
    slots = torch.tensor([3, -1, 0, 5, -1])
    inputs = random_ssm_inputs(len(slots), H, P, G, N, dtype)
    initial = states.clone()
    pool.allow_writes(states, slots[slots >= 0])
    before = pool.snapshot()
    out = torch.full_like(inputs["x"], float("nan"))

    result = selective_state_update_ref(states, **inputs, dt_limit=dt_limit, state_indices=slots, out=out)

    assert result is out and out.dtype == dtype
    atol, rtol = TOLERANCES[dtype if state_dtype == torch.float32 else state_dtype]
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            assert torch.equal(out[row], torch.zeros(H, P, dtype=dtype))
            continue
        one = select_tokens(inputs, slice(row, row + 1))
        expected, final = recurrence_oracle(**one, dt_limit=dt_limit, state=initial[slot])
        torch.testing.assert_close(out[row].double(), expected[0], atol=atol, rtol=rtol)
        torch.testing.assert_close(states[slot].double(), final, atol=atol, rtol=rtol)
    pool.assert_untouched_outside_allowed(before)


def test_all_padding_touches_nothing(page_pool):
    pool, states = ssm_state_view(page_pool, torch.float32)
    inputs = random_ssm_inputs(2, H, P, G, N)
    before = pool.snapshot()
    out = torch.empty_like(inputs["x"])
    padding = torch.tensor([-1, -1])
    selective_state_update_ref(states, **inputs, dt_limit=(0.0, float("inf")), state_indices=padding, out=out)
    assert torch.equal(out, torch.zeros_like(out))
    pool.assert_untouched_outside_allowed(before)


def test_matches_hf_selective_state_update():
    """HF's torch mamba2_selective_state_update, called the way BambaMixer calls it (per-P broadcast params)."""
    from transformers.models.bamba import modeling_bamba as hf

    torch.manual_seed(1)
    inputs = random_ssm_inputs(3, H, P, G, N)
    states = torch.randn(3, H, P, N)
    theirs_state = states.clone()
    per_p = dict(  # BambaMixer broadcasts the per-head parameters over P (and N for A)
        dt=inputs["dt"][..., None].expand(-1, -1, P),
        A=inputs["A"][:, None, None].expand(-1, P, N),
        D=inputs["D"][:, None].expand(-1, P),
        dt_bias=inputs["dt_bias"][:, None].expand(-1, P),
    )
    theirs = hf.mamba2_selective_state_update(
        theirs_state, inputs["x"], B=inputs["B"], C=inputs["C"], dt_softplus=True, **per_p
    )
    out = torch.empty_like(inputs["x"])
    selective_state_update_ref(states, **inputs, dt_limit=(0.0, float("inf")), state_indices=torch.arange(3), out=out)
    torch.testing.assert_close(out, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, theirs_state, atol=1e-6, rtol=1e-5)
