"""LFM2's gated short convolution over the shared pool: in_proj -> B, C, x -> C * conv(B * x) -> out_proj.

Decodes come first in the packed batch (one token each, state update by page id); prefill
chunks follow (varlen conv, starting from the cached state when a prompt is resumed).
"""

from __future__ import annotations

import torch
from torch import nn

from runtime import kernels
from runtime.context import get_forward_context


class ShortConv(nn.Module):
    def __init__(self, layer_idx: int, *, hidden_size: int, width: int, bias: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size, self.width = hidden_size, width
        self.in_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=bias)
        # Holds the depthwise weights under HF's name; the kernels apply them.
        self.conv = nn.Conv1d(hidden_size, hidden_size, width, groups=hidden_size, bias=bias)
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.group = -1  # state group, set when the pool is bound
        self.conv_states: torch.Tensor | None = None  # (num_pages, width - 1, hidden_size) view

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.width - 1, self.hidden_size),)

    def bind(self, group: int, conv_states: torch.Tensor) -> None:
        self.group, self.conv_states = group, conv_states

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (T, hidden_size) -> (T, hidden_size)."""
        ctx = get_forward_context()
        bcx = self.in_proj(hidden)
        nd, weight, bias = ctx.num_decodes, self.conv.weight.squeeze(1), self.conv.bias
        y = bcx.new_empty(bcx.shape[0], self.hidden_size)
        if nd:
            pages, waves = ctx.decode_pages(self.group)
            y[:nd] = kernels.short_conv_update(bcx[:nd], weight, bias, self.conv_states, pages, waves=waves)
        if ctx.num_prefill_tokens:
            y[nd:] = kernels.short_conv_fn(bcx[nd:], weight, bias, self.conv_states,
                                           ctx.prefill_state_indices[self.group], ctx.mamba_prefill)
        return self.out_proj(y)
