"""Mamba-2 decode: one recurrence step per sequence, in place on the SSM state pool.

    dt' = softplus(dt + dt_bias) clamped to dt_limit
    state = state * exp(dt' A) + dt' x (x) B
    y = state . C + D x

Math is float32; y uses the float32 state, which is then stored in the pool's dtype.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from runtime.kernels import _triton_utils as tu
from runtime.kernels._triton_utils import tl, triton
from runtime.kernels.common import check_waves, in_waves, time_step
from runtime.kernels.cpu_compile import fused


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
    waves: Sequence[int] | None = None,
) -> Tensor:
    """One decode step of every sequence.

    ssm_states: (num_slots, H, P, N); x, out: (S, H, P); dt: (S, H) raw; A: (H,) float32;
    B, C: (S, G, N), head h uses group h // (H // G); D: (H,) (or (H, P)); dt_bias: (H,);
    state_indices: (S,), -1 = padding (skipped: no read, no write, output zero); with `waves`, a verify's rows
    (runtime/waves.py), S is the rows and state_indices the page chains of common.in_waves.
    state = state * exp(dt' A) + dt' x (x) B; y = state . C + D x. In place on ssm_states.
    Writes out and returns it.
    """
    _check_args(ssm_states, x, dt, A, B, C, state_indices, out, waves)

    def step(rows: slice, slots: Tensor) -> None:
        _step(ssm_states, x[rows], dt[rows], A, B[rows], C[rows], D, dt_bias, dt_limit, slots, out[rows])

    in_waves(ssm_states, state_indices, waves, step)
    return out


def _step(ssm_states, x, dt, A, B, C, D, dt_bias, dt_limit, state_indices, out) -> None:
    keep = state_indices >= 0
    if bool(keep.all()):
        out.copy_(_update(ssm_states, state_indices, x, dt, A, B, C, D, dt_bias, dt_limit))
        return
    out.zero_()
    if bool(keep.any()):
        out[keep] = _update(ssm_states, state_indices[keep], x[keep], dt[keep], A, B[keep], C[keep], D, dt_bias,
                            dt_limit)


@fused
def _update(ssm_states, slots, x, dt, A, B, C, D, dt_bias, dt_limit):
    """The step for sequences without padding; a compiled CPU engine fuses it into one pass over each state."""
    num_seqs, num_heads, head_dim = x.shape
    num_groups, d_state = B.shape[1:]
    dt = time_step(dt, dt_bias, dt_limit)  # (S, H)
    # Heads are split as (G, H // G) so that B and C broadcast per group without being copied per head.
    shape = (num_seqs, num_groups, num_heads // num_groups, head_dim, d_state)
    decay = torch.exp(dt * A).view(num_seqs, num_groups, -1, 1, 1)
    xdt = (x.float() * dt[..., None]).view(*shape[:-1], 1)
    b = B.float().view(num_seqs, num_groups, 1, 1, d_state)
    c = C.float().view(num_seqs, num_groups, 1, 1, d_state)
    # In place on the gathered copy: eager, this is two passes over the states; compiled, one.
    state = ssm_states[slots].float().view(shape).mul_(decay).addcmul_(xdt, b)
    ssm_states[slots] = state.view(num_seqs, num_heads, head_dim, d_state).to(ssm_states.dtype)
    y = (state @ c.transpose(-1, -2)).view(num_seqs, num_heads, head_dim)
    return (y + D.float().reshape(num_heads, -1) * x.float()).to(x.dtype)


def selective_state_update_triton(
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
    waves: Sequence[int] | None = None,
) -> Tensor:
    """selective_state_update_ref as one Triton kernel (same shapes); each program holds a
    (BLOCK_P, N) tile of one head's state of one sequence in registers. A verify's waves launch it once
    a wave (common.in_waves)."""
    _check_args(ssm_states, x, dt, A, B, C, state_indices, out, waves)
    num_heads, head_dim = x.shape[1:]
    num_groups, d_state = B.shape[1:]
    d = tu.per_channel(D, num_heads, head_dim)
    block_p, num_warps = _tile_rows(d_state, head_dim)

    def step(rows: slice, slots: Tensor) -> None:
        xs, dts, bs, cs, ys = x[rows], dt[rows], B[rows], C[rows], out[rows]
        grid = (triton.cdiv(head_dim, block_p), xs.shape[0], num_heads)
        _selective_state_update_kernel[grid](
            ssm_states, xs, dts, A, bs, cs, d, dt_bias, slots, ys, float(dt_limit[0]), float(dt_limit[1]),
            *ssm_states.stride(), *xs.stride(), *dts.stride(), *bs.stride(), *cs.stride(), *d.stride(),
            *ys.stride(), HEAD_DIM=head_dim, D_STATE=d_state, HEADS_PER_GROUP=num_heads // num_groups,
            BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(d_state), num_warps=num_warps,
        )  # fmt: skip

    in_waves(ssm_states, state_indices, waves, step)
    return out


def _check_args(
    ssm_states: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, state_indices: Tensor, out: Tensor,
    waves: Sequence[int] | None,
) -> None:
    num_seqs, num_heads, head_dim = x.shape
    num_groups, d_state = B.shape[1:]
    assert num_heads % num_groups == 0 and A.shape == (num_heads,) and A.dtype == torch.float32
    assert dt.shape == (num_seqs, num_heads) and B.shape == C.shape == (num_seqs, num_groups, d_state)
    assert ssm_states.shape[1:] == (num_heads, head_dim, d_state) and out.shape == x.shape
    check_waves(state_indices, waves, num_seqs)


def _tile_rows(d_state: int, head_dim: int) -> tuple[int, int]:
    """Rows of P per program and warps (mamba_ssm's hand-picked table: the state tile stays in registers).
    No autotuning: the kernel updates the state in place, and autotuning would rerun it."""
    rows, warps = next(((r, w) for limit, r, w in _SSU_TILES if d_state <= limit), (4, 8))
    return min(rows, triton.next_power_of_2(head_dim)), warps


_SSU_TILES = ((16, 32, 4), (32, 16, 4), (64, 8, 4), (128, 4, 4))


@triton.jit
def _selective_state_update_kernel(
    ssm_states, x, dt, A, B, C, D, dt_bias, state_indices, out, dt_min, dt_max,
    stride_s_slot, stride_s_head, stride_s_p, stride_s_n, stride_x_seq, stride_x_head, stride_x_p,
    stride_dt_seq, stride_dt_head, stride_b_seq, stride_b_group, stride_b_n, stride_c_seq, stride_c_group,
    stride_c_n, stride_d_head, stride_d_p, stride_o_seq, stride_o_head, stride_o_p,
    HEAD_DIM: tl.constexpr, D_STATE: tl.constexpr, HEADS_PER_GROUP: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    p_block, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    p = p_block * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = p < HEAD_DIM
    out_ptrs = out + seq * stride_o_seq + head * stride_o_head + p * stride_o_p
    slot = tl.load(state_indices + seq).to(tl.int64)
    if slot < 0:  # padding: no state read or write, output zero
        tl.store(out_ptrs, tl.zeros([BLOCK_P], tl.float32), mask=p_ok)
        return
    n = tl.arange(0, BLOCK_N)
    n_ok = n < D_STATE
    group = head // HEADS_PER_GROUP
    dt_h = tu.time_step(tl.load(dt + seq * stride_dt_seq + head * stride_dt_head).to(tl.float32),
                        tl.load(dt_bias + head).to(tl.float32), dt_min, dt_max)
    decay = tl.exp(dt_h * tl.load(A + head))
    x_p = tl.load(x + seq * stride_x_seq + head * stride_x_head + p * stride_x_p, mask=p_ok).to(tl.float32)
    b = tl.load(B + seq * stride_b_seq + group * stride_b_group + n * stride_b_n, mask=n_ok).to(tl.float32)
    c = tl.load(C + seq * stride_c_seq + group * stride_c_group + n * stride_c_n, mask=n_ok).to(tl.float32)

    state_ptrs = (ssm_states + slot * stride_s_slot + head * stride_s_head + p[:, None] * stride_s_p
                  + n[None, :] * stride_s_n)
    state_mask = p_ok[:, None] & n_ok[None, :]
    state = tl.load(state_ptrs, mask=state_mask, other=0.0).to(tl.float32)
    state = state * decay + (dt_h * x_p)[:, None] * b[None, :]
    tl.store(state_ptrs, state, mask=state_mask)
    # y from the float32 state, before it is rounded to the pool's dtype (as the reference).
    d = tl.load(D + head * stride_d_head + p * stride_d_p, mask=p_ok).to(tl.float32)
    y = tl.sum(state * c[None, :], 1) + d * x_p
    tl.store(out_ptrs, y, mask=p_ok)
