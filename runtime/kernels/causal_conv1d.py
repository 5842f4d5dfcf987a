"""Depthwise causal conv1d with a carried state, for Mamba layers (prefill over packed sequences, and decode).

Layouts follow vLLM: x is channel-last (T, D); weight is (D, W); a conv state holds a
sequence's last W-1 inputs as (W-1, D) rows, one per slot of a (num_slots, W-1, D) pool view.
(HF keeps K = W columns in its cache; we keep W-1.) Math is float32; outputs are in x's dtype
and states are stored in their own dtype.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.kernels._triton_utils import tl, triton
from runtime.kernels.common import check_waves, gather_initial_states, in_waves, scatter_states
from runtime.kernels.metadata import MambaPrefillMetadata

ACTIVATIONS = (None, "silu", "swish")
# Channels per program of the Triton kernels, and tokens per step of the prefill kernel's loop
# (16 x 128 float32 accumulators: 16 registers a thread with 4 warps).
CONV_BLOCK_D, CONV_BLOCK_T = 128, 16


def causal_conv1d_fn_ref(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_states: Tensor,
    state_indices: Tensor,
    meta: MambaPrefillMetadata,
    activation: str | None = "silu",
) -> Tensor:
    """Prefill: the causal conv of every sequence in a packed batch, carrying conv states in and out.

    x: (T, D) packed prefill tokens (channel-last); weight: (D, W); bias: (D,) or None;
    conv_states: (num_slots, W-1, D); state_indices: (S,) int64 slot of each sequence (-1 = padding:
    no read, no write). Each sequence starts from conv_states[slot] if meta.has_initial_state else
    zeros, and its last W-1 inputs (covering sequences shorter than W-1 by shifting the old state)
    are written back to conv_states[slot]. Returns (T, D).
    """
    _check_conv_args(x, weight, bias, conv_states, activation)
    width = weight.shape[1]
    num_seqs = meta.num_sequences
    assert state_indices.shape == (num_seqs,)
    starts = meta.query_start_loc.long()
    seq_lens = starts[1:] - starts[:-1]
    assert x.shape[0] == int(starts[-1])

    # One padded buffer for the whole batch: each sequence's W-1 previous inputs, then its tokens.
    # The convolution then runs over plain row slices, and no window crosses into another sequence.
    seq_ids = torch.arange(num_seqs, device=x.device)
    state_rows = (starts[:-1] + (width - 1) * seq_ids)[:, None] + torch.arange(width - 1, device=x.device)
    token_rows = torch.arange(x.shape[0], device=x.device) + (width - 1) * (
        torch.repeat_interleave(seq_ids, seq_lens) + 1
    )
    xpad = torch.empty(x.shape[0] + num_seqs * (width - 1), x.shape[1], dtype=torch.float32, device=x.device)
    xpad[state_rows] = gather_initial_states(conv_states, state_indices, meta.has_initial_state)
    xpad[token_rows] = x.float()

    # acc[i] = sum_k weight[:, k] * xpad[i + k]: the window that starts at row i.
    num_windows = xpad.shape[0] - (width - 1)
    w = weight.float()
    acc = xpad[:num_windows] * w[:, 0]
    for k in range(1, width):
        acc.addcmul_(xpad[k : k + num_windows], w[:, k])
    out = _bias_and_activation(acc[token_rows - (width - 1)], bias, activation)

    # A sequence's last W-1 rows of [old state, tokens] are its new state (this shifts short sequences).
    scatter_states(conv_states, state_indices, xpad[state_rows + seq_lens[:, None]])
    return out.to(x.dtype)


def causal_conv1d_update_ref(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_states: Tensor,
    state_indices: Tensor,
    activation: str | None = "silu",
    waves: Sequence[int] | None = None,
) -> Tensor:
    """Decode: one token per sequence.

    x: (S, D); weight: (D, W); bias: (D,) or None; conv_states: (num_slots, W-1, D);
    state_indices: (S,), -1 = padding (skipped: no read, no write, output zero); with `waves`, a verify's
    rows (runtime/waves.py), S is the rows and state_indices the page chains of common.in_waves.
    Updates conv_states in place; returns (S, D).
    """
    _check_conv_args(x, weight, bias, conv_states, activation)
    check_waves(state_indices, waves, x.shape[0])
    out = torch.zeros_like(x)

    def step(rows: slice, state_indices: Tensor) -> None:
        keep = state_indices >= 0
        slots = state_indices[keep]
        window = torch.cat([conv_states[slots].float(), x[rows][keep].float()[:, None]], dim=1)  # (S', W, D)
        y = torch.einsum("swd,dw->sd", window, weight.float())
        conv_states[slots] = window[:, 1:].to(conv_states.dtype)
        out[rows][keep] = _bias_and_activation(y, bias, activation).to(x.dtype)

    in_waves(conv_states, state_indices, waves, step)
    return out


def causal_conv1d_fn_triton(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_states: Tensor,
    state_indices: Tensor,
    meta: MambaPrefillMetadata,
    activation: str | None = "silu",
) -> Tensor:
    """causal_conv1d_fn_ref as two Triton kernels (same shapes).

    The first computes the outputs, one program per (logical chunk, channel block), reading the
    W-1 inputs before a sequence's start from its old conv state. The second then writes each
    sequence's new state. They cannot be one kernel: a sequence's old state is read by every
    program whose chunk starts within W-1 tokens of the sequence's start (a resumed sequence
    may begin with a one-token chunk), and no program may overwrite it before they all have.
    """
    _check_conv_args(x, weight, bias, conv_states, activation)
    assert state_indices.shape == (meta.num_sequences,)
    dim = x.shape[1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_chunks = meta.chunk_seq_idx.shape[0]
    block_d = min(CONV_BLOCK_D, triton.next_power_of_2(dim))
    common = dict(WIDTH=weight.shape[1], BLOCK_D=block_d)
    bias_arg = bias if bias is not None else weight  # an unused pointer without bias
    _causal_conv1d_fwd_kernel[(num_chunks, triton.cdiv(dim, block_d))](
        x, weight, bias_arg, conv_states, state_indices, meta.has_initial_state, meta.query_start_loc,
        meta.cu_chunk_seqlens, meta.chunk_seq_idx, out, dim, *x.stride(), *weight.stride(), *conv_states.stride(),
        *out.stride(), HAS_BIAS=bias is not None, SILU=activation is not None,
        BLOCK_T=min(CONV_BLOCK_T, triton.next_power_of_2(meta.chunk_size)), **common,
    )  # fmt: skip
    _conv_state_write_kernel[(meta.num_sequences, triton.cdiv(dim, block_d))](
        x, conv_states, state_indices, meta.has_initial_state, meta.query_start_loc, dim, *x.stride(),
        *conv_states.stride(), **common,
    )  # fmt: skip
    return out


def causal_conv1d_update_triton(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_states: Tensor,
    state_indices: Tensor,
    activation: str | None = "silu",
    waves: Sequence[int] | None = None,
) -> Tensor:
    """causal_conv1d_update_ref as one Triton kernel (same shapes): a program per (sequence, channel block).
    A verify's waves launch it once a wave (common.in_waves)."""
    _check_conv_args(x, weight, bias, conv_states, activation)
    check_waves(state_indices, waves, x.shape[0])
    dim = x.shape[1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_d = min(CONV_BLOCK_D, triton.next_power_of_2(dim))

    def step(rows: slice, slots: Tensor) -> None:
        xs, ys = x[rows], out[rows]
        _causal_conv1d_update_kernel[(xs.shape[0], triton.cdiv(dim, block_d))](
            xs, weight, bias if bias is not None else weight, conv_states, slots, ys, dim, *xs.stride(),
            *weight.stride(), *conv_states.stride(), *ys.stride(), WIDTH=weight.shape[1],
            HAS_BIAS=bias is not None, SILU=activation is not None, BLOCK_D=block_d,
        )  # fmt: skip

    in_waves(conv_states, state_indices, waves, step)
    return out


def _check_conv_args(
    x: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor, activation: str | None
) -> None:
    assert x.dim() == 2 and weight.dim() == 2 and weight.shape[0] == x.shape[1]
    assert weight.shape[1] >= 2, "a conv state needs width >= 2"
    assert bias is None or bias.shape == (x.shape[1],)
    assert conv_states.shape[1:] == (weight.shape[1] - 1, x.shape[1]), "conv_states must be (num_slots, W-1, D)"
    assert activation in ACTIVATIONS, f"activation must be one of {ACTIVATIONS}"


def _bias_and_activation(y: Tensor, bias: Tensor | None, activation: str | None) -> Tensor:
    if bias is not None:
        y = y + bias.float()
    return F.silu(y) if activation is not None else y


@triton.jit
def _causal_conv1d_fwd_kernel(
    x, weight, bias, conv_states, state_indices, has_initial_state, query_start_loc, cu_chunk_seqlens,
    chunk_seq_idx, out, dim, stride_xt, stride_xd, stride_wd, stride_wk, stride_ss, stride_sk, stride_sd,
    stride_ot, stride_od,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    chunk, d_block = tl.program_id(0), tl.program_id(1)
    seq = tl.load(chunk_seq_idx + chunk)
    seq_start = tl.load(query_start_loc + seq)
    chunk_start, chunk_end = tl.load(cu_chunk_seqlens + chunk), tl.load(cu_chunk_seqlens + chunk + 1)
    slot = tl.load(state_indices + seq).to(tl.int64)
    # Inputs src in [state_from, seq_start) come from the old state. A padded sequence (slot -1) or a
    # fresh one starts from zeros, never from its slot's bytes: the range is empty. (A range, not a
    # scalar flag in the mask: the interpreter mis-broadcasts scalar booleans.)
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
            # Tap k of token t reads input src; before the sequence's start that is row
            # W-1 + (src - seq_start) of the old state.
            src = (t - (WIDTH - 1) + k)[:, None]
            in_seq = src >= seq_start
            xv = tl.load(x + src.to(tl.int64) * stride_xt + d[None, :] * stride_xd, mask=t_ok & in_seq, other=0.0)
            sv = tl.load(conv_states + slot * stride_ss + (WIDTH - 1 + src - seq_start) * stride_sk
                         + d[None, :] * stride_sd, mask=t_ok & (src >= state_from) & ~in_seq, other=0.0)
            w = tl.load(weight + d * stride_wd + k * stride_wk, mask=d_ok, other=0.0).to(tl.float32)
            acc += w[None, :] * (xv.to(tl.float32) + sv.to(tl.float32))
        if HAS_BIAS:
            acc += tl.load(bias + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(out + t[:, None].to(tl.int64) * stride_ot + d[None, :] * stride_od, acc, mask=t_ok)


@triton.jit
def _conv_state_write_kernel(
    x, conv_states, state_indices, has_initial_state, query_start_loc, dim, stride_xt, stride_xd,
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
    # New row r is input seq_end - (W-1) + r: a token, or (for a sequence shorter than W-1) old row
    # r + len, which is overwritten in a later iteration, by the same thread (the same lane of d).
    for r in tl.static_range(WIDTH - 1):
        src = seq_end - (WIDTH - 1) + r
        if src >= seq_start:
            row = tl.load(x + src.to(tl.int64) * stride_xt + d * stride_xd, mask=d_ok, other=0.0).to(tl.float32)
        elif from_state:
            row = tl.load(state + (r + seq_end - seq_start) * stride_sk, mask=d_ok, other=0.0).to(tl.float32)
        else:
            row = tl.zeros([BLOCK_D], tl.float32)
        tl.store(state + r * stride_sk, row, mask=d_ok)


@triton.jit
def _causal_conv1d_update_kernel(
    x, weight, bias, conv_states, state_indices, out, dim, stride_xs, stride_xd, stride_wd, stride_wk,
    stride_ss, stride_sk, stride_sd, stride_os, stride_od,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_D: tl.constexpr,
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
    # The window is [old rows 0..W-2, x]; the new state is the window shifted by one. Row k-1 is
    # overwritten only after row k was read, by the same thread, so no old row is lost.
    for k in tl.static_range(WIDTH - 1):
        row = tl.load(state + k * stride_sk, mask=d_ok, other=0.0)
        w = tl.load(weight + d * stride_wd + k * stride_wk, mask=d_ok, other=0.0).to(tl.float32)
        acc += w * row.to(tl.float32)
        if k > 0:
            tl.store(state + (k - 1) * stride_sk, row, mask=d_ok)
    xv = tl.load(x + seq * stride_xs + d * stride_xd, mask=d_ok, other=0.0)
    w_last = tl.load(weight + d * stride_wd + (WIDTH - 1) * stride_wk, mask=d_ok, other=0.0).to(tl.float32)
    acc += w_last * xv.to(tl.float32)
    tl.store(state + (WIDTH - 2) * stride_sk, xv, mask=d_ok)
    if HAS_BIAS:
        acc += tl.load(bias + d, mask=d_ok, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out + seq * stride_os + d * stride_od, acc, mask=d_ok)
