"""Weight-only quantized linears on a GPU: a Triton GEMM that dequantizes the weights in registers (every storage
format of quant_linear.py: int8, packed int4, FP8 e4m3, scales and optional offsets per group), and FP8 weights
with bfloat16/float16 activations through torch._scaled_mm where the device has FP8 tensor cores.

quant_linear_triton is quant_linear.quant_linear_ref (x @ W.T in float32, W = q * scale (+ offset) per group of
`group_size` along K) up to summation order: the tl.dot inputs are float32 ("ieee") for float32 activations, the
activations' half type otherwise (the dequantized weight rounded to it, as an unquantized half model's weight
is). fp8_scaled_mm is not weight-only: it quantizes each row of x to FP8 (scale = max|x| / 448) and multiplies
FP8 x FP8 with per-row and per-output-feature scales (vLLM's dynamic per-token FP8); fp8_scaled_mm_ref is that
computation in plain torch. Tested here under TRITON_INTERPRET=1 and torch's CPU _scaled_mm; not on a GPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.kernels import _triton_utils as tu
from runtime.kernels._triton_utils import tl, triton

BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 32  # a program's tile of the result and its step along K
FP8_MAX = 448.0  # the largest finite e4m3fn value
FORMATS = {torch.int8: 0, torch.uint8: 1, torch.float8_e4m3fn: 2}  # the kernel's FORMAT


def quant_linear_triton(x: Tensor, qweight: Tensor, scales: Tensor, group_size: int, bias: Tensor | None,
                        offsets: Tensor | None = None) -> Tensor:
    """quant_linear_ref for x (M, K) on the device of its tensors: the float32 result (M, N)."""
    rows, in_features = x.shape
    out_features = qweight.shape[0]
    y = torch.empty(rows, out_features, dtype=torch.float32, device=x.device)
    if y.numel() == 0:
        return y
    # The kernel reads FP8 as bytes and converts them itself (the interpreter has no FP8 type).
    weights = qweight.view(torch.uint8) if qweight.dtype == torch.float8_e4m3fn else qweight
    scales, x = scales.float().contiguous(), x.contiguous()
    grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(out_features, BLOCK_N))
    dot = tu.dot_dtype(x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.float32)
    _quant_gemm_kernel[grid](
        x, weights.contiguous(), scales, scales if offsets is None else offsets.float().contiguous(),
        y if bias is None else bias.float().contiguous(), y, rows, out_features, in_features, group_size,
        scales.shape[1], weights.shape[1], x.stride(0), FORMAT=FORMATS[qweight.dtype],
        HAS_OFFSETS=offsets is not None, HAS_BIAS=bias is not None, DOT_DTYPE=dot,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        # float32 ("ieee") dots run on the FMA units: 4 warps spilled registers for int4 (ptxas, sm_90).
        num_warps=8 if dot == tl.float32 else 4,
    )  # fmt: skip
    return y


@triton.jit
def _fp8_e4m3_to_float(byte):
    """An e4m3fn byte (int32 0..255) as float32, exactly: normals built from their bits, subnormals m * 2^-9,
    0x7f/0xff NaN."""
    magnitude = byte & 0x7F
    exponent = magnitude >> 3
    mantissa = magnitude & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.int32).to(tl.float32, bitcast=True)
    value = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)
    value = tl.where(magnitude == 0x7F, float("nan"), value)
    return tl.where(byte >= 0x80, -value, value)


@triton.jit
def _quant_gemm_kernel(x, qweight, scales, offsets, bias, y, M, N, K, group_size, groups, row_bytes, stride_xm,
                       FORMAT: tl.constexpr, HAS_OFFSETS: tl.constexpr, HAS_BIAS: tl.constexpr,
                       DOT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        xs = tl.load(x + m[:, None].to(tl.int64) * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                     other=0.0).to(tl.float32)
        w_ok = n_ok[:, None] & k_ok[None, :]
        rows = n[:, None].to(tl.int64) * row_bytes
        if FORMAT == 1:  # int4: value k in byte (k // 16) * 8 + k % 8, the high nibble for k % 16 >= 8
            byte = tl.load(qweight + rows + (k[None, :] // 16) * 8 + (k[None, :] % 8), mask=w_ok, other=0).to(tl.int32)
            q = tl.where((k[None, :] % 16) >= 8, byte >> 4, byte & 15).to(tl.float32) - 8.0
        elif FORMAT == 2:
            q = _fp8_e4m3_to_float(tl.load(qweight + rows + k[None, :], mask=w_ok, other=0).to(tl.int32))
        else:
            q = tl.load(qweight + rows + k[None, :], mask=w_ok, other=0).to(tl.float32)
        at = n[:, None] * groups + k[None, :] // group_size  # each value's group: any group size
        w = q * tl.load(scales + at, mask=w_ok, other=0.0)
        if HAS_OFFSETS:
            w += tl.load(offsets + at, mask=w_ok, other=0.0)
        w = tl.where(w_ok, w, 0.0)  # a NaN weight past K must not reach the sums
        acc += tl.dot(xs.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias + n, mask=n_ok, other=0.0)[None, :]
    tl.store(y + m[:, None].to(tl.int64) * N + n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


def scaled_mm_runs(x: Tensor, qweight: Tensor, scales: Tensor, offsets: Tensor | None) -> bool:
    """fp8_scaled_mm takes this linear: FP8 weights with one scale per output feature (per-channel or a
    per-tensor scale repeated), no offsets, bfloat16 activations (float32 ones keep the weight-only path's
    accuracy; _scaled_mm's per-row scales want a bfloat16 result), on a CUDA device with FP8 tensor cores
    (compute capability 8.9 or later), and K and N multiples of 16 as _scaled_mm asks."""
    if qweight.dtype != torch.float8_e4m3fn or offsets is not None or scales.shape[1] != 1:
        return False
    if x.dtype != torch.bfloat16 or x.device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(x.device) >= (8, 9) and qweight.shape[0] % 16 == 0 and (
        qweight.shape[1] % 16 == 0)


def quantize_rows_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Each row of x as FP8 e4m3 with its scale max|row| / 448 (float32 (M, 1); 1 for an all-zero row)."""
    scale = x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_scaled_mm_ref(x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor:
    """fp8_scaled_mm in plain torch: x's rows quantized to FP8, both sides dequantized, multiplied in float32."""
    xq, x_scale = quantize_rows_fp8(x)
    y = (xq.float() * x_scale) @ (qweight.float() * scales.float()).T
    return y if bias is None else y + bias.float()


def fp8_scaled_mm(x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor:
    """x (M, K) @ W.T (+ bias) on FP8 tensor cores: x quantized per row (quantize_rows_fp8), W FP8 (N, K) with
    per-output-feature scales (N, 1); the result in x's dtype. (torch's CPU _scaled_mm runs it too.)"""
    xq, x_scale = quantize_rows_fp8(x)
    out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
    # _scaled_mm wants its second operand column-major: W.T of a row-major W is.
    y = torch._scaled_mm(xq, qweight.t(), scale_a=x_scale, scale_b=scales.float().reshape(1, -1),
                         bias=None if bias is None else bias.to(out_dtype), out_dtype=out_dtype)
    return y
