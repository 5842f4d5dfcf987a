"""Gated RMSNorm of the Mamba-2 mixer output (HF's MambaRMSNormGated, norm after the gate)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm_gated_ref(x: Tensor, z: Tensor | None, weight: Tensor, eps: float, group_size: int) -> Tensor:
    """h = x * silu(z) in float32, RMS-normalised per group of group_size channels, cast to x.dtype, times weight.

    x, z: (T, D); weight: (D,); D is a multiple of group_size. Returns (T, D), as HF's MambaRMSNormGated.
    """
    assert x.dim() == 2 and x.shape[1] % group_size == 0 and weight.shape == x.shape[1:]
    assert z is None or z.shape == x.shape
    h = x.float()
    if z is not None:
        h = h * F.silu(z.float())
    groups = h.unflatten(-1, (-1, group_size))
    variance = groups.pow(2).mean(-1, keepdim=True)
    h = (groups * torch.rsqrt(variance + eps)).flatten(-2)
    # HF rounds to the input dtype before the weight multiply; keep that order for bit parity.
    return weight * h.to(x.dtype)
