"""Gated RMSNorm of the Mamba-2 mixer output (HF's MambaRMSNormGated, norm after the gate)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.kernels import _triton_utils as tu
from runtime.kernels._triton_utils import tl, triton

# Elements of one program's (tokens x group) tile in the Triton kernel.
NORM_ELEMENTS = 8192


def rms_norm_gated_ref(x: Tensor, z: Tensor | None, weight: Tensor, eps: float, group_size: int) -> Tensor:
    """h = x * silu(z) in float32, RMS-normalised per group of group_size channels, cast to x.dtype, times weight.

    x, z: (T, D); weight: (D,); D is a multiple of group_size. Returns (T, D), as HF's MambaRMSNormGated.
    """
    _check_args(x, z, weight, group_size)
    h = x.float()
    if z is not None:
        h = h * F.silu(z.float())
    groups = h.unflatten(-1, (-1, group_size))
    variance = groups.pow(2).mean(-1, keepdim=True)
    h = (groups * torch.rsqrt(variance + eps)).flatten(-2)
    # HF rounds to the input dtype before the weight multiply; keep that order for bit parity.
    return weight * h.to(x.dtype)


def rms_norm_gated_triton(x: Tensor, z: Tensor | None, weight: Tensor, eps: float, group_size: int) -> Tensor:
    """rms_norm_gated_ref as one Triton kernel (same shapes): a program normalises a few tokens of one group."""
    _check_args(x, z, weight, group_size)
    num_tokens, dim = x.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if num_tokens == 0:
        return out
    block_g = triton.next_power_of_2(group_size)
    block_t = max(1, min(triton.next_power_of_2(num_tokens), NORM_ELEMENTS // block_g))
    gate = z if z is not None else x  # an unused pointer when there is no gate
    _rms_norm_gated_kernel[(triton.cdiv(num_tokens, block_t), dim // group_size)](
        x, gate, weight, out, num_tokens, eps, *x.stride(), *gate.stride(), *out.stride(),
        GROUP_SIZE=group_size, HAS_GATE=z is not None, BLOCK_T=block_t, BLOCK_G=block_g,
        num_warps=max(4, min(16, block_t * block_g // 1024)),  # about 32 elements of the tile per thread
    )  # fmt: skip
    return out


def _check_args(x: Tensor, z: Tensor | None, weight: Tensor, group_size: int) -> None:
    assert x.dim() == 2 and x.shape[1] % group_size == 0 and weight.shape == x.shape[1:]
    assert z is None or z.shape == x.shape


@triton.jit
def _rms_norm_gated_kernel(
    x, z, weight, out, num_tokens, eps, stride_xt, stride_xd, stride_zt, stride_zd, stride_ot, stride_od,
    GROUP_SIZE: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    i = tl.arange(0, BLOCK_G)
    cols = tl.program_id(1) * GROUP_SIZE + i
    mask = (tokens < num_tokens)[:, None] & (i < GROUP_SIZE)[None, :]
    t = tokens[:, None].to(tl.int64)
    h = tl.load(x + t * stride_xt + cols[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
    if HAS_GATE:
        g = tl.load(z + t * stride_zt + cols[None, :] * stride_zd, mask=mask, other=0.0).to(tl.float32)
        h = h * g * tl.sigmoid(g)
    h = h * tl.rsqrt(tl.sum(h * h, 1) / GROUP_SIZE + eps)[:, None]
    # Round to the input dtype before the weight multiply, as HF does.
    h = tu.round_to(h, x.dtype.element_ty)
    w = tl.load(weight + cols, mask=i < GROUP_SIZE, other=0.0).to(tl.float32)
    tl.store(out + t * stride_ot + cols[None, :] * stride_od, w[None, :] * h, mask=mask)
