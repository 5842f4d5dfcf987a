"""Pieces shared by the Mamba references: the time step, per-sequence states, a verify's waves, and the
inter-chunk pass."""

from __future__ import annotations

from typing import Callable, Sequence

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


def check_waves(state_indices: Tensor, waves: Sequence[int] | None, rows: int) -> None:
    """A decode kernel's pages: (rows,) without waves; with them, (len(waves) + 1, waves[0]) page chains over
    rows = sum(waves) rows in waves, each wave no larger than the one before (runtime/waves.py)."""
    if waves is None:
        assert state_indices.shape == (rows,), f"state_indices must be ({rows},), got {tuple(state_indices.shape)}"
        return
    assert len(waves) >= 1 and sum(waves) == rows, f"waves {tuple(waves)} must cover the {rows} rows"
    assert all(a >= b > 0 for a, b in zip(waves, waves[1:])), f"waves {tuple(waves)} must not grow"
    assert state_indices.shape == (len(waves) + 1, waves[0]), (
        f"state_indices must be ({len(waves) + 1}, {waves[0]}) page chains, got {tuple(state_indices.shape)}")


def in_waves(states: Tensor, state_indices: Tensor, waves: Sequence[int] | None,
             step: Callable[[slice, Tensor], None]) -> None:
    """Run a decode kernel that steps each sequence's state in place, `step(rows, pages)`, over a verify's waves.

    Without waves, state_indices is (S,) and the one step runs in place (-1 = padding, as the kernel says).
    With them (runtime/waves.py), wave i is rows of the first waves[i] sequences, and sequence s reads its state
    from page state_indices[i, s] and writes it to state_indices[i + 1, s]: the state after each of its
    positions lies in a page of its own, and its last wave writes its own page. Chains hold no padding. Here
    each wave's pages are first copied where the wave writes, then stepped there (the native kernels read one
    page and write the other, csrc/cpu_native.c)."""
    if waves is None:
        step(slice(0, state_indices.shape[0]), state_indices)
        return
    row = 0
    for i, n in enumerate(waves):
        source, target = state_indices[i, :n], state_indices[i + 1, :n]
        states.index_copy_(0, target, states.index_select(0, source))
        step(slice(row, row + n), target)
        row += n


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
