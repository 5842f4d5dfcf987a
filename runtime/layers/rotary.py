"""Rotary position embeddings, computed once per step and shared by every attention layer.

The inverse frequencies follow HF's rope initialisers for the rope types our configs use
(default, linear, llama3; dynamic scaling starts as default).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from runtime import kernels
from runtime.models.dims import RopeDims


def inverse_frequencies(rope: RopeDims) -> torch.Tensor:
    dim = rope.rotary_dim
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, rope: RopeDims) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, and those between interpolated.
    old_len = rope.original_max_position_embeddings
    low_wavelen, high_wavelen = old_len / rope.low_freq_factor, old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: RopeDims):
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(rope), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, head_dim); cos, sin: (T, rotary_dim). Only the first rotary_dim channels rotate."""
    return kernels.rotary(x, cos, sin)
