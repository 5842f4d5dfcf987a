"""Depthwise causal conv1d with a carried state, for Mamba layers (prefill over packed sequences, and decode).

Layouts follow vLLM: x is channel-last (T, D); weight is (D, W); a conv state holds a
sequence's last W-1 inputs as (W-1, D) rows, one per slot of a (num_slots, W-1, D) pool view.
(HF keeps K = W columns in its cache; we keep W-1.) Math is float32; outputs are in x's dtype
and states are stored in their own dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.kernels.common import gather_initial_states, scatter_states
from runtime.kernels.metadata import MambaPrefillMetadata

ACTIVATIONS = (None, "silu", "swish")


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
) -> Tensor:
    """Decode: one token per sequence.

    x: (S, D); weight: (D, W); bias: (D,) or None; conv_states: (num_slots, W-1, D);
    state_indices: (S,), -1 = padding (skipped: no read, no write, output zero).
    Updates conv_states in place; returns (S, D).
    """
    _check_conv_args(x, weight, bias, conv_states, activation)
    assert state_indices.shape == x.shape[:1]
    keep = state_indices >= 0
    slots = state_indices[keep]
    window = torch.cat([conv_states[slots].float(), x[keep].float()[:, None]], dim=1)  # (S', W, D)
    y = torch.einsum("swd,dw->sd", window, weight.float())
    conv_states[slots] = window[:, 1:].to(conv_states.dtype)
    out = torch.zeros_like(x)
    out[keep] = _bias_and_activation(y, bias, activation).to(x.dtype)
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
