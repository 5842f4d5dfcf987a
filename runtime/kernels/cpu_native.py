"""Native CPU fast paths for the Mamba layers, the norms, attention and small linears: the torch operators
`tandem::...` (csrc/ops.cpp over the C core csrc/cpu_native.c), built on first use by native_build.py.

The torch references make several passes over each gathered state (gather, update, scatter, reduce
with C); the state pool is far larger than the caches, so each pass is a trip to memory. The C
kernels update each state in place in one pass, as vLLM's CPU kernels do (docs/kernels.md).

Each launcher here has its reference's signature, runs the reference for inputs the kernel cannot address
(a float16 pool, say), and otherwise allocates the outputs and calls the operator, which checks every tensor
(a RuntimeError naming the argument) before its kernel runs. As torch operators the kernels are seen by the
profiler, by torch.compile (their fake implementations below) and by the decode-graph recorder like any op.
Without a compiler, or with TANDEM_CPU_NATIVE=0, `available()` is False and the engine keeps the references.
"""

from __future__ import annotations

import functools
import re
from typing import Sequence

import torch
from torch import Tensor

from runtime.kernels import native_build
from runtime.kernels.causal_conv1d import causal_conv1d_fn_ref, causal_conv1d_update_ref
from runtime.kernels.common import NO_DT_LIMIT, time_step
from runtime.kernels.kv_cache import store_kv_ref
from runtime.kernels.metadata import AttentionMetadata, MambaPrefillMetadata
from runtime.kernels.paged_attention import paged_attention_bf16_prefill, paged_attention_ref
from runtime.kernels.rms_norm_gated import rms_norm_gated_ref
from runtime.kernels.rotary import rotary_ref
from runtime.kernels.lora import lora_expand_ref, lora_shrink_ref
from runtime.kernels.silu_and_mul import silu_and_mul_ref
from runtime.kernels.ssd_scan import ssd_scan_ref
from runtime.kernels.ssm_state_update import selective_state_update_ref

ENV_VAR = native_build.ENV_VAR
NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # what the kernels read and write: states, caches, weights


def _constants() -> dict[str, int]:
    """The `#define TANDEM_...` integers of the C core's header: written once, there."""
    text = native_build.HEADER.read_text()
    return {name: int(value) for name, value in re.findall(r"^#define TANDEM_(\w+) (\d+)", text, re.MULTILINE)}


_HEADER = _constants()
GEMV_MAX_ROWS = _HEADER["GEMV_MAX_ROWS"]
PANEL = _HEADER["PANEL"]  # output features per panel of packed weights
AMX_K_MULTIPLE = _HEADER["AMX_K_MULTIPLE"]  # amx_gemm's K: whole tiles of 32 bfloat16 values
# Up to this many rows small_gemm beat oneDNN's float32 GEMM here (AVX2: 2x at 8 rows, 1.2-1.6x at 32,
# level at 64, slower at 128; docs/performance.md).
SMALL_GEMM_MAX_ROWS = 48
# The operators that write into their arguments and return nothing: their fake implementation does nothing.
MUTATING_OPS = ("ssm_state_update", "conv_update", "ssm_scan", "conv_fn", "rms_norm", "rotary", "gemv",
                "small_gemm", "panel_gemm", "amx_gemm", "quant_gemm", "quant_x16_gemm", "quant_dequantize",
                "amx_quant_gemm", "decode_attention", "silu_and_mul", "store_kv", "lora_shrink", "lora_expand")


def available() -> bool:
    """The operators are built and loaded here (and not switched off by TANDEM_CPU_NATIVE=0)."""
    return native_build.enabled() and _loaded()


@functools.cache
def _loaded() -> bool:
    if not native_build.load():
        return False
    for name in MUTATING_OPS:
        torch.library.register_fake(f"tandem::{name}")(_writes_in_place)
    return True


def _writes_in_place(*args, **kwargs) -> None:
    """The fake (meta) implementation of every mutating operator: its outputs are its arguments."""
    return None


def _ops():
    assert _loaded(), "a native launcher ran where the library is not loaded"
    return torch.ops.tandem


def _float32(tensor: Tensor | None) -> Tensor | None:
    """A contiguous float32 copy, or the tensor itself where it is one already: the small per-layer inputs
    (A, D, biases) the kernels read as float32 arrays."""
    return None if tensor is None else tensor.to(torch.float32).contiguous()


def _prefill_arrays(state_indices: Tensor, meta: MambaPrefillMetadata) -> tuple[Tensor, Tensor, Tensor]:
    """The prefill kernels' per-sequence arrays in the types they read: slots (int64), token offsets
    (int32) and whether each sequence resumes from its state (uint8)."""
    return (state_indices.to(torch.int64).contiguous(), meta.query_start_loc.to(torch.int32).contiguous(),
            meta.has_initial_state.to(torch.uint8).contiguous())


def supports_state_pool(states: Tensor, row_dims: int) -> bool:
    """The kernels address a float32 or bfloat16 pool whose last `row_dims` dims are contiguous
    inside each slot (any slot stride): the pool views the engine builds are."""
    if states.dtype not in NATIVE_DTYPES or states.device.type != "cpu":
        return False
    expected = 1
    for size, stride in zip(reversed(states.shape[-row_dims:]), reversed(states.stride()[-row_dims:])):
        if stride != expected:
            return False
        expected *= size
    return True


def selective_state_update_native(
    ssm_states: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    dt_limit: tuple[float, float],
    state_indices: Tensor,
    out: Tensor,
    waves: Sequence[int] | None = None,
) -> Tensor:
    """selective_state_update_ref in one pass per state (same arguments, same result up to summation order);
    a verify's waves (common.in_waves) in one launch, each sequence's positions in turn while its state is in
    the cache; the reference itself for a pool the kernel cannot address (a float16 one)."""
    if not supports_state_pool(ssm_states, 2):
        return selective_state_update_ref(ssm_states, x, dt, A, B, C, D, dt_bias, dt_limit, state_indices, out,
                                          waves)
    num_heads, head_dim = x.shape[1:]
    # x, dt, B and C are read where they lie (slices of the projections, in the model's dtype), dt' is
    # computed in the kernel, and y is written in out's type: a decode step's launch is a few microseconds.
    x, dt, B, C = _rows(x, dt, B, C)
    y = out if out.dtype in NATIVE_DTYPES and out.is_contiguous() else torch.empty(x.shape, dtype=torch.float32)
    per_channel = D.float().reshape(num_heads, -1).expand(num_heads, head_dim)
    clamp = tuple(dt_limit) != NO_DT_LIMIT
    _ops().ssm_state_update(ssm_states, state_indices.to(torch.int64).contiguous(), x, dt, _float32(dt_bias), clamp,
                            *(dt_limit if clamp else (0.0, 0.0)), _float32(A), B, C, _float32(per_channel), y,
                            waves=waves)
    return out if y is out else out.copy_(y)


def _rows(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The tensors as the kernels read them: one row per token, contiguous within it, all of one float32 or
    bfloat16 dtype; as they are where they already are (strided slices included), else float32 copies."""
    dtype = tensors[0].dtype
    if dtype in NATIVE_DTYPES and all(t.dtype == dtype and t.shape[0] and t[0].is_contiguous() for t in tensors):
        return tensors
    return tuple(t.float().contiguous() for t in tensors)


def causal_conv1d_update_native(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_states: Tensor,
    state_indices: Tensor,
    activation: str | None = "silu",
    waves: Sequence[int] | None = None,
) -> Tensor:
    """causal_conv1d_update_ref in one pass per state (same arguments, same result up to summation order), a
    verify's waves in one launch; the reference itself for a pool the kernel cannot address (a float16 one)."""
    if not supports_state_pool(conv_states, 1) or conv_states.stride(1) != x.shape[1]:
        return causal_conv1d_update_ref(x, weight, bias, conv_states, state_indices, activation, waves)
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d_update: unknown activation {activation!r}; use 'silu', 'swish' or None")
    # x is read as it lies (a float32 or bfloat16 slice of the input projection) and out written in its type.
    source = x if x.dtype in NATIVE_DTYPES and x.stride(1) == 1 else x.float().contiguous()
    out = torch.empty(source.shape, dtype=source.dtype)
    _ops().conv_update(conv_states, state_indices.to(torch.int64).contiguous(), source, _float32(weight),
                       _float32(bias), activation is not None, out, waves=waves)
    return out.to(x.dtype)



def ssd_scan_native(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    dt_limit: tuple[float, float],
    ssm_states: Tensor,
    state_indices: Tensor,
    meta: MambaPrefillMetadata,
    out: Tensor,
) -> Tensor:
    """ssd_scan_ref as the token-by-token recurrence (same arguments; the same result up to float32
    rounding: the chunked form sums the same terms in another order); the reference itself for a pool
    the kernel cannot address (a float16 one)."""
    if not supports_state_pool(ssm_states, 2):
        return ssd_scan_ref(x, dt, A, B, C, D, dt_bias, dt_limit, ssm_states, state_indices, meta, out)
    num_heads, head_dim = x.shape[1:]
    # x is read as it lies (a bfloat16 or float32 slice of the conv output) and y written in out's type.
    readable = x.dtype in NATIVE_DTYPES and x.stride(2) == 1 and x.stride(1) == head_dim
    source = x if readable else x.float().contiguous()
    y = out if out.dtype in NATIVE_DTYPES and out.is_contiguous() else torch.empty(x.shape, dtype=torch.float32)
    per_channel = D.float().reshape(num_heads, -1).expand(num_heads, head_dim)
    step = time_step(dt, dt_bias, dt_limit)
    _ops().ssm_scan(ssm_states, *_prefill_arrays(state_indices, meta), source, _float32(step),
                    _float32(torch.exp(step * A)), _float32(B), _float32(C), _float32(per_channel), y)
    return out if y is out else out.copy_(y)


def causal_conv1d_fn_native(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_states: Tensor,
    state_indices: Tensor,
    meta: MambaPrefillMetadata,
    activation: str | None = "silu",
) -> Tensor:
    """causal_conv1d_fn_ref in one pass over the tokens (same arguments, same result up to summation order);
    the reference itself for a pool the kernel cannot address (a float16 one)."""
    if not supports_state_pool(conv_states, 1) or conv_states.stride(1) != x.shape[1]:
        return causal_conv1d_fn_ref(x, weight, bias, conv_states, state_indices, meta, activation)
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d_fn: unknown activation {activation!r}; use 'silu', 'swish' or None")
    # x is read as it lies (a float32 or bfloat16 slice of the input projection) and out written in its type.
    source = x if x.dtype in NATIVE_DTYPES and x.stride(1) == 1 else x.float().contiguous()
    out = torch.empty(source.shape, dtype=source.dtype)
    _ops().conv_fn(conv_states, *_prefill_arrays(state_indices, meta), source, _float32(weight.t()), _float32(bias),
                   activation is not None, out)
    return out.to(x.dtype)


def rms_norm_gated_native(x: Tensor, z: Tensor | None, weight: Tensor, eps: float, group_size: int) -> Tensor:
    """rms_norm_gated_ref in one pass per row (same arguments, same result up to summation order), for x, z
    and weight of one dtype, float32 or bfloat16, with contiguous rows; the reference for anything else."""
    same = x.dtype == weight.dtype and (z is None or z.dtype == x.dtype)
    if not same or x.dtype not in NATIVE_DTYPES or x.stride(1) != 1 or (z is not None and z.stride(1) != 1):
        return rms_norm_gated_ref(x, z, weight, eps, group_size)
    out = torch.empty(x.shape, dtype=x.dtype)
    _ops().rms_norm(x, z, weight.contiguous(), eps, group_size, out)
    return out


def silu_and_mul_native(gate: Tensor, up: Tensor) -> Tensor:
    """silu_and_mul_ref in one pass (same arguments, same two roundings; the exponential within 2 ulp of
    libm's), for float32 or bfloat16 rows with contiguous columns; the reference for anything else."""
    if gate.dtype not in NATIVE_DTYPES or gate.dtype != up.dtype or gate.stride(-1) != 1 or up.stride(-1) != 1:
        return silu_and_mul_ref(gate, up)
    out = torch.empty(gate.shape, dtype=gate.dtype)
    _ops().silu_and_mul(gate, up, out)
    return out


def rotary_native(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """rotary_ref in one pass (same arguments, the same roundings, so the same bits), for float32 or bfloat16
    x with contiguous head rows and cos, sin of its dtype; the reference for anything else."""
    head_dim, rotary_dim = x.shape[2], cos.shape[-1]
    readable = x.dtype in NATIVE_DTYPES and x.stride(2) == 1 and cos.dtype == sin.dtype == x.dtype
    if not readable or rotary_dim % 2 or rotary_dim > head_dim or x.device.type != "cpu":
        return rotary_ref(x, cos, sin)
    out = torch.empty(x.shape, dtype=x.dtype)
    _ops().rotary(x, cos.contiguous(), sin.contiguous(), out)
    return out


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x @ weight.T (+ bias) in float32 for at most GEMV_MAX_ROWS rows of x (K,); weight (N, K) float32
    or bfloat16, contiguous, read as stored. The single-sequence decode's linears: streaming the weights
    is their whole cost, and bfloat16 ones stream half the bytes."""
    y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    _ops().gemv(weight, _float32(x), _float32(bias), y)
    return y


def small_gemm(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x @ weight.T (+ bias) in float32 for a decode batch of rows (any count; it pays up to
    SMALL_GEMM_MAX_ROWS), as dot products per output feature, 8 rows at a time; weight (N, K) float32
    or bfloat16, contiguous, read as stored."""
    y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    _ops().small_gemm(weight, _float32(x), _float32(bias), y)
    return y


def panel_dtypes() -> tuple[torch.dtype, ...]:
    """The weight types panel_gemm runs here: float32 where the CPU has AVX-512, bfloat16 where it
    has AVX-512 BF16 too; none elsewhere (or where the library does not build)."""
    if not available():
        return ()
    supported = torch.ops.tandem.panel_gemm_dtypes()
    return tuple(dtype for bit, dtype in ((1, torch.float32), (2, torch.bfloat16)) if supported & bit)


def pack_panels(weight: Tensor, in_place: bool = False) -> Tensor:
    """weight (N, K), float32 or bfloat16, in the layout panel_gemm reads: float32 (panels, K, PANEL),
    bfloat16 (panels, K / 2, PANEL, 2); features past N and a bfloat16 k past K are zeros. Written in place
    into the new tensor (no padded copy first): for an LM head, the padded copy was a second vocabulary's
    worth of memory at start-up, the run's peak for a quantized model. `in_place`: into weight's own memory
    where the layout fits it (contiguous, N whole panels, K even for bfloat16), weight's values lost; for a
    weight nothing else reads, so that its two copies never coexist."""
    n, k = weight.shape
    bf16 = weight.dtype == torch.bfloat16
    if in_place and weight.is_contiguous() and n % PANEL == 0 and not (bf16 and k % 2):
        return _pack_panels_in_place(weight)
    if bf16 and k % 2:  # the kernel reads x and the weights in pairs of k: a zero pair member
        weight = torch.nn.functional.pad(weight, (0, 1))
        k += 1
    panels, whole = -(-n // PANEL), n // PANEL
    out = weight.new_zeros(_panels_shape(panels, k, bf16))
    target, source = _by_feature(out), _in_pairs(weight)  # both indexed (feature, k)
    target[:whole] = source[: whole * PANEL].reshape(whole, PANEL, *source.shape[1:])
    if whole < panels:
        target[whole, : n - whole * PANEL] = source[whole * PANEL :]
    return out


# Panels packed in place at a time (through a copy of their rows): 2 MiB of bfloat16 weights at K = 2048.
PANELS_IN_PLACE = 16


def _pack_panels_in_place(weight: Tensor) -> Tensor:
    """pack_panels into weight's memory: panel p's values are rows p * PANEL .. (p + 1) * PANEL, the same bytes."""
    n, k = weight.shape
    out = weight.view(_panels_shape(n // PANEL, k, weight.dtype == torch.bfloat16))
    rows = torch.empty(PANELS_IN_PLACE * PANEL, k, dtype=weight.dtype)
    for p0 in range(0, n // PANEL, PANELS_IN_PLACE):
        p1 = min(p0 + PANELS_IN_PLACE, n // PANEL)
        source = _in_pairs(rows[: (p1 - p0) * PANEL].copy_(weight[p0 * PANEL : p1 * PANEL]))
        _by_feature(out[p0:p1]).copy_(source.reshape(p1 - p0, PANEL, *source.shape[1:]))
    return out


def _panels_shape(panels: int, k: int, bf16: bool) -> tuple[int, ...]:
    return (panels, k // 2, PANEL, 2) if bf16 else (panels, k, PANEL)


def _by_feature(panels: Tensor) -> Tensor:
    """Packed panels as a view indexed (panel, feature, k), as _in_pairs indexes a weight's rows."""
    return panels.permute(0, 2, 1, 3) if panels.dim() == 4 else panels.transpose(1, 2)


def _in_pairs(weight: Tensor) -> Tensor:
    """A weight's rows (N, K) as the panels hold them: bfloat16 in pairs of k, (N, K / 2, 2)."""
    return weight.reshape(weight.shape[0], -1, 2) if weight.dtype == torch.bfloat16 else weight


def panel_gemm(x: Tensor, panels: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """x @ weight.T (+ bias) for a decode batch, on weights packed by pack_panels; x (M, K) is taken in
    the weights' type (bfloat16 products are exact in float32, accumulated in float32) and the result
    returned in it."""
    dtype = panels.dtype
    if dtype == torch.bfloat16 and x.shape[1] % 2:  # the kernel reads x in pairs of k: pad with a zero
        x = torch.nn.functional.pad(x, (0, 1))
    source = x.to(dtype)
    if source.stride(1) != 1:
        source = source.contiguous()
    y = torch.empty(x.shape[0], out_features, dtype=dtype)
    _ops().panel_gemm(panels, source, _float32(bias), y)
    return y


def amx_ready() -> bool:
    """amx_gemm runs here: the library was built for a CPU with AMX, and Linux granted this process the AMX
    state (it asks once)."""
    return available() and torch.ops.tandem.amx_ready()


def quant_expands() -> bool:
    """quant_gemm runs batches past 16 rows (int8's past 23) on expanded panels here, prefills included (csrc/quant.c's
    quant_expands: a CPU with AVX2 but not AVX-512)."""
    return available() and _build_expands()


@functools.cache
def _build_expands() -> bool:
    """The build's answer, asked once: every linear of a batch asks."""
    return bool(_ops().quant_expands())


def amx_gemm(x: Tensor, panels: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """panel_gemm for bfloat16 on AMX tiles (same arguments, same result up to summation order); K a
    multiple of AMX_K_MULTIPLE."""
    source = x.to(torch.bfloat16)
    if source.stride(1) != 1:
        source = source.contiguous()
    y = torch.empty(x.shape[0], out_features, dtype=torch.bfloat16)
    _ops().amx_gemm(panels, source, _float32(bias), y)
    return y


def quant_gemm(x: Tensor, qweight: Tensor, scales: Tensor, group_size: int, bias: Tensor | None,
               offsets: Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """quant_linear_ref (quant_linear.py) with the weights dequantized in registers: x (M, K); qweight int8
    (N, K), int4 as quant_linear.pack_int4 packs it (uint8 (N, ceil(K / 16) * 8)) or float8_e4m3fn (N, K);
    scales and offsets float32 (N, groups); the float32 result, or with a bfloat16 x and `out_dtype` bfloat16 that
    result rounded to bfloat16 by the kernel (no conversions around it)."""
    return _quant_linear(_ops().quant_gemm, x, qweight, scales, group_size, bias, offsets, out_dtype)


def quant_x16_gemm(x: Tensor, qweight: Tensor, scales: Tensor, group_size: int, bias: Tensor | None,
                   offsets: Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """quant_linear.quant_linear_x16_ref: int4 weights (uint8, as pack_int4 packs them) against x quantized to two
    8-bit integers a value in blocks of 32, integer products per block (csrc/quant_x16.c); quant_gemm's arguments and
    result dtypes, K a multiple of 64 and group_size a multiple of 64, 32, or at least K."""
    return _quant_linear(_ops().quant_x16_gemm, x, qweight, scales, group_size, bias, offsets, out_dtype)


def _quant_linear(op, x: Tensor, qweight: Tensor, scales: Tensor, group_size: int, bias: Tensor | None,
                  offsets: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """Runs a quantized linear's operator: x as is where it and `out_dtype` are bfloat16, else in float32."""
    if x.dtype == torch.bfloat16 and out_dtype == torch.bfloat16:
        source = x.contiguous()
    else:
        source = _float32(x)
    y = torch.empty(x.shape[0], qweight.shape[0], dtype=source.dtype)
    op(qweight, scales, _float32(offsets), group_size, source, _float32(bias), y)
    return y


def amx_quant_gemm(x: Tensor, qweight: Tensor, scales: Tensor, group_size: int, bias: Tensor | None) -> Tensor:
    """quant_gemm for a bfloat16 x on AMX tiles: int8 or int4 without offsets, K and group_size multiples of
    AMX_K_MULTIPLE (or one group); the float32 result (same sums up to their order)."""
    source = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(x.shape[0], qweight.shape[0], dtype=torch.float32)
    _ops().amx_quant_gemm(qweight, scales, group_size, source, _float32(bias), y)
    return y


def quant_dequantize(qweight: Tensor, scales: Tensor, group_size: int, offsets: Tensor | None, out: Tensor) -> Tensor:
    """quant_linear.dequantize into `out`, float32 (N, K) (contiguous, e.g. a panel of rows of a larger
    buffer): the same values, exactly."""
    _ops().quant_dequantize(qweight, scales, _float32(offsets), group_size, out)
    return out


def store_kv_native(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """store_kv_ref as row copies (same arguments, same result): for inputs of the caches' dtype with D
    contiguous everywhere and K and V caches of one layout; the reference for anything else (a cast)."""
    same_type = key.dtype == value.dtype == k_cache.dtype == v_cache.dtype
    rows_contiguous = all(t.stride(-1) == 1 for t in (key, value, k_cache, v_cache))
    if not same_type or not rows_contiguous or k_cache.stride() != v_cache.stride():
        return store_kv_ref(key, value, k_cache, v_cache, slot_mapping)
    _ops().store_kv(key, value, k_cache, v_cache, slot_mapping.to(torch.int64).contiguous())


def paged_attention_native(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: Tensor,
) -> Tensor:
    """paged_attention_ref for a step of decodes only, reading each sequence's keys and values in place
    (same arguments, same result up to summation order); for a step with a prefill chunk,
    paged_attention_bf16_prefill on a bfloat16 cache and the reference on others, as for caches the
    kernel cannot address (float16, or a head dim with a stride)."""
    addressable = (k_cache.dtype in NATIVE_DTYPES and v_cache.dtype == k_cache.dtype
                   and k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1)
    if meta.max_query_len != 1 and k_cache.dtype == v_cache.dtype == torch.bfloat16:
        return paged_attention_bf16_prefill(q, k_cache, v_cache, block_table, meta, scale, out)
    if meta.max_query_len != 1 or not addressable:
        return paged_attention_ref(q, k_cache, v_cache, block_table, meta, scale, out)
    result = torch.empty(q.shape, dtype=torch.float32)
    _ops().decode_attention(_float32(q), q.dtype == torch.bfloat16, k_cache, v_cache,
                            block_table.to(torch.int32).contiguous(), meta.seq_lens.to(torch.int32).contiguous(),
                            scale, result)
    return out.copy_(result)


def lora_shrink_native(x: Tensor, lora_a: Tensor, indices: Tensor) -> Tensor:
    """lora_shrink_ref over the rows, skipping the base model's (the pool's last, zero slot)."""
    if x.dtype not in NATIVE_DTYPES:
        return lora_shrink_ref(x, lora_a, indices)
    if x.stride(-1) != 1:
        x = x.contiguous()  # the kernel reads whole rows; bfloat16 ones it widens as it reads, as the reference does
    out = torch.empty(x.shape[0], lora_a.shape[1], dtype=torch.float32)
    _ops().lora_shrink(x, lora_a, indices, out)
    return out


def lora_expand_native(s: Tensor, lora_b: Tensor, lora_bias: Tensor, indices: Tensor, y: Tensor) -> None:
    """lora_expand_ref in place, skipping the base model's rows; y's rows may be strided (a view)."""
    if y.dtype not in NATIVE_DTYPES or y.stride(-1) != 1:
        lora_expand_ref(s, lora_b, lora_bias, indices, y)
        return
    _ops().lora_expand(s, lora_b, lora_bias, indices, y)
