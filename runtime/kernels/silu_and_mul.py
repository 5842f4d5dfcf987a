"""silu(gate) * up: the gated MLP's activation (HF's `act_fn(gate_proj(x)) * up_proj(x)` with SiLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.kernels import _triton_utils as tu
from runtime.kernels._triton_utils import tl, triton

BLOCK = 1024  # elements per Triton program


def silu_and_mul_ref(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up, each op rounded to the inputs' dtype, as HF computes it. gate, up: (T, D), one dtype."""
    _check_args(gate, up)
    return F.silu(gate) * up


def silu_and_mul_triton(gate: Tensor, up: Tensor) -> Tensor:
    """silu_and_mul_ref as one Triton kernel (same shapes, same two roundings)."""
    _check_args(gate, up)
    rows, dim = gate.shape
    out = torch.empty(rows, dim, dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    _silu_and_mul_kernel[(rows, triton.cdiv(dim, BLOCK))](
        gate, up, out, dim, gate.stride(0), gate.stride(1), up.stride(0), up.stride(1), BLOCK=BLOCK,
    )  # fmt: skip
    return out


def _check_args(gate: Tensor, up: Tensor) -> None:
    assert gate.dim() == 2 and gate.shape == up.shape and gate.dtype == up.dtype


@triton.jit
def _silu_and_mul_kernel(gate, up, out, dim, stride_gt, stride_gd, stride_ut, stride_ud, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < dim
    g = tl.load(gate + row * stride_gt + cols * stride_gd, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up + row * stride_ut + cols * stride_ud, mask=mask, other=0.0).to(tl.float32)
    # silu(gate) is rounded to the dtype before the multiply, as the two torch ops do.
    s = tu.round_to(g * tl.sigmoid(g), gate.dtype.element_ty)
    tl.store(out + row * dim + cols, s * u, mask=mask)
