"""LFM2's gated short convolution over carried states: y = C * conv(B * x), prefill over packed sequences
and decode.

The input is the layer's in_proj output `bcx` (T, 3D), channel-last, holding B, C and x side by side
(HF's order). The conv is depthwise, width W (`conv_L_cache`), with no activation; its state is a
sequence's last W-1 values of B * x as (W-1, D) rows, one per slot of a (num_slots, W-1, D) pool
view, the layout of Mamba's conv state (causal_conv1d.py). Math is float32; outputs are in bcx's
dtype and states are stored in their own dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from runtime.kernels.causal_conv1d import causal_conv1d_fn_ref, causal_conv1d_update_ref
from runtime.kernels.metadata import MambaPrefillMetadata

# Channels per program, and tokens per step of the prefill kernel's loop (as in causal_conv1d.py).
CONV_BLOCK_D, CONV_BLOCK_T = 128, 16


def short_conv_fn_ref(
    bcx: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_states: Tensor,
    state_indices: Tensor,
    meta: MambaPrefillMetadata,
) -> Tensor:
    """Prefill: C * conv(B * x) for every sequence in a packed batch, carrying conv states in and out.

    bcx: (T, 3D) packed prefill tokens; weight: (D, W); bias: (D,) or None; conv_states:
    (num_slots, W-1, D); state_indices: (S,) int64 slot of each sequence (-1 = padding: no read, no
    write). Each sequence starts from conv_states[slot] if meta.has_initial_state else zeros; its last
    W-1 values of B * x are written back to conv_states[slot]. Returns (T, D).
    """
    b, c, x = _split(bcx, weight)
    y = causal_conv1d_fn_ref(b.float() * x.float(), weight, bias, conv_states, state_indices, meta, activation=None)
    return (c.float() * y).to(bcx.dtype)


def short_conv_update_ref(
    bcx: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor, state_indices: Tensor
) -> Tensor:
    """Decode: one token per sequence. bcx: (S, 3D); state_indices: (S,), -1 = padding (skipped: no
    read, no write, output zero). Updates conv_states in place; returns (S, D)."""
    b, c, x = _split(bcx, weight)
    y = causal_conv1d_update_ref(b.float() * x.float(), weight, bias, conv_states, state_indices, activation=None)
    return (c.float() * y).to(bcx.dtype)


def short_conv_fn_triton(
    bcx: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_states: Tensor,
    state_indices: Tensor,
    meta: MambaPrefillMetadata,
) -> Tensor:
    """short_conv_fn_ref as two Triton kernels (same shapes).

    The first computes the outputs, one program per (logical chunk, channel block), forming B * x
    on the fly and reading the W-1 values before a sequence's start from its old state. The second
    then writes each sequence's new state: a program whose chunk starts within W-1 tokens of its
    sequence's start still reads the old state, so no program of the first kernel may overwrite it.
    """
    _split(bcx, weight)
    assert state_indices.shape == (meta.num_sequences,)
    dim = weight.shape[0]
    out = torch.empty(bcx.shape[0], dim, dtype=bcx.dtype, device=bcx.device)
    block_d = min(CONV_BLOCK_D, triton.next_power_of_2(dim))
    common = dict(WIDTH=weight.shape[1], BLOCK_D=block_d)
    _short_conv_fwd_kernel[(meta.chunk_seq_idx.shape[0], triton.cdiv(dim, block_d))](
        bcx, weight, bias if bias is not None else weight, conv_states, state_indices, meta.has_initial_state,
        meta.query_start_loc, meta.cu_chunk_seqlens, meta.chunk_seq_idx, out, dim, *bcx.stride(),
        *weight.stride(), *conv_states.stride(), *out.stride(), HAS_BIAS=bias is not None,
        BLOCK_T=min(CONV_BLOCK_T, triton.next_power_of_2(meta.chunk_size)), **common,
    )  # fmt: skip
    _short_conv_state_kernel[(meta.num_sequences, triton.cdiv(dim, block_d))](
        bcx, conv_states, state_indices, meta.has_initial_state, meta.query_start_loc, dim, *bcx.stride(),
        *conv_states.stride(), **common,
    )  # fmt: skip
    return out


def short_conv_update_triton(
    bcx: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor, state_indices: Tensor
) -> Tensor:
    """short_conv_update_ref as one Triton kernel (same shapes): a program per (sequence, channel block)."""
    _split(bcx, weight)
    assert state_indices.shape == bcx.shape[:1]
    num_seqs, dim = bcx.shape[0], weight.shape[0]
    out = torch.empty(num_seqs, dim, dtype=bcx.dtype, device=bcx.device)
    block_d = min(CONV_BLOCK_D, triton.next_power_of_2(dim))
    _short_conv_update_kernel[(num_seqs, triton.cdiv(dim, block_d))](
        bcx, weight, bias if bias is not None else weight, conv_states, state_indices, out, dim, *bcx.stride(),
        *weight.stride(), *conv_states.stride(), *out.stride(), WIDTH=weight.shape[1], HAS_BIAS=bias is not None,
        BLOCK_D=block_d,
    )  # fmt: skip
    return out


def _split(bcx: Tensor, weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    assert bcx.dim() == 2 and weight.dim() == 2 and bcx.shape[1] == 3 * weight.shape[0], "bcx must be (T, 3D)"
    return bcx.chunk(3, dim=-1)


@triton.jit
def _short_conv_fwd_kernel(
    bcx, weight, bias, conv_states, state_indices, has_initial_state, query_start_loc, cu_chunk_seqlens,
    chunk_seq_idx, out, dim, stride_bt, stride_bd, stride_wd, stride_wk, stride_ss, stride_sk, stride_sd,
    stride_ot, stride_od,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    chunk, d_block = tl.program_id(0), tl.program_id(1)
    seq = tl.load(chunk_seq_idx + chunk)
    seq_start = tl.load(query_start_loc + seq)
    chunk_start, chunk_end = tl.load(cu_chunk_seqlens + chunk), tl.load(cu_chunk_seqlens + chunk + 1)
    slot = tl.load(state_indices + seq).to(tl.int64)
    # Inputs src in [state_from, seq_start) come from the old state; a padded or fresh sequence
    # starts from zeros (an empty range: the interpreter mis-broadcasts scalar booleans in masks).
    state_from = seq_start
    if (tl.load(has_initial_state + seq) != 0) & (slot >= 0):
        state_from = seq_start - (WIDTH - 1)
    d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < dim
    for first in range(chunk_start, chunk_end, BLOCK_T):
        t = first + tl.arange(0, BLOCK_T)
        t_ok = (t < chunk_end)[:, None] & d_ok[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
        for k in tl.static_range(WIDTH):
            src = (t - (WIDTH - 1) + k)[:, None]
            in_seq = t_ok & (src >= seq_start)
            row = bcx + src.to(tl.int64) * stride_bt
            b = tl.load(row + d[None, :] * stride_bd, mask=in_seq, other=0.0).to(tl.float32)
            x = tl.load(row + (2 * dim + d[None, :]) * stride_bd, mask=in_seq, other=0.0).to(tl.float32)
            sv = tl.load(conv_states + slot * stride_ss + (WIDTH - 1 + src - seq_start) * stride_sk
                         + d[None, :] * stride_sd, mask=t_ok & (src >= state_from) & (src < seq_start), other=0.0)
            w = tl.load(weight + d * stride_wd + k * stride_wk, mask=d_ok, other=0.0).to(tl.float32)
            acc += w[None, :] * (b * x + sv.to(tl.float32))
        if HAS_BIAS:
            acc += tl.load(bias + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        rows = t[:, None].to(tl.int64)
        c = tl.load(bcx + rows * stride_bt + (dim + d[None, :]) * stride_bd, mask=t_ok, other=0.0).to(tl.float32)
        tl.store(out + rows * stride_ot + d[None, :] * stride_od, c * acc, mask=t_ok)


@triton.jit
def _short_conv_state_kernel(
    bcx, conv_states, state_indices, has_initial_state, query_start_loc, dim, stride_bt, stride_bd,
    stride_ss, stride_sk, stride_sd, WIDTH: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    seq, d_block = tl.program_id(0), tl.program_id(1)
    slot = tl.load(state_indices + seq).to(tl.int64)
    if slot < 0:
        return
    seq_start, seq_end = tl.load(query_start_loc + seq), tl.load(query_start_loc + seq + 1)
    from_state = tl.load(has_initial_state + seq) != 0
    d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < dim
    state = conv_states + slot * stride_ss + d * stride_sd
    # New row r is input seq_end - (W-1) + r: B * x of a token, or (for a sequence shorter than W-1)
    # old row r + len, overwritten only in a later iteration, by the same thread.
    for r in tl.static_range(WIDTH - 1):
        src = seq_end - (WIDTH - 1) + r
        if src >= seq_start:
            row = bcx + src.to(tl.int64) * stride_bt
            b = tl.load(row + d * stride_bd, mask=d_ok, other=0.0).to(tl.float32)
            x = tl.load(row + (2 * dim + d) * stride_bd, mask=d_ok, other=0.0).to(tl.float32)
            value = b * x
        elif from_state:
            value = tl.load(state + (r + seq_end - seq_start) * stride_sk, mask=d_ok, other=0.0).to(tl.float32)
        else:
            value = tl.zeros([BLOCK_D], tl.float32)
        tl.store(state + r * stride_sk, value, mask=d_ok)


@triton.jit
def _short_conv_update_kernel(
    bcx, weight, bias, conv_states, state_indices, out, dim, stride_bs, stride_bd, stride_wd, stride_wk,
    stride_ss, stride_sk, stride_sd, stride_os, stride_od,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    seq, d_block = tl.program_id(0), tl.program_id(1)
    d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < dim
    slot = tl.load(state_indices + seq).to(tl.int64)
    if slot < 0:  # padding: no state read or write, output zero
        tl.store(out + seq * stride_os + d * stride_od, tl.zeros([BLOCK_D], tl.float32), mask=d_ok)
        return
    state = conv_states + slot * stride_ss + d * stride_sd
    acc = tl.zeros([BLOCK_D], tl.float32)
    # The window is [old rows 0..W-2, B * x]; the new state is the window shifted by one. Row k-1 is
    # overwritten only after row k was read, by the same thread.
    for k in tl.static_range(WIDTH - 1):
        row = tl.load(state + k * stride_sk, mask=d_ok, other=0.0)
        w = tl.load(weight + d * stride_wd + k * stride_wk, mask=d_ok, other=0.0).to(tl.float32)
        acc += w * row.to(tl.float32)
        if k > 0:
            tl.store(state + (k - 1) * stride_sk, row, mask=d_ok)
    token = bcx + seq * stride_bs
    b = tl.load(token + d * stride_bd, mask=d_ok, other=0.0).to(tl.float32)
    x = tl.load(token + (2 * dim + d) * stride_bd, mask=d_ok, other=0.0).to(tl.float32)
    w_last = tl.load(weight + d * stride_wd + (WIDTH - 1) * stride_wk, mask=d_ok, other=0.0).to(tl.float32)
    acc += w_last * (b * x)
    tl.store(state + (WIDTH - 2) * stride_sk, b * x, mask=d_ok)
    if HAS_BIAS:
        acc += tl.load(bias + d, mask=d_ok, other=0.0).to(tl.float32)
    c = tl.load(token + (dim + d) * stride_bd, mask=d_ok, other=0.0).to(tl.float32)
    tl.store(out + seq * stride_os + d * stride_od, c * acc, mask=d_ok)
