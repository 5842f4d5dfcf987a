"""Rotary position embedding applied to queries or keys (HF's apply_rotary_pos_emb, rotate-half form).

No Triton kernel: on a GPU torch's elementwise ops are the launcher. The CPU has a native one-pass
kernel (cpu_native.rotary_native) that rounds where these ops round.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rotary_ref(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (T, heads, head_dim); cos, sin: (T, rotary_dim) in x's dtype. Only the first rotary_dim
    channels rotate: x * cos + rotate_half(x) * sin, each op rounding to x's dtype, as HF's."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = x[..., :rotary_dim] * cos + _rotate_half(x[..., :rotary_dim]) * sin
    if rotary_dim == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
