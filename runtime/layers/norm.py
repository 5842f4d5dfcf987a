from __future__ import annotations

import torch
from torch import nn

from runtime import kernels


class RMSNorm(nn.Module):
    """RMS normalisation in float32, cast back, then scaled (HF's LlamaRMSNorm order of operations)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The gated norm's kernel with no gate and one group is exactly this norm (one pass on a CPU).
        size = x.shape[-1]
        return kernels.rms_norm_gated(x.reshape(-1, size), None, self.weight, self.eps, size).view(x.shape)


class GatedRMSNorm(nn.Module):
    """Mamba-2's norm: x * silu(z), normalised per group of channels."""

    def __init__(self, hidden_size: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
        return kernels.rms_norm_gated(x, z, self.weight, self.eps, self.group_size)
