"""Mamba-1 selective scan: prefill over packed sequences with per-sequence states, and the decode step.

Per sequence, token t, channel d, state n (A: (Dm, N), a separate decay per channel and state):

    dt'_t = softplus(dt_t + dt_bias)
    h_t   = exp(dt'_t A) * h_{t-1} + (dt'_t x_t) (x) B_t          h: (Dm, N)
    y_t   = h_t . C_t + D x_t, times silu(z_t) if z is given

Unlike Mamba-2, the decay differs per state n, so there is no matmul (SSD) form. The prefill
reference cuts every sequence into sub-chunks and runs the recurrence over all sub-chunks at
once, position by position: once from zero to get each sub-chunk's own end state, then (after
the inter-chunk pass gives every sub-chunk its true start state) once more to produce y. Python
steps drop from L to about 2 x sub-chunk length + sub-chunks per sequence, all decays stay <= 1
(stable), and memory is O(num_sub_chunks * Dm * N). When every sequence fits in one sub-chunk,
the first pass is skipped. Math is float32; states are stored in their own dtype. Jamba's
dt/B/C RMSNorms are applied by the caller, before this op.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.kernels.common import NO_DT_LIMIT, gather_initial_states, pass_states, scatter_states, time_step
from runtime.kernels.metadata import MambaPrefillMetadata

# Target size, in state elements, of one position step over all sub-chunks: about 4 MB of float32,
# small enough to stay in cache (larger steps become memory-bound), large enough to hide the
# per-step Python overhead.
STEP_ELEMENTS = 1 << 20


def selective_scan_ref(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor | None,
    z: Tensor | None,
    ssm_states: Tensor,
    state_indices: Tensor,
    meta: MambaPrefillMetadata,
    out: Tensor,
    sub_chunk_len: int | None = None,
) -> Tensor:
    """Mamba-1 prefill of packed sequences, carrying SSM states in and out.

    x, z, out: (T, Dm); dt: (T, Dm) after dt_proj, before softplus (dt' = softplus(dt + dt_bias));
    A: (Dm, N) float32; B, C: (T, N); D: (Dm,); dt_bias: (Dm,) or None; ssm_states:
    (num_slots, Dm, N); state_indices: (S,) (-1 = padding: no read, no write).
    y = scan + D x, times silu(z) if z is given. Each sequence starts from ssm_states[slot] if
    meta.has_initial_state else zeros; its final state is written back. Writes out and returns it.
    Only meta.query_start_loc and meta.has_initial_state are used; sub_chunk_len overrides the
    internal sub-chunk length (for tests), which does not change the result.
    """
    _check_mamba1_args(x, dt, A, B, C, D, dt_bias, z, ssm_states, state_indices, out)
    assert state_indices.shape == (meta.num_sequences,) and x.shape[0] == int(meta.query_start_loc[-1])
    chunks = _SubChunks.build(meta.query_start_loc.long(), A.numel(), sub_chunk_len)
    dt = chunks.gather(time_step(dt, dt_bias, NO_DT_LIMIT))  # (L, K, Dm), 0 past each sub-chunk's end
    xdt = chunks.gather(x.float()) * dt
    B, C = chunks.gather(B.float()), chunks.gather(C.float())

    start_states = gather_initial_states(ssm_states, state_indices, meta.has_initial_state)
    if not chunks.one_per_sequence:
        local_end, _ = _recurrence(torch.zeros(*dt.shape[1:], A.shape[1], device=x.device), dt, xdt, A, B)
        decay = torch.exp(dt.sum(0)[..., None] * A)  # (K, Dm, N): the decay across each whole sub-chunk
        start_states, _ = pass_states(local_end, decay, start_states, chunks.last_chunk_indices)
    end_states, y = _recurrence(start_states, dt, xdt, A, B, C)
    final_states = end_states[chunks.last_chunk_indices]

    y = chunks.scatter(y)
    y += D.float() * x.float()
    if z is not None:
        y *= F.silu(z.float())
    out.copy_(y)
    scatter_states(ssm_states, state_indices, final_states)
    return out


def selective_state_update_mamba1_ref(
    ssm_states: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor | None,
    z: Tensor | None,
    state_indices: Tensor,
    out: Tensor,
) -> Tensor:
    """Mamba-1 decode: one recurrence step per sequence, in place on ssm_states.

    ssm_states: (num_slots, Dm, N); x, z, out: (S, Dm); dt: (S, Dm) raw; A: (Dm, N) float32;
    B, C: (S, N); D: (Dm,); dt_bias: (Dm,) or None; state_indices: (S,), -1 = padding (skipped:
    no read, no write, output zero). state = state * exp(dt' A) + dt' x (x) B;
    y = state . C + D x, times silu(z) if z is given. Writes out and returns it.
    """
    _check_mamba1_args(x, dt, A, B, C, D, dt_bias, z, ssm_states, state_indices, out)
    keep = state_indices >= 0
    slots = state_indices[keep]
    dt = time_step(dt[keep], dt_bias, NO_DT_LIMIT)  # (S', Dm)
    x_kept = x[keep].float()
    state = ssm_states[slots].float().mul_(torch.exp(dt[..., None] * A))
    state.addcmul_((dt * x_kept)[..., None], B[keep].float()[:, None, :])
    ssm_states[slots] = state.to(ssm_states.dtype)

    y = (state @ C[keep].float()[..., None]).squeeze(-1) + D.float() * x_kept
    if z is not None:
        y *= F.silu(z[keep].float())
    out[keep] = y.to(out.dtype)
    out[~keep] = 0
    return out


def _check_mamba1_args(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor | None,
    z: Tensor | None,
    ssm_states: Tensor,
    state_indices: Tensor,
    out: Tensor,
) -> None:
    num_tokens, d_inner = x.shape
    d_state = A.shape[1]
    assert A.shape == (d_inner, d_state) and A.dtype == torch.float32
    assert dt.shape == x.shape and out.shape == x.shape and (z is None or z.shape == x.shape)
    assert B.shape == C.shape == (num_tokens, d_state)
    assert D.shape == (d_inner,) and (dt_bias is None or dt_bias.shape == (d_inner,))
    assert ssm_states.shape[1:] == (d_inner, d_state) and state_indices.dim() == 1


def _recurrence(
    state: Tensor, dt: Tensor, xdt: Tensor, A: Tensor, B: Tensor, C: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """Run every sub-chunk from `state` (K, Dm, N, updated in place), position by position.

    dt, xdt: (L, K, Dm); B, C: (L, K, N). A padded position has dt' = 0: decay 1, input 0.
    Returns the end states and, only if C is given, y (L, K, Dm).
    """
    ys = []
    for pos in range(dt.shape[0]):
        state.mul_(torch.exp(dt[pos, :, :, None] * A)).addcmul_(xdt[pos, :, :, None], B[pos, :, None, :])
        if C is not None:
            ys.append((state @ C[pos, :, :, None]).squeeze(-1))
    return state, (torch.stack(ys) if C is not None else None)


class _SubChunks:
    """Each sequence cut into sub-chunks of `length` tokens, laid out position-first as (length, K, ...)."""

    def __init__(self, tokens: Tensor, valid: Tensor, last_chunk_indices: Tensor) -> None:
        self.tokens = tokens  # (L, K) token index of each position (clamped where padded)
        self.valid = valid  # (L, K)
        self.last_chunk_indices = last_chunk_indices  # (S,)

    @classmethod
    def build(cls, query_start_loc: Tensor, state_numel: int, length: int | None = None) -> _SubChunks:
        seq_lens = query_start_loc[1:] - query_start_loc[:-1]
        if length is None:
            length = cls.default_length(int(seq_lens.max()), int(query_start_loc[-1]), state_numel)
        device = seq_lens.device
        per_seq = (seq_lens + length - 1) // length
        last_chunk_indices = per_seq.cumsum(0) - 1
        seq_of_chunk = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), per_seq)
        index_in_seq = torch.arange(len(seq_of_chunk), device=device) - (last_chunk_indices - per_seq + 1)[seq_of_chunk]
        chunk_start = query_start_loc[:-1][seq_of_chunk] + index_in_seq * length
        positions = chunk_start[None, :] + torch.arange(length, device=device)[:, None]
        valid = positions < query_start_loc[1:][seq_of_chunk]
        return cls(positions.clamp(max=int(query_start_loc[-1]) - 1), valid, last_chunk_indices)

    @staticmethod
    def default_length(max_len: int, num_tokens: int, state_numel: int) -> int:
        """Long enough that a step over all sub-chunks has about STEP_ELEMENTS state elements, and at
        least sqrt(max_len), which balances the position passes against the inter-chunk pass."""
        by_size = -(-num_tokens * state_numel // STEP_ELEMENTS)
        return min(max_len, max(math.isqrt(max_len - 1) + 1, by_size))

    @property
    def one_per_sequence(self) -> bool:
        return self.tokens.shape[1] == self.last_chunk_indices.shape[0]

    def gather(self, t: Tensor) -> Tensor:
        """(T, ...) -> (L, K, ...), zero where padded."""
        g = t.index_select(0, self.tokens.flatten()).unflatten(0, self.tokens.shape)
        return g.masked_fill_(~self.valid.view(*self.valid.shape, *[1] * (t.dim() - 1)), 0.0)

    def scatter(self, t: Tensor) -> Tensor:
        """(L, K, ...) -> (T, ...): chunk-major order over the valid positions is the packed token order."""
        return t.transpose(0, 1)[self.valid.T]
