"""LFM2's gated short convolution over carried states: y = C * conv(B * x), prefill over packed sequences
and decode. Only the conv needs a kernel: both backends run causal_conv1d.py's, between elementwise gates.

The input is the layer's in_proj output `bcx` (T, 3D), channel-last, holding B, C and x side by side
(HF's order). The conv is depthwise, width W (`conv_L_cache`), with no activation; its state is a
sequence's last W-1 values of B * x as (W-1, D) rows, one per slot of a (num_slots, W-1, D) pool
view, the layout of Mamba's conv state (causal_conv1d.py). Math is float32; outputs are in bcx's
dtype and states are stored in their own dtype.
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from runtime.kernels.causal_conv1d import (
    causal_conv1d_fn_ref,
    causal_conv1d_fn_triton,
    causal_conv1d_update_ref,
    causal_conv1d_update_triton,
)
from runtime.kernels.metadata import MambaPrefillMetadata


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
    bcx: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor, state_indices: Tensor,
    waves: Sequence[int] | None = None,
) -> Tensor:
    """Decode: one token per sequence. bcx: (S, 3D); state_indices: (S,), -1 = padding (skipped: no
    read, no write, output zero), or with `waves` a verify's page chains (common.in_waves). Updates
    conv_states in place; returns (S, D)."""
    b, c, x = _split(bcx, weight)
    y = causal_conv1d_update_ref(b.float() * x.float(), weight, bias, conv_states, state_indices, activation=None,
                                 waves=waves)
    return (c.float() * y).to(bcx.dtype)


def short_conv_fn_triton(
    bcx: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_states: Tensor,
    state_indices: Tensor,
    meta: MambaPrefillMetadata,
) -> Tensor:
    """short_conv_fn_ref on the causal-conv Triton kernels (same shapes), composed as the reference is
    (and as vLLM's short conv does): the gates are elementwise, only the conv needs a kernel."""
    b, c, x = _split(bcx, weight)
    y = causal_conv1d_fn_triton(b.float() * x.float(), weight, bias, conv_states, state_indices, meta,
                                activation=None)
    return (c.float() * y).to(bcx.dtype)


def short_conv_update_triton(
    bcx: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor, state_indices: Tensor,
    waves: Sequence[int] | None = None,
) -> Tensor:
    """short_conv_update_ref on the causal-conv Triton update kernel (same shapes)."""
    b, c, x = _split(bcx, weight)
    y = causal_conv1d_update_triton(b.float() * x.float(), weight, bias, conv_states, state_indices,
                                    activation=None, waves=waves)
    return (c.float() * y).to(bcx.dtype)


def _split(bcx: Tensor, weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    assert bcx.dim() == 2 and weight.dim() == 2 and bcx.shape[1] == 3 * weight.shape[0], "bcx must be (T, 3D)"
    return bcx.chunk(3, dim=-1)
