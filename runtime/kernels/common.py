"""Small pieces shared by the Mamba references: the time step, and reading/writing per-sequence states."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

NO_DT_LIMIT = (0.0, float("inf"))


def time_step(dt: Tensor, dt_bias: Tensor | None, dt_limit: tuple[float, float]) -> Tensor:
    """dt' = softplus(dt + dt_bias) in float32, clamped to dt_limit unless it is (0, inf) (HF does the same)."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    dt = F.softplus(dt)
    if tuple(dt_limit) != NO_DT_LIMIT:
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def gather_initial_states(states: Tensor, state_indices: Tensor, has_initial_state: Tensor) -> Tensor:
    """(S, *state_shape) float32: states[slot] where a sequence resumes, zeros for a fresh or padded one."""
    init = torch.zeros(state_indices.shape[0], *states.shape[1:], dtype=torch.float32, device=states.device)
    # Index rather than multiply by a mask: a fresh sequence's slot may hold stale or NaN bytes.
    resume = has_initial_state & (state_indices >= 0)
    init[resume] = states[state_indices[resume]].float()
    return init


def scatter_states(states: Tensor, state_indices: Tensor, new_states: Tensor) -> None:
    """states[slot] = new_states for every sequence whose slot is not -1 (padding)."""
    keep = state_indices >= 0
    states[state_indices[keep]] = new_states[keep].to(states.dtype)
