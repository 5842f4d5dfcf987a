"""Pieces shared by the Mamba references: the time step, per-sequence states, and the inter-chunk pass."""

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


def pass_states(
    chunk_states: Tensor, chunk_decay: Tensor, init: Tensor, last_chunk_indices: Tensor
) -> tuple[Tensor, Tensor]:
    """The sequential inter-chunk pass H_c = decay_c * H_{c-1} + S_c, restarting from init at each sequence.

    chunk_states: (K, *state) each chunk's state from a zero start; chunk_decay: (K, ...) broadcast
    against a state; init: (S, *state); each sequence's chunks are consecutive and end at
    last_chunk_indices (S,). Returns the state at each chunk's start (K, *state) and each sequence's
    final state (S, *state). It steps through the k-th chunk of every sequence at once, so it loops
    max-chunks-per-sequence times.
    """
    last = last_chunk_indices.long()
    first = torch.cat([last.new_zeros(1), last[:-1] + 1])
    num_chunks = last - first + 1
    state = init.clone()
    start_states = torch.empty_like(chunk_states)
    for k in range(int(num_chunks.max())):
        seqs = torch.nonzero(num_chunks > k).squeeze(1)
        chunk = first[seqs] + k
        start_states[chunk] = state[seqs]
        state[seqs] = chunk_decay[chunk] * state[seqs] + chunk_states[chunk]
    return start_states, state
