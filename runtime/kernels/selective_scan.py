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
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.kernels import _triton_utils as tu
from runtime.kernels._triton_utils import tl, triton
from runtime.kernels.common import (
    NO_DT_LIMIT,
    check_waves,
    gather_initial_states,
    in_waves,
    pass_states,
    scatter_states,
    time_step,
)
from runtime.kernels.metadata import MambaPrefillMetadata

# Target size, in state elements, of one position step over all sub-chunks: about 4 MB of float32,
# small enough to stay in cache (larger steps become memory-bound), large enough to hide the
# per-step Python overhead.
STEP_ELEMENTS = 1 << 20

# Channels per program of the Triton kernels: a (BLOCK_D, N) state tile stays in registers.
MAMBA1_BLOCK_D = 64


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
    _check_mamba1_args(x, dt, A, B, C, D, dt_bias, z, ssm_states, out)
    assert state_indices.dim() == 1
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
    waves: Sequence[int] | None = None,
) -> Tensor:
    """Mamba-1 decode: one recurrence step per sequence, in place on ssm_states.

    ssm_states: (num_slots, Dm, N); x, z, out: (S, Dm); dt: (S, Dm) raw; A: (Dm, N) float32;
    B, C: (S, N); D: (Dm,); dt_bias: (Dm,) or None; state_indices: (S,), -1 = padding (skipped:
    no read, no write, output zero), or with `waves` a verify's page chains (common.in_waves).
    state = state * exp(dt' A) + dt' x (x) B; y = state . C + D x, times silu(z) if z is given.
    Writes out and returns it.
    """
    _check_mamba1_args(x, dt, A, B, C, D, dt_bias, z, ssm_states, out)
    check_waves(state_indices, waves, x.shape[0])

    def step(rows: slice, state_indices: Tensor) -> None:
        keep = state_indices >= 0
        slots = state_indices[keep]
        dts = time_step(dt[rows][keep], dt_bias, NO_DT_LIMIT)  # (S', Dm)
        x_kept = x[rows][keep].float()
        state = ssm_states[slots].float().mul_(torch.exp(dts[..., None] * A))
        state.addcmul_((dts * x_kept)[..., None], B[rows][keep].float()[:, None, :])
        ssm_states[slots] = state.to(ssm_states.dtype)
        y = (state @ C[rows][keep].float()[..., None]).squeeze(-1) + D.float() * x_kept
        if z is not None:
            y *= F.silu(z[rows][keep].float())
        out[rows][keep] = y.to(out.dtype)
        out[rows][~keep] = 0

    in_waves(ssm_states, state_indices, waves, step)
    return out


def selective_scan_triton(
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
    """selective_scan_ref as one Triton kernel (same shapes; sub_chunk_len is ignored).

    A program holds the (BLOCK_D, N) state of a block of channels of one sequence and steps
    through the sequence's tokens in order: parallel over sequences and channels, sequential in
    time. Simple and exact, but a long prompt is latency-bound on a GPU (no chunked form yet).
    """
    _check_mamba1_args(x, dt, A, B, C, D, dt_bias, z, ssm_states, out)
    assert state_indices.dim() == 1
    assert state_indices.shape == (meta.num_sequences,)  # nothing that reads a device value: no sync
    d_inner, d_state = A.shape
    block_d = min(MAMBA1_BLOCK_D, triton.next_power_of_2(d_inner))
    _selective_scan_kernel[(triton.cdiv(d_inner, block_d), meta.num_sequences)](
        x, dt, A, B, C, D, _or(dt_bias, D), _or(z, x), ssm_states, state_indices, meta.has_initial_state,
        meta.query_start_loc, out, d_inner, *x.stride(), *dt.stride(), *A.stride(), *B.stride(), *C.stride(),
        *_or(z, x).stride(), *ssm_states.stride(), *out.stride(), D_STATE=d_state, HAS_DT_BIAS=dt_bias is not None,
        HAS_Z=z is not None, BLOCK_D=block_d, BLOCK_N=triton.next_power_of_2(d_state),
    )  # fmt: skip
    return out


def selective_state_update_mamba1_triton(
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
    waves: Sequence[int] | None = None,
) -> Tensor:
    """selective_state_update_mamba1_ref as one Triton kernel (same shapes): a program per (channel block, sequence).
    A verify's waves launch it once a wave (common.in_waves)."""
    _check_mamba1_args(x, dt, A, B, C, D, dt_bias, z, ssm_states, out)
    check_waves(state_indices, waves, x.shape[0])
    d_inner, d_state = A.shape
    block_d = min(MAMBA1_BLOCK_D, triton.next_power_of_2(d_inner))

    def step(rows: slice, slots: Tensor) -> None:
        xs, dts, bs, cs, zs, ys = x[rows], dt[rows], B[rows], C[rows], _or(z, x)[rows], out[rows]
        _selective_state_update_mamba1_kernel[(triton.cdiv(d_inner, block_d), xs.shape[0])](
            xs, dts, A, bs, cs, D, _or(dt_bias, D), zs, ssm_states, slots, ys, d_inner, *xs.stride(),
            *dts.stride(), *A.stride(), *bs.stride(), *cs.stride(), *zs.stride(), *ssm_states.stride(),
            *ys.stride(), D_STATE=d_state, HAS_DT_BIAS=dt_bias is not None, HAS_Z=z is not None, BLOCK_D=block_d,
            BLOCK_N=triton.next_power_of_2(d_state),
        )  # fmt: skip

    in_waves(ssm_states, state_indices, waves, step)
    return out


def _or(t: Tensor | None, placeholder: Tensor) -> Tensor:
    """An optional tensor, or a placeholder pointer the kernel does not read (its HAS_ flag is off)."""
    return t if t is not None else placeholder


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
    out: Tensor,
) -> None:
    num_tokens, d_inner = x.shape
    d_state = A.shape[1]
    assert A.shape == (d_inner, d_state) and A.dtype == torch.float32
    assert dt.shape == x.shape and out.shape == x.shape and (z is None or z.shape == x.shape)
    assert B.shape == C.shape == (num_tokens, d_state)
    assert D.shape == (d_inner,) and (dt_bias is None or dt_bias.shape == (d_inner,))
    assert ssm_states.shape[1:] == (d_inner, d_state)


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


@triton.jit
def _mamba1_step(state, a, x_t, dt_t, b, c, d, z_t, HAS_Z: tl.constexpr):
    """One recurrence step for a (BLOCK_D, N) state tile; returns the new state and y (BLOCK_D,)."""
    state = state * tl.exp(dt_t[:, None] * a) + (dt_t * x_t)[:, None] * b[None, :]
    y = tl.sum(state * c[None, :], 1) + d * x_t
    if HAS_Z:
        y = y * z_t * tl.sigmoid(z_t)
    return state, y


@triton.jit
def _selective_scan_kernel(
    x, dt, A, B, C, D, dt_bias, z, ssm_states, state_indices, has_initial_state, query_start_loc, out, d_inner,
    stride_x_t, stride_x_d, stride_dt_t, stride_dt_d, stride_a_d, stride_a_n, stride_b_t, stride_b_n,
    stride_c_t, stride_c_n, stride_z_t, stride_z_d, stride_s_slot, stride_s_d, stride_s_n, stride_o_t, stride_o_d,
    D_STATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, HAS_Z: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    d_block, seq = tl.program_id(0), tl.program_id(1)
    d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < d_inner
    n = tl.arange(0, BLOCK_N)
    n_ok = n < D_STATE
    tile_ok = d_ok[:, None] & n_ok[None, :]
    a = tl.load(A + d[:, None] * stride_a_d + n[None, :] * stride_a_n, mask=tile_ok, other=0.0)
    bias = tl.zeros([BLOCK_D], tl.float32)
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias + d, mask=d_ok, other=0.0).to(tl.float32)
    d_skip = tl.load(D + d, mask=d_ok, other=0.0).to(tl.float32)
    slot = tl.load(state_indices + seq).to(tl.int64)
    pool = ssm_states + slot * stride_s_slot + d[:, None] * stride_s_d + n[None, :] * stride_s_n
    state = tl.zeros([BLOCK_D, BLOCK_N], tl.float32)
    # A fresh or padded sequence starts from zeros, never from its slot's bytes.
    if (tl.load(has_initial_state + seq) != 0) & (slot >= 0):
        state = tl.load(pool, mask=tile_ok, other=0.0).to(tl.float32)
    z_t = tl.zeros([BLOCK_D], tl.float32)
    seq_start = tl.load(query_start_loc + seq)
    for i in range(0, tl.load(query_start_loc + seq + 1) - seq_start):
        t64 = seq_start.to(tl.int64) + i
        x_t = tl.load(x + t64 * stride_x_t + d * stride_x_d, mask=d_ok, other=0.0).to(tl.float32)
        raw = tl.load(dt + t64 * stride_dt_t + d * stride_dt_d, mask=d_ok, other=0.0).to(tl.float32)
        dt_t = tu.softplus(raw + bias)
        b = tl.load(B + t64 * stride_b_t + n * stride_b_n, mask=n_ok, other=0.0).to(tl.float32)
        c = tl.load(C + t64 * stride_c_t + n * stride_c_n, mask=n_ok, other=0.0).to(tl.float32)
        if HAS_Z:
            z_t = tl.load(z + t64 * stride_z_t + d * stride_z_d, mask=d_ok, other=0.0).to(tl.float32)
        state, y = _mamba1_step(state, a, x_t, dt_t, b, c, d_skip, z_t, HAS_Z)
        tl.store(out + t64 * stride_o_t + d * stride_o_d, y, mask=d_ok)
    if slot >= 0:  # this program alone read this part of the slot, above
        tl.store(pool, state, mask=tile_ok)


@triton.jit
def _selective_state_update_mamba1_kernel(
    x, dt, A, B, C, D, dt_bias, z, ssm_states, state_indices, out, d_inner, stride_x_s, stride_x_d,
    stride_dt_s, stride_dt_d, stride_a_d, stride_a_n, stride_b_s, stride_b_n, stride_c_s, stride_c_n,
    stride_z_s, stride_z_d, stride_s_slot, stride_s_d, stride_s_n, stride_o_s, stride_o_d,
    D_STATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, HAS_Z: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    d_block, seq = tl.program_id(0), tl.program_id(1)
    d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < d_inner
    slot = tl.load(state_indices + seq).to(tl.int64)
    if slot < 0:  # padding: no state read or write, output zero
        tl.store(out + seq * stride_o_s + d * stride_o_d, tl.zeros([BLOCK_D], tl.float32), mask=d_ok)
        return
    n = tl.arange(0, BLOCK_N)
    n_ok = n < D_STATE
    tile_ok = d_ok[:, None] & n_ok[None, :]
    a = tl.load(A + d[:, None] * stride_a_d + n[None, :] * stride_a_n, mask=tile_ok, other=0.0)
    raw = tl.load(dt + seq * stride_dt_s + d * stride_dt_d, mask=d_ok, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        raw += tl.load(dt_bias + d, mask=d_ok, other=0.0).to(tl.float32)
    x_t = tl.load(x + seq * stride_x_s + d * stride_x_d, mask=d_ok, other=0.0).to(tl.float32)
    b = tl.load(B + seq * stride_b_s + n * stride_b_n, mask=n_ok, other=0.0).to(tl.float32)
    c = tl.load(C + seq * stride_c_s + n * stride_c_n, mask=n_ok, other=0.0).to(tl.float32)
    z_t = tl.zeros([BLOCK_D], tl.float32)
    if HAS_Z:
        z_t = tl.load(z + seq * stride_z_s + d * stride_z_d, mask=d_ok, other=0.0).to(tl.float32)
    pool = ssm_states + slot * stride_s_slot + d[:, None] * stride_s_d + n[None, :] * stride_s_n
    state = tl.load(pool, mask=tile_ok, other=0.0).to(tl.float32)
    d_skip = tl.load(D + d, mask=d_ok, other=0.0).to(tl.float32)
    state, y = _mamba1_step(state, a, x_t, tu.softplus(raw), b, c, d_skip, z_t, HAS_Z)
    tl.store(pool, state, mask=tile_ok)
    tl.store(out + seq * stride_o_s + d * stride_o_d, y, mask=d_ok)
