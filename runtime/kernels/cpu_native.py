"""Native CPU fast paths for the Mamba layers, the norms and small linears: cpu_native.c, built on first
use, called through ctypes.

The torch references make several passes over each gathered state (gather, update, scatter, reduce
with C); the state pool is far larger than the caches, so each pass is a trip to memory. The C
kernels update each state in place in one pass, as vLLM's CPU kernels do (docs/kernels.md).

The library is compiled once per machine and source (`cc -O3 -march=native -fopenmp`, under a second
here) into ~/.cache/tandem/native (TANDEM_CACHE_DIR moves it) and loaded next to torch, whose OpenMP
runtime it shares. Without a C compiler, or with TANDEM_CPU_NATIVE=0, `available()` is
False and the engine keeps the references. The launchers have the references' signatures.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from runtime.kernels.causal_conv1d import causal_conv1d_fn_ref, causal_conv1d_update_ref
from runtime.kernels.common import NO_DT_LIMIT, time_step
from runtime.kernels.kv_cache import store_kv_ref
from runtime.kernels.metadata import AttentionMetadata, MambaPrefillMetadata
from runtime.kernels.paged_attention import paged_attention_bf16_prefill, paged_attention_ref
from runtime.kernels.rms_norm_gated import rms_norm_gated_ref
from runtime.kernels.rotary import rotary_ref
from runtime.kernels.silu_and_mul import silu_and_mul_ref
from runtime.kernels.ssd_scan import ssd_scan_ref
from runtime.kernels.ssm_state_update import selective_state_update_ref

logger = logging.getLogger("tandem")
ENV_VAR = "TANDEM_CPU_NATIVE"
SOURCE = Path(__file__).with_name("cpu_native.c")
# 512-bit vectors in GCC's own loops too, where the CPU has them (GCC's tuning for recent Intel CPUs prefers
# 256): a 512-bit load of what 256-bit stores just wrote is not forwarded from the store buffer, and stalled
# the SiLU after the prefill conv (conv 3.2 -> 1.9 ms, gated norm 1.9 -> 1.7 ms for 2,048 tokens).
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC",
         "-std=c11"]
NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # what the kernels read and write: states, caches, weights
GEMV_MAX_ROWS = 4  # as in cpu_native.c
# Up to this many rows small_gemm beat oneDNN's float32 GEMM here (AVX2: 2x at 8 rows, 1.2-1.6x at 32,
# level at 64, slower at 128; docs/performance.md).
SMALL_GEMM_MAX_ROWS = 48

_SIGNATURES = {
    "tandem_ssm_state_update": [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                *[ctypes.c_int] * 6, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_float, *[ctypes.c_void_p] * 2,
                                ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, *[ctypes.c_void_p] * 2,
                                *[ctypes.c_int] * 2],
    "tandem_ssm_scan": [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, *[ctypes.c_void_p] * 3,
                        *[ctypes.c_int] * 5, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, *[ctypes.c_void_p] * 6,
                        ctypes.c_int, ctypes.c_int],
    "tandem_conv_fn": [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, *[ctypes.c_void_p] * 3, *[ctypes.c_int] * 3,
                       ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, *[ctypes.c_void_p] * 2, ctypes.c_int,
                       ctypes.c_void_p, ctypes.c_int],
    "tandem_rms_norm": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                        ctypes.c_void_p, *[ctypes.c_int] * 4, ctypes.c_float, ctypes.c_int],
    "tandem_gemv": [ctypes.c_void_p, ctypes.c_int, *[ctypes.c_void_p] * 3, *[ctypes.c_int] * 4],
    "tandem_small_gemm": [ctypes.c_void_p, ctypes.c_int, *[ctypes.c_void_p] * 3, *[ctypes.c_int] * 4],
    "tandem_decode_attention": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, *[ctypes.c_int64] * 3, ctypes.c_int,
                                ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, *[ctypes.c_int] * 4,
                                ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int],
    "tandem_silu_and_mul": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                            *[ctypes.c_int] * 4],
    "tandem_store_kv": [ctypes.c_void_p, *[ctypes.c_int64] * 2, ctypes.c_void_p, *[ctypes.c_int64] * 2,
                        *[ctypes.c_void_p] * 2, *[ctypes.c_int64] * 3, ctypes.c_int, ctypes.c_void_p,
                        *[ctypes.c_int] * 5],
    "tandem_panel_gemm": [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, *[ctypes.c_void_p] * 2,
                          *[ctypes.c_int] * 5],
    "tandem_rotary": [ctypes.c_void_p, *[ctypes.c_int64] * 2, *[ctypes.c_void_p] * 3, *[ctypes.c_int] * 6],
    "tandem_panel_gemm_dtypes": [],
    "tandem_amx_ready": [],
    "tandem_amx_gemm": [*[ctypes.c_void_p] * 2, ctypes.c_int64, *[ctypes.c_void_p] * 2, *[ctypes.c_int] * 4],
    "tandem_conv_update": [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, *[ctypes.c_int] * 3,
                           ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, *[ctypes.c_void_p] * 2, ctypes.c_int,
                           ctypes.c_void_p, ctypes.c_int],
}


def available() -> bool:
    """The library is built and loaded here (and not switched off by TANDEM_CPU_NATIVE=0)."""
    if os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "no"):
        return False
    return _library() is not None


@functools.cache
def _library() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("no C compiler found: the Mamba decode steps run on the torch references")
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as err:
        logger.warning("the native CPU kernels did not build (%s); the torch references run instead", err)
        return None
    for name, argtypes in _SIGNATURES.items():
        getattr(library, name).argtypes = argtypes
        getattr(library, name).restype = None
    library.tandem_panel_gemm_dtypes.restype = ctypes.c_int
    library.tandem_amx_ready.restype = ctypes.c_int
    return library


def _build(compiler: str) -> Path:
    """The library for this source, these flags and this compiler, compiled unless already cached."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *FLAGS]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem") / "native"
    target = cache / f"libtandem_cpu-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: a concurrent process never loads a half-written file.
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        built = Path(scratch) / target.name
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], check=True, capture_output=True)
        os.replace(built, target)
    return target


_recording: list | None = None  # the program of the decode step being captured (runtime/decode_graph.py)


@contextlib.contextmanager
def recording(program: list) -> Iterator[None]:
    """Append every kernel launch made inside to `program`, as a call that repeats it with the same arguments."""
    global _recording
    assert _recording is None, "captures do not nest"
    _recording = program
    try:
        yield
    finally:
        _recording = None


def _kernels() -> ctypes.CDLL | _Recorded:
    """The library, through which the launchers call their kernels; while a step is captured, a view of it
    that records each call too."""
    library = _library()
    return library if _recording is None else _Recorded(library, _recording)


class _Recorded:
    def __init__(self, library: ctypes.CDLL, program: list):
        self._library, self._program = library, program

    def __getattr__(self, name: str):
        kernel = getattr(self._library, name)

        def launch(*args):
            kernel(*args)
            self._program.append(functools.partial(kernel, *args))

        return launch


def _pointers(*tensors: Tensor | None) -> tuple[list[int | None], list[Tensor | None]]:
    """Data pointers of contiguous float32 copies (or the tensors themselves where they already are);
    the copies are returned too, and must outlive the call."""
    held = [None if t is None else t.to(torch.float32).contiguous() for t in tensors]
    return [None if t is None else t.data_ptr() for t in held], held


def _prefill_arrays(state_indices: Tensor, meta: MambaPrefillMetadata,
                    num_tokens: int) -> tuple[Tensor, Tensor, Tensor]:
    """The prefill kernels' per-sequence arrays in the C types they read: slots (int64), token offsets
    (int32) and whether each sequence resumes from its state (uint8)."""
    starts = meta.query_start_loc.to(torch.int32).contiguous()
    assert starts.shape == (meta.num_sequences + 1,) and int(starts[-1]) == num_tokens
    return (state_indices.to(torch.int64).contiguous(), starts,
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
) -> Tensor:
    """selective_state_update_ref in one pass per state (same arguments, same result up to summation order);
    the reference itself for a pool the kernel cannot address (a float16 one)."""
    if not supports_state_pool(ssm_states, 2):
        return selective_state_update_ref(ssm_states, x, dt, A, B, C, D, dt_bias, dt_limit, state_indices, out)
    num_seqs, num_heads, head_dim = x.shape
    num_groups, d_state = B.shape[1:]
    assert ssm_states.shape[1:] == (num_heads, head_dim, d_state) and A.shape == (num_heads,)
    assert num_heads % num_groups == 0 and state_indices.shape == (num_seqs,)
    # x, dt, B and C are read where they lie (slices of the projections, in the model's dtype), dt' is
    # computed in the kernel, and y is written in out's type: a decode step's launch is a few microseconds.
    inputs = _rows(x, dt, B, C)
    y = out if out.dtype in NATIVE_DTYPES and out.is_contiguous() else torch.empty(x.shape, dtype=torch.float32)
    slots = state_indices.to(torch.int64).contiguous()
    per_channel = D.float().reshape(num_heads, -1).expand(num_heads, head_dim)
    (a_ptr, d_ptr, bias_ptr), _held = _pointers(A, per_channel, dt_bias)
    (x, dt, B, C) = inputs
    clamp = tuple(dt_limit) != NO_DT_LIMIT
    _kernels().tandem_ssm_state_update(
        ssm_states.data_ptr(), ssm_states.dtype == torch.bfloat16, ssm_states.stride(0), ssm_states.stride(1),
        slots.data_ptr(), num_seqs, num_heads, head_dim, d_state, num_groups, x.dtype == torch.bfloat16,
        x.data_ptr(), x.stride(0), dt.data_ptr(), dt.stride(0), bias_ptr, clamp, *(dt_limit if clamp else (0, 0)),
        a_ptr, B.data_ptr(), B.stride(0), C.data_ptr(), C.stride(0), d_ptr, y.data_ptr(), y.dtype == torch.bfloat16,
        torch.get_num_threads(),
    )
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
) -> Tensor:
    """causal_conv1d_update_ref in one pass per state (same arguments, same result up to summation order);
    the reference itself for a pool the kernel cannot address (a float16 one)."""
    if not supports_state_pool(conv_states, 1) or conv_states.stride(1) != x.shape[1]:
        return causal_conv1d_update_ref(x, weight, bias, conv_states, state_indices, activation)
    num_seqs, dim = x.shape
    width = weight.shape[1]
    assert conv_states.shape[1:] == (width - 1, dim) and state_indices.shape == (num_seqs,)
    assert activation in (None, "silu", "swish")
    # x is read as it lies (a float32 or bfloat16 slice of the input projection) and out written in its type.
    source = x if x.dtype in NATIVE_DTYPES and x.stride(1) == 1 else x.float().contiguous()
    out = torch.empty(num_seqs, dim, dtype=source.dtype)
    slots = state_indices.to(torch.int64).contiguous()
    (weight_ptr, bias_ptr), _held = _pointers(weight, bias)
    _kernels().tandem_conv_update(
        conv_states.data_ptr(), conv_states.dtype == torch.bfloat16, conv_states.stride(0), slots.data_ptr(),
        num_seqs, dim, width, source.data_ptr(), source.dtype == torch.bfloat16, source.stride(0), weight_ptr,
        bias_ptr, activation is not None, out.data_ptr(), torch.get_num_threads(),
    )
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
    num_tokens, num_heads, head_dim = x.shape
    num_groups, d_state = B.shape[1:]
    assert ssm_states.shape[1:] == (num_heads, head_dim, d_state) and A.shape == (num_heads,)
    assert num_heads % num_groups == 0 and state_indices.shape == (meta.num_sequences,)
    # x is read as it lies (a bfloat16 or float32 slice of the conv output) and y written in out's type.
    readable = x.dtype in NATIVE_DTYPES and x.stride(2) == 1 and x.stride(1) == head_dim
    source = x if readable else x.float().contiguous()
    y = out if out.dtype in NATIVE_DTYPES and out.is_contiguous() else torch.empty(x.shape, dtype=torch.float32)
    slots, starts, resume = _prefill_arrays(state_indices, meta, num_tokens)
    per_channel = D.float().reshape(num_heads, -1).expand(num_heads, head_dim)
    step = time_step(dt, dt_bias, dt_limit)
    inputs, _held = _pointers(step, torch.exp(step * A), B, C, per_channel)
    _kernels().tandem_ssm_scan(
        ssm_states.data_ptr(), ssm_states.dtype == torch.bfloat16, ssm_states.stride(0), ssm_states.stride(1),
        slots.data_ptr(), starts.data_ptr(), resume.data_ptr(), meta.num_sequences, num_heads, head_dim, d_state,
        num_groups, source.data_ptr(), source.dtype == torch.bfloat16, source.stride(0), *inputs, y.data_ptr(),
        y.dtype == torch.bfloat16, torch.get_num_threads(),
    )
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
    num_tokens, dim = x.shape
    width = weight.shape[1]
    if not supports_state_pool(conv_states, 1) or conv_states.stride(1) != dim:
        return causal_conv1d_fn_ref(x, weight, bias, conv_states, state_indices, meta, activation)
    assert conv_states.shape[1:] == (width - 1, dim) and state_indices.shape == (meta.num_sequences,)
    assert activation in (None, "silu", "swish")
    # x is read as it lies (a float32 or bfloat16 slice of the input projection) and out written in its type.
    source = x if x.dtype in NATIVE_DTYPES and x.stride(1) == 1 else x.float().contiguous()
    out = torch.empty(num_tokens, dim, dtype=source.dtype)
    slots, starts, resume = _prefill_arrays(state_indices, meta, num_tokens)
    (weight_ptr, bias_ptr), _held = _pointers(weight.t(), bias)
    _kernels().tandem_conv_fn(
        conv_states.data_ptr(), conv_states.dtype == torch.bfloat16, conv_states.stride(0), slots.data_ptr(),
        starts.data_ptr(), resume.data_ptr(), meta.num_sequences, dim, width, source.data_ptr(),
        source.dtype == torch.bfloat16, source.stride(0), weight_ptr, bias_ptr, activation is not None,
        out.data_ptr(), torch.get_num_threads(),
    )
    return out.to(x.dtype)


def rms_norm_gated_native(x: Tensor, z: Tensor | None, weight: Tensor, eps: float, group_size: int) -> Tensor:
    """rms_norm_gated_ref in one pass per row (same arguments, same result up to summation order), for x, z
    and weight of one dtype, float32 or bfloat16, with contiguous rows; the reference for anything else."""
    rows, dim = x.shape
    same = x.dtype == weight.dtype and (z is None or z.dtype == x.dtype)
    if not same or x.dtype not in NATIVE_DTYPES or x.stride(1) != 1 or (z is not None and z.stride(1) != 1):
        return rms_norm_gated_ref(x, z, weight, eps, group_size)
    assert dim % group_size == 0 and weight.shape == (dim,) and (z is None or z.shape == x.shape)
    weight = weight.contiguous()
    out = torch.empty(rows, dim, dtype=x.dtype)
    _kernels().tandem_rms_norm(
        x.data_ptr(), x.stride(0), None if z is None else z.data_ptr(), 0 if z is None else z.stride(0),
        weight.data_ptr(), out.data_ptr(), x.dtype == torch.bfloat16, rows, dim, group_size, eps,
        torch.get_num_threads(),
    )
    return out


def silu_and_mul_native(gate: Tensor, up: Tensor) -> Tensor:
    """silu_and_mul_ref in one pass (same arguments, same two roundings; the exponential within 2 ulp of
    libm's), for float32 or bfloat16 rows with contiguous columns; the reference for anything else."""
    if gate.dtype not in NATIVE_DTYPES or gate.dtype != up.dtype or gate.stride(-1) != 1 or up.stride(-1) != 1:
        return silu_and_mul_ref(gate, up)
    rows, dim = gate.shape
    assert up.shape == gate.shape
    out = torch.empty(rows, dim, dtype=gate.dtype)
    _kernels().tandem_silu_and_mul(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(),
                                   gate.dtype == torch.bfloat16, rows, dim, torch.get_num_threads())
    return out


def rotary_native(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """rotary_ref in one pass (same arguments, the same roundings, so the same bits), for float32 or bfloat16
    x with contiguous head rows and cos, sin of its dtype; the reference for anything else."""
    tokens, heads, head_dim = x.shape
    rotary_dim = cos.shape[-1]
    readable = x.dtype in NATIVE_DTYPES and x.stride(2) == 1 and cos.dtype == sin.dtype == x.dtype
    if not readable or rotary_dim % 2 or rotary_dim > head_dim or x.device.type != "cpu":
        return rotary_ref(x, cos, sin)
    assert cos.shape == sin.shape == (tokens, rotary_dim)
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(tokens, heads, head_dim, dtype=x.dtype)
    _kernels().tandem_rotary(x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
                             x.dtype == torch.bfloat16, tokens, heads, head_dim, rotary_dim, torch.get_num_threads())
    return out


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x @ weight.T (+ bias) in float32 for at most GEMV_MAX_ROWS rows of x (K,); weight (N, K) float32
    or bfloat16, contiguous, read as stored. The single-sequence decode's linears: streaming the weights
    is their whole cost, and bfloat16 ones stream half the bytes."""
    assert x.shape[0] <= GEMV_MAX_ROWS
    return _linear(_kernels().tandem_gemv, x, weight, bias)


def small_gemm(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x @ weight.T (+ bias) in float32 for a decode batch of rows (any count; it pays up to
    SMALL_GEMM_MAX_ROWS), as dot products per output feature, 8 rows at a time; weight (N, K) float32
    or bfloat16, contiguous, read as stored."""
    return _linear(_kernels().tandem_small_gemm, x, weight, bias)


def _linear(kernel, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Run one of the decode-batch linear kernels, which share their arguments."""
    rows, in_features = x.shape
    out_features = weight.shape[0]
    assert weight.shape == (out_features, in_features) and weight.is_contiguous()
    assert weight.dtype in NATIVE_DTYPES and (bias is None or bias.shape == (out_features,))
    y = torch.empty(rows, out_features, dtype=torch.float32)
    (x_ptr, bias_ptr), _held = _pointers(x, bias)
    kernel(weight.data_ptr(), weight.dtype == torch.bfloat16, x_ptr, bias_ptr, y.data_ptr(), rows, out_features,
           in_features, torch.get_num_threads())
    return y


PANEL = 32  # output features per panel of packed weights, as in cpu_native.c


def panel_dtypes() -> tuple[torch.dtype, ...]:
    """The weight types panel_gemm runs here: float32 where the CPU has AVX-512, bfloat16 where it
    has AVX-512 BF16 too; none elsewhere (or where the library does not build)."""
    library = _library()
    if library is None:
        return ()
    supported = library.tandem_panel_gemm_dtypes()
    return tuple(dtype for bit, dtype in ((1, torch.float32), (2, torch.bfloat16)) if supported & bit)


def pack_panels(weight: Tensor) -> Tensor:
    """weight (N, K), float32 or bfloat16, in the layout panel_gemm reads: float32 (panels, K, PANEL),
    bfloat16 (panels, K / 2, PANEL, 2); features past N and a bfloat16 k past K are zeros."""
    n, k = weight.shape
    padded_n, padded_k = -(-n // PANEL) * PANEL, k + k % 2 if weight.dtype == torch.bfloat16 else k
    padded = weight.new_zeros(padded_n, padded_k)
    padded[:n, :k] = weight
    if weight.dtype == torch.bfloat16:
        return padded.view(padded_n // PANEL, PANEL, padded_k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return padded.view(padded_n // PANEL, PANEL, k).transpose(1, 2).contiguous()


def panel_gemm(x: Tensor, panels: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """x @ weight.T (+ bias) for a decode batch, on weights packed by pack_panels; x (M, K) is taken in
    the weights' type (bfloat16 products are exact in float32, accumulated in float32) and the result
    returned in it."""
    rows, in_features = x.shape
    dtype = panels.dtype
    assert dtype in panel_dtypes() and panels.shape[0] == -(-out_features // PANEL)
    if dtype == torch.bfloat16:
        assert panels.shape[1:] == (-(-in_features // 2), PANEL, 2)
        if in_features % 2:  # the kernel reads x in pairs of k: pad with a zero
            x = torch.nn.functional.pad(x, (0, 1))
    source = x.to(dtype)
    if source.stride(1) != 1:
        source = source.contiguous()
    y = torch.empty(rows, out_features, dtype=dtype)
    (bias_ptr,), _held = _pointers(bias)
    _kernels().tandem_panel_gemm(panels.data_ptr(), dtype == torch.bfloat16, source.data_ptr(), source.stride(0),
                                 bias_ptr, y.data_ptr(), dtype == torch.bfloat16, rows, out_features, in_features,
                                 torch.get_num_threads())
    return y


AMX_K_MULTIPLE = 32  # amx_gemm's K: whole tiles of 32 bfloat16 values


def amx_ready() -> bool:
    """amx_gemm runs here: the library was built for a CPU with AMX, and Linux granted this process the AMX
    state (it asks once)."""
    library = _library()
    return library is not None and bool(library.tandem_amx_ready())


def amx_gemm(x: Tensor, panels: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """panel_gemm for bfloat16 on AMX tiles (same arguments, same result up to summation order); K a
    multiple of AMX_K_MULTIPLE."""
    rows, in_features = x.shape
    assert panels.dtype == torch.bfloat16 and in_features % AMX_K_MULTIPLE == 0 and amx_ready()
    assert panels.shape == (-(-out_features // PANEL), in_features // 2, PANEL, 2)
    source = x.to(torch.bfloat16)
    if source.stride(1) != 1:
        source = source.contiguous()
    y = torch.empty(rows, out_features, dtype=torch.bfloat16)
    (bias_ptr,), _held = _pointers(bias)
    _kernels().tandem_amx_gemm(panels.data_ptr(), source.data_ptr(), source.stride(0), bias_ptr, y.data_ptr(), rows,
                               out_features, in_features, torch.get_num_threads())
    return y


def store_kv_native(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """store_kv_ref as row copies (same arguments, same result): for inputs of the caches' dtype with D
    contiguous everywhere and K and V caches of one layout; the reference for anything else (a cast)."""
    same_type = key.dtype == value.dtype == k_cache.dtype == v_cache.dtype
    rows_contiguous = all(t.stride(-1) == 1 for t in (key, value, k_cache, v_cache))
    if not same_type or not rows_contiguous or k_cache.stride() != v_cache.stride():
        return store_kv_ref(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and k_cache.shape[2:] == (num_kv_heads, head_dim)
    assert slot_mapping.shape == (num_tokens,)
    slots = slot_mapping.to(torch.int64).contiguous()
    _kernels().tandem_store_kv(
        key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(), value.stride(0), value.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1], slots.data_ptr(), num_tokens, num_kv_heads, head_dim, key.element_size(),
        torch.get_num_threads(),
    )


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
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    addressable = (k_cache.dtype in NATIVE_DTYPES and v_cache.dtype == k_cache.dtype
                   and k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1)
    if meta.max_query_len != 1 and k_cache.dtype == v_cache.dtype == torch.bfloat16:
        return paged_attention_bf16_prefill(q, k_cache, v_cache, block_table, meta, scale, out)
    if meta.max_query_len != 1 or not addressable:
        return paged_attention_ref(q, k_cache, v_cache, block_table, meta, scale, out)
    assert num_tokens == meta.num_sequences and num_q_heads % num_kv_heads == 0 and out.shape == q.shape
    table = block_table.to(torch.int32).contiguous()
    seq_lens = meta.seq_lens.to(torch.int32).contiguous()
    result = torch.empty(num_tokens, num_q_heads, head_dim, dtype=torch.float32)
    (q_ptr,), _held = _pointers(q)
    _kernels().tandem_decode_attention(
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.dtype == torch.bfloat16, k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), k_cache.shape[1], table.data_ptr(), table.stride(0),
        seq_lens.data_ptr(), num_tokens, num_q_heads, num_kv_heads, head_dim, q_ptr, q.dtype == torch.bfloat16,
        scale, result.data_ptr(),
        torch.get_num_threads(),
    )
    return out.copy_(result)
