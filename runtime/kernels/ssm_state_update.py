"""Mamba-2 decode: one recurrence step per sequence, in place on the SSM state pool.

    dt' = softplus(dt + dt_bias) clamped to dt_limit
    state = state * exp(dt' A) + dt' x (x) B
    y = state . C + D x

Math is float32; y uses the float32 state, which is then stored in the pool's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.kernels.common import time_step


def selective_state_update_ref(
    ssm_states: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    dt_limit: tuple[float, float],
    state_indices: Tensor,
    out: Tensor,
) -> Tensor:
    """One decode step of every sequence.

    ssm_states: (num_slots, H, P, N); x, out: (S, H, P); dt: (S, H) raw; A: (H,) float32;
    B, C: (S, G, N), head h uses group h // (H // G); D: (H,) (or (H, P)); dt_bias: (H,);
    state_indices: (S,), -1 = padding (skipped: no read, no write, output zero).
    state = state * exp(dt' A) + dt' x (x) B; y = state . C + D x. In place on ssm_states.
    Writes out and returns it.
    """
    num_seqs, num_heads, head_dim = x.shape
    num_groups, d_state = B.shape[1:]
    assert num_heads % num_groups == 0 and A.shape == (num_heads,) and A.dtype == torch.float32
    assert dt.shape == (num_seqs, num_heads) and B.shape == C.shape == (num_seqs, num_groups, d_state)
    assert ssm_states.shape[1:] == (num_heads, head_dim, d_state) and out.shape == x.shape
    assert state_indices.shape == (num_seqs,)

    keep = state_indices >= 0
    slots = state_indices[keep]
    dt = time_step(dt[keep], dt_bias, dt_limit)  # (S', H)
    x_kept = x[keep].float()
    # Heads are split as (G, H // G) so that B and C broadcast per group without being copied per head.
    xdt = (x_kept * dt[..., None]).unflatten(1, (num_groups, -1))  # (S', G, R, P)
    b = B[keep].float()[:, :, None, None, :]  # (S', G, 1, 1, N)
    state = ssm_states[slots].float().mul_(torch.exp(dt * A)[..., None, None])
    state = state.unflatten(1, (num_groups, -1)).addcmul_(xdt[..., None], b)  # (S', G, R, P, N)
    ssm_states[slots] = state.flatten(1, 2).to(ssm_states.dtype)

    c = C[keep].float()[:, :, None, :, None]  # (S', G, 1, N, 1)
    y = (state @ c).flatten(1, 2).squeeze(-1)  # (S', H, P)
    y += D.float().reshape(num_heads, -1) * x_kept
    out[keep] = y.to(out.dtype)
    out[~keep] = 0
    return out
