"""Batched LoRA (Punica's BGMV): every token row multiplies by the adapter in its own slot, in one pass.

`lora_shrink`: s[t] = x[t] @ A[slot[t]].T, `lora_expand`: y[t] += s[t] @ B[slot[t]] + bias[slot[t]]. The
slots are a fixed pool per linear (runtime/lora/layer.py): A and B zero-padded to the engine's max_lora_rank,
B already multiplied by the adapter's scale, and one last slot of zeros that rows of the base model point at,
so no row needs a branch. B is stored (R, out), PEFT's lora_B transposed: the expand adds whole rows of it.
Many adapters in one batch cost one pass over the rows, not a loop over adapters or merged weights. The
shrink's output is float32; the expand adds in float32 and rounds once into y.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.kernels._triton_utils import tl, triton

# A and B are kept in float32, or in bfloat16 for a bfloat16 model (PEFT loads an adapter in the model's dtype, and
# the pools are read every step: half the bytes); the sums are float32 either way.
POOL_DTYPES = (torch.float32, torch.bfloat16)
ROWS_PER_GATHER = 32  # the reference gathers each row's A or B in groups of this many rows: bounded memory


def lora_shrink_ref(x: Tensor, lora_a: Tensor, indices: Tensor) -> Tensor:
    """x: (T, in) any float dtype; lora_a: (S, R, in) float32 or bfloat16; indices: (T,) int64 in [0, S) -> (T, R)
    float32."""
    _check_shrink(x, lora_a, indices)
    out = x.new_empty(x.shape[0], lora_a.shape[1], dtype=torch.float32)
    for start in range(0, x.shape[0], ROWS_PER_GATHER):
        rows = slice(start, start + ROWS_PER_GATHER)
        a = lora_a.index_select(0, indices[rows]).float()  # (t, R, in)
        out[rows] = torch.bmm(a, x[rows].float().unsqueeze(-1)).squeeze(-1)
    return out


def lora_expand_ref(s: Tensor, lora_b: Tensor, lora_bias: Tensor, indices: Tensor, y: Tensor) -> None:
    """y += s @ B[slot] + bias[slot], per row, in place. s: (T, R) float32; lora_b: (S, R, out) float32 or bfloat16;
    lora_bias: (S, out) float32; indices: (T,) int64; y: (T, out) any float dtype (a view is fine)."""
    _check_expand(s, lora_b, lora_bias, indices, y)
    for start in range(0, s.shape[0], ROWS_PER_GATHER):
        rows = slice(start, start + ROWS_PER_GATHER)
        b = lora_b.index_select(0, indices[rows]).float()  # (t, R, out)
        delta = torch.bmm(s[rows].unsqueeze(1), b).squeeze(1) + lora_bias.index_select(0, indices[rows])
        y[rows] = (y[rows].float() + delta).to(y.dtype)


def _check_shrink(x: Tensor, lora_a: Tensor, indices: Tensor) -> None:
    assert x.dim() == 2 and lora_a.dim() == 3 and lora_a.shape[2] == x.shape[1], (x.shape, lora_a.shape)
    assert lora_a.dtype in POOL_DTYPES and lora_a.is_contiguous()
    assert indices.dtype == torch.int64 and indices.shape == (x.shape[0],)


def _check_expand(s: Tensor, lora_b: Tensor, lora_bias: Tensor, indices: Tensor, y: Tensor) -> None:
    assert s.dim() == 2 and s.dtype == torch.float32 and lora_b.dim() == 3 and lora_b.shape[1] == s.shape[1]
    assert lora_b.dtype in POOL_DTYPES and lora_bias.dtype == torch.float32
    assert lora_b.is_contiguous() and lora_bias.is_contiguous()
    out_features = lora_b.shape[2]
    assert lora_bias.shape == (lora_b.shape[0], out_features) and y.shape == (s.shape[0], out_features), y.shape
    assert indices.dtype == torch.int64 and indices.shape == (s.shape[0],)


BLOCK_K = 64  # input features per shrink iteration
BLOCK_N = 64  # output features per expand program


def lora_shrink_triton(x: Tensor, lora_a: Tensor, indices: Tensor) -> Tensor:
    """lora_shrink_ref as one Triton kernel: a program per row, every rank of the row's slot at once."""
    _check_shrink(x, lora_a, indices)
    rows, dim = x.shape
    rank = lora_a.shape[1]
    out = torch.empty(rows, rank, dtype=torch.float32, device=x.device)
    if rows == 0:
        return out
    _lora_shrink_kernel[(rows,)](
        x, lora_a, indices, out, dim, rank, x.stride(0), x.stride(1),
        BLOCK_R=max(16, triton.next_power_of_2(rank)), BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out


def lora_expand_triton(s: Tensor, lora_b: Tensor, lora_bias: Tensor, indices: Tensor, y: Tensor) -> None:
    """lora_expand_ref as one Triton kernel: a program per row and block of output features."""
    _check_expand(s, lora_b, lora_bias, indices, y)
    rows, rank = s.shape
    out_features = lora_b.shape[2]
    if rows == 0:
        return
    grid = (rows, triton.cdiv(out_features, BLOCK_N))
    _lora_expand_kernel[grid](
        s.contiguous(), lora_b, lora_bias, indices, y, out_features, rank, y.stride(0), y.stride(1),
        BLOCK_R=max(16, triton.next_power_of_2(rank)), BLOCK_N=BLOCK_N,
    )  # fmt: skip


@triton.jit
def _lora_shrink_kernel(x, lora_a, indices, out, dim, rank, stride_xt, stride_xd, BLOCK_R: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(indices + row).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, dim, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x + row * stride_xt + k * stride_xd, mask=k < dim, other=0.0).to(tl.float32)
        a = tl.load(lora_a + slot * rank * dim + r[:, None] * dim + k[None, :],
                    mask=(r[:, None] < rank) & (k[None, :] < dim), other=0.0).to(tl.float32)
        acc += tl.sum(a * xk[None, :], axis=1)
    tl.store(out + row * rank + r, acc, mask=r < rank)


@triton.jit
def _lora_expand_kernel(s, lora_b, lora_bias, indices, y, out_features, rank, stride_yt, stride_yn,
                        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(indices + row).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    sr = tl.load(s + row * rank + r, mask=r < rank, other=0.0)
    b = tl.load(lora_b + slot * rank * out_features + r[None, :] * out_features + n[:, None],
                mask=(n[:, None] < out_features) & (r[None, :] < rank), other=0.0).to(tl.float32)
    delta = tl.sum(b * sr[None, :], axis=1)
    delta += tl.load(lora_bias + slot * out_features + n, mask=n < out_features, other=0.0)
    ptrs = y + row * stride_yt + n * stride_yn
    old = tl.load(ptrs, mask=n < out_features, other=0.0).to(tl.float32)
    tl.store(ptrs, (old + delta).to(y.dtype.element_ty), mask=n < out_features)
