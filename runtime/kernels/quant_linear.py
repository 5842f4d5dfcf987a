"""Weight-only quantized linears: on-the-fly int8 and int4 quantization of a float weight, its torch reference,
and the launcher that picks the native kernels (csrc/quant.c, `tandem::quant_gemm` / `tandem::quant_dequantize`).

int8: symmetric, one scale per output feature (row of the (N, K) weight): scale = max|w| / 127,
q = round(w / scale) in [-127, 127], stored one per byte (int8), as one group of K.
int4: symmetric, one scale per output feature and group of INT4_GROUP_SIZE values along K (the last group of
a row is partial where the group size does not divide K): scale = max|w| / 7, q in [-7, 7], stored two per
byte (uint8 (N, ceil(K / 16) * 8), see pack_int4), so the weights stream an eighth of float32's bytes.

A weight is dequantized as q * scale (+ offset) in float32; the kernels do exactly that in registers and differ
from the reference only in summation order. One path also rounds x: a bfloat16 model's int4 decode on a CPU
without AVX-512 BF16 runs on x rounded to 16-bit integers per block of 32 (x16_runs, quant_linear_x16_ref).

The same representation carries the formats checkpoints publish (loaded, not quantized here): the dtype of
`qweight` names the storage, `scales` (N, groups) and optional `offsets` (N, groups), both float32, the
dequantization w = q * scale + offset of each group of `group_size` values along K:
- int8 (N, K): any int8 values (Q8_0's blocks of 32, Q6_K's 6-bit values in [-32, 31] as groups of 16, ...);
- uint8 (N, ceil(K / 16) * 8): int4 values in [-8, 7] as pack_int4 packs them; an unsigned 4-bit u with zero
  point z is q = u - 8 with offset (8 - z) * scale, and GGUF's K-quant minimums fold into the offset the same way;
- float8_e4m3fn (N, K): FP8 e4m3 weights; a block-wise scale (128 x 128 blocks) repeats over its block's rows.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from runtime.kernels import cpu_native
from runtime.kernels.quant_linear_gpu import fp8_scaled_mm, quant_linear_triton, scaled_mm_runs

SCHEMES = ("int8", "int4")  # vLLM's spellings of the on-the-fly weight-only schemes
INT4_GROUP_SIZE = 128
INT4_BLOCK = 16  # int4 values per 8 bytes (csrc/tandem_cpu.h's TANDEM_INT4_BLOCK); a group is whole blocks
LEVELS = {"int8": 127, "int4": 7}
# Up to this many rows the native kernel runs (each block of 4 rows reads the weights from L1 again); a
# larger batch (a prefill) dequantizes the weight a panel at a time and runs torch's GEMM on each. Where they
# cross (one thread, AVX2, N = K = 2048, int8 / int4): 8 rows 1.9 / 1.6 ms in registers against 2.7 / 2.6 by
# panels, 16 rows 3.7 / 3.6 against 3.7 / 3.8, 24 rows 5.5 / 5.1 against 4.1 / 4.8.
NATIVE_MAX_ROWS = 16
# From this many rows a bfloat16 model's prefill dequantizes the weight to bfloat16 (what transformers runs on
# the same weights) and runs oneDNN's bfloat16 GEMM, on AMX where the CPU has it: the dequantization costs
# about what 256 rows of GEMM do, and from 512 rows this is faster than amx_quant_gemm, 4-5x at 4,096 (its
# tiles reload the weights for every 32 rows), on this machine's AVX-512 + AMX Xeon.
BFLOAT16_GEMM_MIN_ROWS = 512
# Where the CPU has AVX-512 BF16 but no AMX, a bfloat16 model's batches up to this many rows run on quant_gemm's
# converted rows, the longer ones on the weight dequantized to bfloat16 (BFLOAT16_GEMM_MIN_ROWS's path). On this
# machine's EPYC (2 threads, N x K = 2048 x 2048, int8 / int4): 128 rows 4.0 / 4.2 ms converted against 5.1 / 4.8
# dequantized, 256 rows 7.0 / 7.9 against 7.1 / 7.1, 512 rows 14.6 / 15.8 against 12.2 / 12.3 (oneDNN on the
# bfloat16 weight itself: 2.6, 4.9, 10.0 ms).
CONVERTED_MAX_ROWS = 256
# A prefill's float32 panel of dequantized weights (256 features at K = 2048). Smaller panels cost more than the
# dequantization: the GEMM packs x again for every panel (one thread, N = K = 2048, M = 512: 16-row panels 2x
# slower than float32 nn.Linear, 2-8 MiB level with it).
PANEL_BYTES = 2 * 1024 * 1024


def group_size_of(scheme: str, in_features: int) -> int:
    return in_features if scheme == "int8" else INT4_GROUP_SIZE


# Rows quantized at a time: each row's scales and values depend on that row alone, and the float32 temporaries
# of a whole weight (~13 bytes a value) were 760 MB for a 7B model's largest linear, on top of the model.
QUANTIZE_ROWS = 256


def quantize(weight: Tensor, scheme: str, scales: Tensor | None = None,
             group_size: int | None = None) -> tuple[Tensor, Tensor, int]:
    """(qweight, scales, group_size) of a float (N, K) weight; scales float32 (N, groups). A tensor-parallel
    shard of a row-parallel weight passes the scales of its whole rows' groups and its own group size
    (runtime/quant/parallel.py), so that it holds exactly its columns of the unsharded weight's quantization."""
    n, k = weight.shape
    group_size = group_size or group_size_of(scheme, k)
    if n <= QUANTIZE_ROWS:
        return _quantize_rows(weight, scheme, scales, group_size)
    qweight = out_scales = None
    for start in range(0, n, QUANTIZE_ROWS):
        rows = slice(start, start + QUANTIZE_ROWS)
        q, s, _ = _quantize_rows(weight[rows], scheme, None if scales is None else scales[rows], group_size)
        if qweight is None:
            qweight = q.new_empty(n, q.shape[1])
            out_scales = s.new_empty(n, s.shape[1])
        qweight[rows], out_scales[rows] = q, s
    return qweight, out_scales, group_size


def _quantize_rows(weight: Tensor, scheme: str, scales: Tensor | None, group_size: int) -> tuple[Tensor, Tensor, int]:
    n, k = weight.shape
    groups = -(-k // group_size)
    padded = weight.new_zeros(n, groups * group_size, dtype=torch.float32)
    padded[:, :k] = weight.float()
    grouped = padded.view(n, groups, group_size)
    if scales is None:
        scales = grouped.abs().amax(dim=2) / LEVELS[scheme]
    assert scales.shape == (n, groups), (scales.shape, n, groups)
    scales = scales.float()
    # An all-zero group has scale 0 and quantizes to zeros (not 0 / 0).
    divisor = torch.where(scales == 0, torch.ones_like(scales), scales)
    levels = LEVELS[scheme]
    q = torch.round(grouped / divisor[:, :, None]).clamp_(-levels, levels).view(n, -1)[:, :k]
    if scheme == "int8":
        return q.to(torch.int8).contiguous(), scales.contiguous(), group_size
    return pack_int4(q.to(torch.int8)), scales.contiguous(), group_size


def pack_int4(q: Tensor) -> Tensor:
    """(N, K) values in [-8, 7] -> uint8 (N, ceil(K / 16) * 8): blocks of 16 values in 8 bytes, byte j of a
    block holding its value j in the low nibble and its value j + 8 in the high one, each as q + 8 (the layout
    quant.c widens to 8 lanes without a shuffle); values past K are 0."""
    n, k = q.shape
    blocks = -(-k // INT4_BLOCK)
    nibbles = torch.full((n, blocks * INT4_BLOCK), 8, dtype=torch.uint8)
    nibbles[:, :k] = (q + 8).to(torch.uint8)
    nibbles = nibbles.view(n, blocks, 2, INT4_BLOCK // 2)
    return (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).reshape(n, -1).contiguous()


def unpack_int4(packed: Tensor, in_features: int) -> Tensor:
    """pack_int4's inverse: int8 (N, in_features)."""
    n = packed.shape[0]
    blocks = packed.view(n, -1, INT4_BLOCK // 2)
    low, high = (blocks & 15).to(torch.int8) - 8, (blocks >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=2).reshape(n, -1)[:, :in_features]


def dequantize(qweight: Tensor, scales: Tensor, group_size: int, in_features: int,
               offsets: Tensor | None = None) -> Tensor:
    """The float32 (N, K) weight that (qweight, scales[, offsets]) stand for: q * scale (+ offset) per group."""
    q = unpack_int4(qweight, in_features) if qweight.dtype == torch.uint8 else qweight[:, :in_features]
    per_value = scales.repeat_interleave(group_size, dim=1)[:, :in_features]
    weight = q.float() * per_value
    if offsets is not None:
        # Out of place: a captured decode step (decode_graph.py) replayed the in-place form wrongly.
        weight = weight + offsets.repeat_interleave(group_size, dim=1)[:, :in_features]
    return weight


def quant_linear_ref(x: Tensor, qweight: Tensor, scales: Tensor, group_size: int, bias: Tensor | None,
                     offsets: Tensor | None = None) -> Tensor:
    """x @ W.T (+ bias) in float32, W dequantized in float32 (see the module docstring for qweight's storage
    formats); K is x's last dimension."""
    weight = dequantize(qweight, scales, group_size, x.shape[-1], offsets)
    return torch.nn.functional.linear(x.float(), weight, None if bias is None else bias.float())


# int4 against 16-bit integer activations (csrc/quant_x16.c): x quantized in blocks of this many values, K whole
# steps of X16_STEP, up to X16_MAX_ROWS rows (a decode).
X16_BLOCK = 32
X16_FINE = 256  # x / d = q + r / X16_FINE
X16_STEP = 64
X16_MAX_ROWS = 16


def quantize_activations(x: Tensor) -> Tensor:
    """x (..., K), K a multiple of X16_BLOCK, as the integer activations stand for it, in float32: per block of
    X16_BLOCK values d = max|x| / 127, and each value x / d = q + r / 256 with q = round(x / d) and r = round((x / d
    - q) * 256) clamped to [-127, 127] (to nearest, ties to even), two 8-bit integers: the value (q * 256 + r) *
    (d / 256), within d / 256 of x (16 bits a block, where bfloat16 keeps 8 a value). An all-zero block is zeros."""
    blocks = x.float().reshape(*x.shape[:-1], -1, X16_BLOCK)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))  # the kernel multiplies by 1 / d, too
    scaled = blocks * inverse
    q = torch.round(scaled)
    r = torch.round((scaled - q) * X16_FINE).clamp(-127, 127)  # scaled - q and * 256 are exact
    return ((q * X16_FINE + r) * (scale / X16_FINE)).reshape(x.shape)


def quant_linear_x16_ref(x: Tensor, qweight: Tensor, scales: Tensor, group_size: int, bias: Tensor | None,
                        offsets: Tensor | None = None) -> Tensor:
    """quant_linear_ref on x's integer activations (quantize_activations): what tandem::quant_x16_gemm computes."""
    return quant_linear_ref(quantize_activations(x), qweight, scales, group_size, bias, offsets)


def x16_runs(x: Tensor, qweight: Tensor, group_size: int) -> bool:
    """A bfloat16 model's int4 decode (up to X16_MAX_ROWS rows) on integer activations (quant_linear_x16_ref), where
    the CPU has no AVX-512 BF16: there a weight-only int4 linear is bound by turning nibbles into floats, and this
    runs 1.1-2x faster (docs/features/quantization.md), with an error a hundredth of what rounding x to bfloat16
    costs. A float32 model (whose parity with HF is held to 1e-4) and a CPU that multiplies bfloat16 (whose int4 steps
    stream the weights at memory speed already) keep the weight-only sums. K whole steps of X16_STEP, groups
    multiples of 64 or 32 or the whole row."""
    k = x.shape[1]
    return (x.dtype == torch.bfloat16 and qweight.dtype == torch.uint8 and x.shape[0] <= X16_MAX_ROWS
            and k % X16_STEP == 0 and (group_size % X16_STEP == 0 or group_size == X16_BLOCK or group_size >= k)
            and not bfloat16_native())


def native_runs(qweight: Tensor, offsets: Tensor | None, group_size: int | None = None,
                in_features: int | None = None) -> bool:
    """The native kernels take every format of the module docstring, offsets or not; int4 in groups of whole
    blocks of INT4_BLOCK values or in one group per row (the reference takes the others)."""
    if qweight.dtype not in (torch.int8, torch.uint8, torch.float8_e4m3fn):
        return False
    if qweight.dtype != torch.uint8 or group_size is None or group_size % INT4_BLOCK == 0:
        return True
    return group_size >= (qweight.shape[1] * 2 if in_features is None else in_features)


def panel_rows(in_features: int) -> int:
    """Output features per panel of a prefill: PANEL_BYTES of float32 weights."""
    return max(INT4_BLOCK, PANEL_BYTES // (4 * max(in_features, 1)))


def quant_linear_panels(x: Tensor, qweight: Tensor, scales: Tensor, group_size: int, bias: Tensor | None,
                        offsets: Tensor | None = None) -> Tensor:
    """quant_linear_ref for a batch of rows (a prefill): the weight dequantized a panel of output features at a
    time into one small float32 buffer (the native quant_dequantize, exactly the reference's values), each panel
    multiplied by torch's GEMM into its columns of the result; x (M, K)."""
    rows, in_features = x.shape
    out_features = qweight.shape[0]
    source = x.float()
    y = torch.empty(rows, out_features, dtype=torch.float32)
    step = min(panel_rows(in_features), out_features)
    buffer = torch.empty(step, in_features, dtype=torch.float32)
    for n0 in range(0, out_features, step):
        n1 = min(n0 + step, out_features)
        panel = cpu_native.quant_dequantize(qweight[n0:n1], scales[n0:n1], group_size,
                                            None if offsets is None else offsets[n0:n1], buffer[:n1 - n0])
        # The GEMM writes the columns in place: a row-major block with the result's row stride.
        torch.mm(source, panel.t(), out=y[:, n0:n1])
    if bias is not None:
        y += bias.float()
    return y


def dequantized_bfloat16(qweight: Tensor, scales: Tensor, group_size: int, offsets: Tensor | None,
                         in_features: int) -> Tensor:
    """The weight as the reference dequantizes it, rounded to bfloat16 (N, K): a panel of output features at a
    time through a float32 buffer that stays in cache (the whole float32 weight went to memory and back, 4x
    the time at 8192 x 2048)."""
    out_features = qweight.shape[0]
    weight = torch.empty(out_features, in_features, dtype=torch.bfloat16)
    step = min(panel_rows(in_features), out_features)
    buffer = torch.empty(step, in_features, dtype=torch.float32)
    for n0 in range(0, out_features, step):
        n1 = min(n0 + step, out_features)
        panel = cpu_native.quant_dequantize(qweight[n0:n1], scales[n0:n1], group_size,
                                            None if offsets is None else offsets[n0:n1], buffer[:n1 - n0])
        weight[n0:n1].copy_(panel)
    return weight


def converts(x: Tensor, qweight: Tensor, group_size: int) -> bool:
    """A batch of a bfloat16 model's rows, short of CONVERTED_MAX_ROWS, on quant_gemm's converted rows (csrc/quant.c's
    quant_converts): each block of weight rows converted to bfloat16 once and multiplied with vdpbf16ps, where the
    CPU has AVX-512 BF16 but no AMX; int8 or int4, K and the groups whole steps of 32."""
    k = x.shape[1]
    return (x.dtype == torch.bfloat16 and x.shape[0] < CONVERTED_MAX_ROWS and bfloat16_native()
            and not cpu_native.amx_ready() and qweight.dtype in (torch.int8, torch.uint8) and k % 32 == 0
            and (group_size % 32 == 0 or group_size >= k))


def native_max_rows() -> float:
    """Up to how many rows quant_gemm takes a batch here (converts() aside): every batch with AVX2 only."""
    # With AVX2 but not AVX-512 (where quant_gemm expands batches: cpu_native.quant_expands()) the native kernel takes
    # every batch, a prefill's in chunks of rows (csrc/quant.c's QUANT_EXPAND_CHUNK): quant_linear_panels lost at
    # every count of rows there (two threads of an AVX2 EPYC, ms, panels against quant_gemm: int8 2048 x 2048 at 32 / 64
    # rows 8.6 / 12.0 against 4.3 / 8.4 on its steps; at 128 / 512 / 2,048 rows on its expanded panels int8 2048 x 2048
    # 19.7 / 52.2 / 183 against 14.1 / 50.3 / 173, int4 3352 x 768 8.2 / 33.5 / 173 against 6.9 / 24.6 / 105).
    return math.inf if cpu_native.quant_expands() else NATIVE_MAX_ROWS


def bfloat16_gemm_runs(x: Tensor) -> bool:
    """A bfloat16 model's batch on the weight dequantized to bfloat16 and oneDNN's GEMM: from
    BFLOAT16_GEMM_MIN_ROWS rows, and from CONVERTED_MAX_ROWS where the CPU multiplies bfloat16 natively without
    AMX (shorter batches that converts() does not take stay on the float32 panels, exact weights)."""
    if x.dtype != torch.bfloat16:
        return False
    rows = x.shape[0]
    if not bfloat16_native():  # oneDNN emulates bfloat16 there: 3.5-6.5x the float32 panels' time (AVX2, 4,096 rows)
        return False
    return rows >= BFLOAT16_GEMM_MIN_ROWS or (rows >= CONVERTED_MAX_ROWS and not cpu_native.amx_ready())


def bfloat16_native() -> bool:
    """The native library multiplies bfloat16 here (AVX-512 BF16), and so does oneDNN."""
    return torch.bfloat16 in cpu_native.panel_dtypes()


def amx_runs(x: Tensor, qweight: Tensor, offsets: Tensor | None, group_size: int) -> bool:
    """A batch of a bfloat16 model's rows (a prefill) on AMX tiles (cpu_native.amx_quant_gemm): int8 or int4
    without offsets, K and the groups whole tiles of 32. Its products are exact (x and q are bfloat16 values), so
    it sums what quant_linear_panels sums in float32, about 6x faster (128 rows of llama-1b's shapes here)."""
    k = x.shape[1]
    return (x.dtype == torch.bfloat16 and qweight.dtype in (torch.int8, torch.uint8) and offsets is None
            and k % cpu_native.AMX_K_MULTIPLE == 0 and (group_size % cpu_native.AMX_K_MULTIPLE == 0 or group_size >= k)
            and cpu_native.amx_ready())


def quant_linear(x: Tensor, qweight: Tensor, scales: Tensor, group_size: int, bias: Tensor | None,
                 offsets: Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """quant_linear_ref on the native kernels where they run (a CPU with the library, a format native_runs
    takes): a bfloat16 model's int4 decode on integer activations where x16_runs (quant_linear_x16_ref's result), else
    up to native_max_rows() rows in registers (quant_gemm; a bfloat16 model's batches up to
    CONVERTED_MAX_ROWS too where converts()), then a bfloat16 model's batch on the weight dequantized to bfloat16
    (bfloat16_gemm_runs) or on AMX tiles (amx_runs), others by float32 panels (quant_linear_panels); on a CUDA
    device the Triton kernel (quant_linear_gpu.py), or _scaled_mm for FP8 per-channel weights with bfloat16
    activations where the GPU has FP8 (scaled_mm_runs). The float32 result, as the reference's, or bfloat16 from
    the bfloat16 GEMM, or from quant_gemm where x and `out_dtype` are bfloat16 (a bfloat16 model's linear)."""
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if x.is_cuda:
        if scaled_mm_runs(flat, qweight, scales, offsets):
            y = fp8_scaled_mm(flat, qweight, scales, bias).float()
        else:
            y = quant_linear_triton(flat, qweight, scales, group_size, bias, offsets)
    elif x.is_cpu and cpu_native.available() and native_runs(qweight, offsets, group_size, x.shape[-1]):
        if x16_runs(flat, qweight, group_size):
            y = cpu_native.quant_x16_gemm(flat, qweight, scales, group_size, bias, offsets, out_dtype)
        elif flat.shape[0] <= native_max_rows() or converts(flat, qweight, group_size):
            y = cpu_native.quant_gemm(flat, qweight, scales, group_size, bias, offsets, out_dtype)
        elif bfloat16_gemm_runs(flat):
            weight = dequantized_bfloat16(qweight, scales, group_size, offsets, flat.shape[1])
            y = torch.nn.functional.linear(flat, weight, None if bias is None else bias.to(torch.bfloat16))
        elif amx_runs(flat, qweight, offsets, group_size):
            y = cpu_native.amx_quant_gemm(flat, qweight, scales, group_size, bias)
        else:
            y = quant_linear_panels(flat, qweight, scales, group_size, bias, offsets)
    else:
        y = quant_linear_ref(flat, qweight, scales, group_size, bias, offsets)
    # A decode's (M, K) x needs no reshape either way: each costs about a microsecond a linear.
    return y if x.dim() == 2 else y.view(*x.shape[:-1], qweight.shape[0])
