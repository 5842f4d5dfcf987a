"""The quantized linears: on-the-fly int8/int4 quantization as the scheme states it, and the native kernels
(tandem::quant_gemm, tandem::quant_dequantize, the prefill's panels) against quant_linear_ref on random inputs, every
storage format (int8, int4, FP8 e4m3, with and without offsets), edge shapes included."""

import ctypes
import math

import pytest
import torch
from c_builds import build_with_flags, pointer

from runtime.kernels import cpu_native, native_build, quant_linear as quant_module
from runtime.kernels.quant_linear import (INT4_GROUP_SIZE, NATIVE_MAX_ROWS, dequantize, native_runs, pack_int4,
                                          quant_linear, quant_linear_ref, quantize, unpack_int4)

native = pytest.mark.skipif(not cpu_native.available(), reason="the native CPU kernels do not build here")


def test_int8_is_symmetric_per_output_feature():
    weight = torch.randn(5, 37)
    q, scales, group_size = quantize(weight, "int8")
    assert q.dtype == torch.int8 and scales.shape == (5, 1) and group_size == 37
    expected_scales = weight.abs().amax(dim=1, keepdim=True) / 127
    torch.testing.assert_close(scales, expected_scales, rtol=0, atol=0)
    assert torch.equal(q, torch.round(weight / expected_scales).to(torch.int8))
    assert q.abs().max() == 127
    assert (dequantize(q, scales, group_size, 37) - weight).abs().max() <= scales.max() / 2 + 1e-7


def test_int4_groups_of_128_with_a_partial_last_group():
    weight = torch.randn(3, 2 * INT4_GROUP_SIZE + 5)  # two whole groups and one of 5 values
    packed, scales, group_size = quantize(weight, "int4")
    assert packed.dtype == torch.uint8 and packed.shape == (3, -(-weight.shape[1] // 16) * 8)
    assert scales.shape == (3, 3) and group_size == INT4_GROUP_SIZE
    last = weight[:, 2 * INT4_GROUP_SIZE:]
    torch.testing.assert_close(scales[:, 2], last.abs().amax(dim=1) / 7, rtol=0, atol=0)
    q = unpack_int4(packed, weight.shape[1])
    assert q.abs().max() == 7
    assert torch.equal(q[:, 2 * INT4_GROUP_SIZE:], torch.round(last / scales[:, 2:]).to(torch.int8))


@pytest.mark.parametrize("width", [1, 9, 16, 37])
def test_int4_packing_round_trips(width):
    q = torch.randint(-7, 8, (4, width), dtype=torch.int8)
    assert torch.equal(unpack_int4(pack_int4(q), width), q)


def test_int4_blocks_hold_values_j_and_j_plus_8_in_one_byte():
    q = torch.arange(-8, 8, dtype=torch.int8)[None]
    packed = pack_int4(q)
    assert packed.tolist() == [[j | ((j + 8) << 4) for j in range(8)]]


def test_an_all_zero_row_quantizes_to_zeros():
    weight = torch.randn(2, 256)
    weight[1] = 0
    for scheme in ("int8", "int4"):
        q, scales, group_size = quantize(weight, scheme)
        assert torch.equal(dequantize(q, scales, group_size, 256)[1], torch.zeros(256)), scheme


# (rows of x, N, K): K not a multiple of the 16-value step, partial int4 groups, N not a multiple of the
# 4-feature block, 1 to 8 rows and past the 4-row pass.
SHAPES = [(m, n, k) for m in (1, 2, 3, 4, 5, 8) for n, k in ((7, 300), (32, 128), (13, 17), (4, 1000))] + [
    (16, 9, 257), (2, 1, 1), (1, 64, 2048)]


@native
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("rows, n, k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_the_native_kernel_matches_the_reference(scheme, rows, n, k, bias):
    generator = torch.Generator().manual_seed(rows * 1000 + n * 10 + k)
    weight = torch.randn(n, k, generator=generator)
    x = torch.randn(rows, k, generator=generator)
    b = torch.randn(n, generator=generator) if bias else None
    qweight, scales, group_size = quantize(weight, scheme)
    expected = quant_linear_ref(x, qweight, scales, group_size, b)
    got = cpu_native.quant_gemm(x, qweight, scales, group_size, b)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4 * k ** 0.5)


@native
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_group_size_that_is_not_the_scheme_default(scheme):
    """The kernel takes other group sizes (multiples of 16 for int4): int8 in groups of 37, int4 in groups of 48,
    over K = 100."""
    x = torch.randn(3, 100)
    group_size = 37 if scheme == "int8" else 48
    groups = -(-100 // group_size)
    scales = torch.rand(6, groups) + 0.1
    q = torch.randint(-7, 8, (6, 100), dtype=torch.int8)
    qweight = q if scheme == "int8" else pack_int4(q)
    torch.testing.assert_close(cpu_native.quant_gemm(x, qweight, scales, group_size, None),
                               quant_linear_ref(x, qweight, scales, group_size, None), rtol=1e-5, atol=1e-4)


@native
def test_bfloat16_inputs_run_in_float32():
    weight, x = torch.randn(8, 64), torch.randn(2, 64).to(torch.bfloat16)
    qweight, scales, group_size = quantize(weight.to(torch.bfloat16), "int8")
    got = quant_linear(x, qweight, scales, group_size, None)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, quant_linear_ref(x, qweight, scales, group_size, None), rtol=1e-5, atol=1e-4)


@native
def test_an_int4_group_of_part_of_a_block_is_refused():
    q = pack_int4(torch.zeros(2, 10, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="tandem::quant_gemm: argument 'group_size' must be a multiple of 16"):
        torch.ops.tandem.quant_gemm(q, torch.ones(2, 2), None, 8, torch.randn(1, 10), None, torch.empty(1, 2))


FORMATS = ("int8", "int4", "fp8")


def random_format(fmt: str, n: int, k: int, group_size: int, offsets: bool, generator: torch.Generator):
    """(qweight, scales, offsets) of random values over the whole range of the format: int8 any byte, int4 any
    nibble, FP8 any byte but NaN (normal and subnormal values, both zeros); scales positive, offsets any sign."""
    groups = -(-k // group_size)
    if fmt == "int8":
        q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)
    elif fmt == "int4":
        q = pack_int4(torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=generator))
    else:
        raw = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=generator)
        raw[(raw & 0x7F) == 0x7F] -= 1
        q = raw.view(torch.float8_e4m3fn)
    scales = torch.rand(n, groups, generator=generator) + 0.05
    return q, scales, torch.randn(n, groups, generator=generator) if offsets else None


# (rows of x, N, K, group size): group sizes 16, 32, 128 and K; K not a multiple of the 16-value step (partial
# last groups and blocks), N not a multiple of the 4-feature block, 1 to 16 rows (the 4-row passes and past).
FORMAT_SHAPES = [(m, n, k, g) for m in (1, 2, 3, 5, 16) for n, k, g in (
    (7, 300, 16), (13, 200, 32), (5, 1000, 128), (9, 97, 97), (4, 48, 16), (3, 17, 32))]


@native
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows, n, k, group_size", FORMAT_SHAPES)
@pytest.mark.parametrize("offsets", [False, True])
def test_every_format_matches_the_reference(fmt, rows, n, k, group_size, offsets):
    generator = torch.Generator().manual_seed(rows * 10000 + n * 100 + k + group_size)
    q, scales, shifts = random_format(fmt, n, k, group_size, offsets, generator)
    x, bias = torch.randn(rows, k, generator=generator), torch.randn(n, generator=generator)
    expected = quant_linear_ref(x, q, scales, group_size, bias, shifts)
    got = cpu_native.quant_gemm(x, q, scales, group_size, bias, shifts)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@native
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n, k, group_size", [(7, 300, 16), (5, 1000, 128), (9, 97, 97), (3, 17, 32)])
@pytest.mark.parametrize("offsets", [False, True])
def test_dequantize_gives_the_references_weight_exactly(fmt, n, k, group_size, offsets):
    generator = torch.Generator().manual_seed(n * 100 + k)
    q, scales, shifts = random_format(fmt, n, k, group_size, offsets, generator)
    got = cpu_native.quant_dequantize(q, scales, group_size, shifts, torch.empty(n, k))
    assert torch.equal(got, dequantize(q, scales, group_size, k, shifts))


@native
@pytest.mark.parametrize("lane", ["vector", "scalar"])
def test_every_fp8_byte_converts_as_torch_converts_it(lane):
    """All 256 e4m3fn bytes (zeros, subnormals, normals up to 448, NaN at 0x7f and 0xff), one per weight row
    among zeros, at every place of a block of 16 (the vector path) or as the 17th value of a row (the scalar
    one): each output is x's value there times the byte's value, NaN for NaN."""
    codes = torch.arange(256, dtype=torch.uint8)
    places = codes.long() % 16 if lane == "vector" else torch.full((256,), 16)
    raw = torch.zeros(256, 17, dtype=torch.uint8)
    raw[torch.arange(256), places] = codes
    weight = raw.view(torch.float8_e4m3fn)
    x = torch.rand(1, 17) + 0.5
    expected = x[0, places] * codes.view(torch.float8_e4m3fn).float()
    got = cpu_native.quant_gemm(x, weight, torch.ones(256, 1), 17, None)[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    assert got.isnan().sum() == 2
    dequantized = cpu_native.quant_dequantize(weight, torch.ones(256, 1), 17, None, torch.empty(256, 17))
    torch.testing.assert_close(dequantized, weight.float(), rtol=0, atol=0, equal_nan=True)


@native
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [17, 40])
@pytest.mark.parametrize("offsets", [False, True])
def test_a_prefill_runs_panel_by_panel(fmt, rows, offsets, monkeypatch):
    """Past native_max_rows() rows the launcher dequantizes panels of 16 features here (the last one partial) and
    multiplies each into its columns of the result (here past NATIVE_MAX_ROWS, with AVX2 only too, where
    quant_gemm takes every batch unless told otherwise)."""
    monkeypatch.setattr(quant_module, "PANEL_BYTES", 16 * 4 * 300)
    monkeypatch.setattr(quant_module, "native_max_rows", lambda: NATIVE_MAX_ROWS)
    assert quant_module.panel_rows(300) == 16
    generator = torch.Generator().manual_seed(rows)
    q, scales, shifts = random_format(fmt, 37, 300, 32, offsets, generator)
    x, bias = torch.randn(1, rows, 300, generator=generator), torch.randn(37, generator=generator)
    got = quant_linear(x, q, scales, 32, bias, shifts)
    expected = quant_linear_ref(x[0], q, scales, 32, bias, shifts)[None]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@native
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("offsets", [False, True])
def test_a_long_bfloat16_prefill_runs_on_the_weight_dequantized_to_bfloat16(fmt, offsets, monkeypatch):
    """From BFLOAT16_GEMM_MIN_ROWS rows a bfloat16 x meets the reference's weight rounded to bfloat16 (what
    transformers runs on the same weights), dequantized panel by panel (here of 16 features, the last partial),
    where the CPU multiplies bfloat16 (AVX-512 BF16); elsewhere oneDNN would emulate it and the batch stays on the
    float32 panels (exact weights)."""
    monkeypatch.setattr(quant_module, "PANEL_BYTES", 16 * 4 * 300)
    generator = torch.Generator().manual_seed(11)
    q, scales, shifts = random_format(fmt, 37, 300, 32, offsets, generator)
    rows = quant_module.BFLOAT16_GEMM_MIN_ROWS
    x, bias = torch.randn(rows, 300, generator=generator).to(torch.bfloat16), torch.randn(37, generator=generator)
    weight = quant_module.dequantize(q, scales, 32, 300, shifts)
    assert torch.equal(quant_module.dequantized_bfloat16(q, scales, 32, shifts, 300), weight.to(torch.bfloat16))
    got = quant_linear(x, q, scales, 32, bias, shifts)
    if not quant_module.bfloat16_native():  # float32 sums of the exact weights: quant_gemm's with AVX2 only
        exact = (cpu_native.quant_gemm(x, q, scales, 32, bias, shifts) if cpu_native.quant_expands()
                 else quant_module.quant_linear_panels(x, q, scales, 32, bias, shifts))
        assert torch.equal(got, exact)
    assert got.dtype == (torch.bfloat16 if quant_module.bfloat16_native() else torch.float32)
    expected = torch.nn.functional.linear(x, weight.to(torch.bfloat16), bias.to(torch.bfloat16))
    torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-2 * expected.abs().max().item())
    reference = quant_linear_ref(x, q, scales, 32, bias, shifts)  # float32 weights: bfloat16's rounding apart
    torch.testing.assert_close(got.float(), reference, rtol=3e-2, atol=3e-2 * reference.abs().max().item())
    # Fewer rows: the float32 sums, except where the CPU multiplies bfloat16 without AMX, where this GEMM takes
    # batches from CONVERTED_MAX_ROWS that converted rows do not (K = 300 is not whole steps of 32).
    fewer = quant_linear(x[:rows - 1], q, scales, 32, bias, shifts)
    bfloat16_earlier = quant_module.bfloat16_native() and not cpu_native.amx_ready()
    assert fewer.dtype == (torch.bfloat16 if bfloat16_earlier else torch.float32)
    assert quant_linear(x[:quant_module.CONVERTED_MAX_ROWS - 1], q, scales, 32, bias, shifts).dtype == torch.float32


@native
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_launcher_takes_the_native_kernel_for_every_format(fmt):
    """Bit for bit the native kernel's result (its summation order differs from the reference's)."""
    q, scales, shifts = random_format(fmt, 12, 300, 32, True, torch.Generator().manual_seed(3))
    assert native_runs(q, shifts, 32)
    x = torch.randn(3, 300)
    got = quant_linear(x, q, scales, 32, None, shifts)
    assert torch.equal(got, cpu_native.quant_gemm(x, q, scales, 32, None, shifts))
    assert not torch.equal(got, quant_linear_ref(x, q, scales, 32, None, shifts))


avx2_only = pytest.mark.skipif(not cpu_native.quant_expands(),
                               reason="expanded panels and native prefills: a CPU with AVX2 but not AVX-512")


@avx2_only
@pytest.mark.parametrize("fmt", FORMATS)
# Rows of x: from where int4 and FP8 expand (17: tiles of 6 rows with 5 left), 1 left, from where int8 expands
# (24, none left), a prefill of two chunks of 512 rows (2 left in each) and one of 6.
@pytest.mark.parametrize("rows", [17, 19, 24, 1030])
# N past one block of expanded rows (32 features at K = 1000, 96 at K = 300) with part of a panel of 16 features
# left; K past a chunk of 512 values, and not a multiple of 8 (a scalar tail); partial groups.
@pytest.mark.parametrize("n, k, group_size", [(37, 1000, 128), (113, 300, 32), (6, 97, 97), (34, 1000, 48),
                                              (35, 1004, 1004)])
@pytest.mark.parametrize("offsets", [False, True])
def test_avx2_batches_match_the_reference(fmt, rows, n, k, group_size, offsets):
    """With AVX2 only the launcher takes every batch to quant_gemm, which from 17 rows (int8's from 24) expands a
    block of weight rows to float32 once (q * scale + offset, exactly the reference's values) and runs every row of
    x against it, a prefill's rows 512 at a time."""
    generator = torch.Generator().manual_seed(rows * 1000 + n + k)
    q, scales, shifts = random_format(fmt, n, k, group_size, offsets, generator)
    x, bias = torch.randn(rows, k, generator=generator), torch.randn(n, generator=generator)
    expected = quant_linear_ref(x, q, scales, group_size, bias, shifts)
    got = cpu_native.quant_gemm(x, q, scales, group_size, bias, shifts)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    assert torch.equal(quant_linear(x, q, scales, group_size, bias, shifts), got)
    # A bfloat16 model's linear: the same float32 sums, rounded once (to within one bfloat16 step of the reference's)
    bf16 = cpu_native.quant_gemm(x.to(torch.bfloat16), q, scales, group_size, bias, shifts, torch.bfloat16)
    wide = quant_linear_ref(x.to(torch.bfloat16).float(), q, scales, group_size, bias, shifts)
    torch.testing.assert_close(bf16.float(), wide, rtol=2 ** -7, atol=1e-5 * wide.abs().max().item())


@avx2_only
def test_with_avx2_only_every_batch_runs_on_quant_gemm():
    q, scales, _ = random_format("int4", 20, 64, 64, False, torch.Generator().manual_seed(5))
    x = torch.randn(4096, 64)
    assert quant_module.native_max_rows() >= len(x)
    assert torch.equal(quant_linear(x, q, scales, 64, None), cpu_native.quant_gemm(x, q, scales, 64, None))


def test_native_runs_refuses_int4_groups_of_part_of_a_block():
    q = pack_int4(torch.zeros(2, 40, dtype=torch.int8))
    assert not native_runs(q, None, 24) and native_runs(q, None, 32) and native_runs(q, None, 40, 40)
    assert not native_runs(torch.zeros(2, 8, dtype=torch.int16), None)


# The builds of quant.c besides the native one: no -march (x86-64's baseline, no AVX2: the portable C path),
# AVX2 (-march=haswell: the path of a CPU without AVX-512) and AVX-512 (-march=skylake-avx512, no AVX-512 BF16 or
# VNNI), each run where this CPU has what it needs, so that a CPU with AVX-512 checks the AVX2 path too.
BUILDS = {"portable": ([], set()), "avx2": (["-march=haswell"], {"avx2", "fma", "f16c"}),
          "avx512": (["-march=skylake-avx512"], {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"})}


@pytest.fixture(scope="module", params=list(BUILDS))
def built_library(request, tmp_path_factory):
    """quant.c built with one of BUILDS' flags, loaded with ctypes."""
    flags, needs = BUILDS[request.param]
    return build_with_flags(native_build.QUANT_SOURCE, flags, needs,
                            tmp_path_factory.mktemp(request.param) / "libquant.so")


FORMAT_CODES = {"int8": 8, "int4": 4, "fp8": 1}  # csrc/tandem_cpu.h's TANDEM_QUANT_*


@pytest.mark.parametrize("fmt", FORMATS)
# One row with K of whole steps of 32: int4's steps of two blocks without AVX-512 (quant_int4_row), across groups
# of 32, 96 and 128 (a partial last group of 64); 17 and 24 rows over more than one block of expanded weights, and a
# prefill of two chunks of rows (AVX2).
@pytest.mark.parametrize("rows, n, k, group_size", [(1, 7, 300, 16), (3, 13, 17, 17), (5, 4, 1000, 128),
                                                     (2, 9, 95, 32), (1, 11, 200, 64), (4, 3, 80, 80),
                                                     (1, 9, 256, 32), (1, 5, 320, 128), (1, 7, 192, 96),
                                                     (17, 37, 1000, 128), (17, 113, 300, 32), (24, 37, 1000, 128),
                                                     (530, 20, 300, 32)])
@pytest.mark.parametrize("offsets", [False, True])
def test_each_build_matches_the_reference(built_library, fmt, rows, n, k, group_size, offsets):
    generator = torch.Generator().manual_seed(rows + n + k)
    q, scales, shifts = random_format(fmt, n, k, group_size, offsets, generator)
    x, bias = torch.randn(rows, k, generator=generator), torch.randn(n, generator=generator)
    y = torch.empty(rows, n)
    built_library.tandem_quant_gemm(
        pointer(q), ctypes.c_int(FORMAT_CODES[fmt]), pointer(scales), pointer(shifts), ctypes.c_int(group_size),
        pointer(x), pointer(bias), pointer(y), ctypes.c_int(rows), ctypes.c_int(n), ctypes.c_int(k), ctypes.c_int(1))
    expected = quant_linear_ref(x, q, scales, group_size, bias, shifts)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    weight = torch.empty(n, k)
    built_library.tandem_quant_dequantize(
        pointer(q), ctypes.c_int(FORMAT_CODES[fmt]), pointer(scales), pointer(shifts), ctypes.c_int(group_size),
        pointer(weight), ctypes.c_int(n), ctypes.c_int(k), ctypes.c_int(1))
    assert torch.equal(weight, dequantize(q, scales, group_size, k, shifts))


# int4 under AVX-512 takes two blocks (32 values) a step where groups start at multiples of 32, then a block, then
# single values: K of 32, one step and a block (48, 80), one step and a partial block (33, 47, 95), steps past a
# group's end (group 96 over K = 200: 96 + 96 + 8), groups of 48 (one block at a time) and of K; N odd.
INT4_STEPS = [(n, k, g) for n, k, g in ((9, 32, 32), (9, 48, 48), (11, 80, 32), (3, 33, 33), (5, 47, 32),
                                        (7, 95, 64), (13, 200, 96), (5, 1000, 48), (1, 2048, 2048))]


@native
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16])
@pytest.mark.parametrize("n, k, group_size", INT4_STEPS + [(5, 128, 64), (7, 200, 128), (3, 64, 64), (9, 127, 127),
                                                    (9, 256, 128), (5, 384, 256), (3, 128, 128), (4, 640, 640),
                                                    (5, 256, 32), (6, 384, 64), (3, 128, 32)])
@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_int4_steps_of_two_and_four_blocks_match_the_reference(rows, n, k, group_size, offsets, x_dtype):
    """Also with x of bfloat16 values (a bfloat16 model's activations, which the launcher hands over as float32):
    where the CPU has AVX-512 BF16, int4 groups of multiples of 64 then run four blocks a step in bfloat16, and one
    row of x with K a multiple of 128 eight blocks a step, groups of multiples of 128 (256 / 128, 384 / 256 with a
    last group of one step, 128 / 128, one group of 640) or of 32 and 64 (GGUF's) scaled lane by lane."""
    generator = torch.Generator().manual_seed(rows * 7 + n * 100 + k)
    q, scales, shifts = random_format("int4", n, k, group_size, offsets, generator)
    x = torch.randn(rows, k, generator=generator).to(x_dtype).float()
    bias = torch.randn(n, generator=generator)
    expected = quant_linear_ref(x, q, scales, group_size, bias, shifts)
    got = cpu_native.quant_gemm(x, q, scales, group_size, bias, shifts)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


# Batches of a bfloat16 model's rows on converted rows (csrc/quant.c's quant_converts, where the CPU has AVX-512
# BF16): int8 from 4 rows, int4 past 16; int4 in quant_pack_bf16's order for groups of multiples of 64, in k's
# order for groups of 32 (and K's last 32 values where K is not a multiple of 64); blocks of 4 rows of x and a
# remainder, tiles of 4 features and a remainder, N past one block of 8; offsets (GGUF's Q4_K) and a bias. int4
# as panels (quant_panels) from 48 rows, or with K up to 1536: blocks of 12 rows of x and a remainder, partial
# panels of 32 features; in tiles below 48 rows with K past 1536.
CONVERTED_SHAPES = [(13, 96, 32), (8, 128, 64), (21, 224, 128), (6, 160, 160), (9, 192, 64), (19, 64, 64),
                    (10, 1664, 128)]


@native
@pytest.mark.parametrize("fmt, rows", [("int8", 4), ("int8", 7), ("int8", 33), ("int4", 17), ("int4", 38),
                                       ("int4", 48), ("int4", 75)])
@pytest.mark.parametrize("n, k, group_size", CONVERTED_SHAPES)
@pytest.mark.parametrize("offsets", [False, True])
def test_batches_of_bfloat16_rows_on_converted_weights_match_the_reference(fmt, rows, n, k, group_size, offsets):
    generator = torch.Generator().manual_seed(rows * 11 + n * 100 + k + group_size)
    q, scales, shifts = random_format(fmt, n, k, group_size, offsets, generator)
    x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
    bias = torch.randn(n, generator=generator)
    expected = quant_linear_ref(x, q, scales, group_size, bias, shifts)
    got = cpu_native.quant_gemm(x.float(), q, scales, group_size, bias, shifts)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    # The launcher's batches short of a long prefill take the same kernel where it converts (no AMX here).
    if quant_module.converts(x, q, group_size):
        assert torch.equal(quant_linear(x, q, scales, group_size, bias, shifts), got)


@native
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows, n, k, group_size", [(1, 24, 256, 128), (1, 9, 256, 32), (3, 13, 300, 16),
                                                     (17, 21, 224, 32), (40, 8, 128, 64), (70, 40, 256, 128)])
@pytest.mark.parametrize("offsets", [False, True])
def test_a_bfloat16_linear_gets_the_float32_result_rounded_by_the_kernel(fmt, rows, n, k, group_size, offsets):
    """A bfloat16 model's linear hands x over as it is and takes y in bfloat16 (no conversions around the kernel):
    exactly the float32 result of the same x, rounded to nearest even as torch rounds it; a NaN stays a NaN."""
    generator = torch.Generator().manual_seed(rows * 13 + n + k + group_size)
    q, scales, shifts = random_format(fmt, n, k, group_size, offsets, generator)
    x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
    bias = torch.randn(n, generator=generator)
    x[0, 5] = float("nan")  # row 0's outputs all NaN
    got = cpu_native.quant_gemm(x, q, scales, group_size, bias, shifts, out_dtype=torch.bfloat16)
    expected = cpu_native.quant_gemm(x.float(), q, scales, group_size, bias, shifts).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.isnan(), expected.isnan()) and got[0].isnan().all()
    assert torch.equal(got.nan_to_num(), expected.nan_to_num())
    # A float32 caller keeps the float32 result; the launcher passes the model's dtype through where it takes
    # this kernel (a decode's rows).
    assert cpu_native.quant_gemm(x, q, scales, group_size, bias, shifts).dtype == torch.float32
    if rows - 1 <= quant_module.native_max_rows() and quant_module.native_runs(q, shifts, group_size, k):
        launched = quant_linear(x[1:], q, scales, group_size, bias, shifts, torch.bfloat16)
        assert launched.dtype == torch.bfloat16 and torch.equal(launched, expected[1:])


@native
@pytest.mark.parametrize("fmt, rows", [("int8", 1), ("int8", 8), ("int4", 20), ("int4", 70)])
def test_bfloat16_outputs_round_denormals_and_ties_as_torch(fmt, rows):
    """The kernel's bfloat16 stores (16 lanes at a time where it can) round as torch rounds, denormal results
    included (vcvtneps2bf16 would flush them to zero): y against the float32 y rounded by torch, with the scales a
    power of two that puts the largest output just under float32's smallest normal."""
    generator = torch.Generator().manual_seed(rows)
    n, k, group_size = 40, 128, 128 if fmt == "int8" else 64
    q, scales, _ = random_format(fmt, n, k, group_size, False, generator)
    x = torch.randint(-4, 5, (rows, k), generator=generator).to(torch.bfloat16)
    dots = cpu_native.quant_gemm(x.float(), q, torch.ones_like(scales), group_size, None, None)
    scales = torch.full_like(scales, 2.0 ** (-127 - math.ceil(math.log2(dots.abs().max().item()))))
    got = cpu_native.quant_gemm(x, q, scales, group_size, None, None, out_dtype=torch.bfloat16)
    wide = cpu_native.quant_gemm(x.float(), q, scales, group_size, None, None)
    assert (wide.abs() < torch.finfo(torch.float32).tiny).all() and (got != 0).sum() > wide.numel() // 2
    assert torch.equal(got.view(torch.int16), wide.to(torch.bfloat16).view(torch.int16))


@native
def test_the_kernel_refuses_a_y_of_another_type_than_x():
    q, scales, _ = random_format("int8", 4, 32, 32, False, torch.Generator().manual_seed(0))
    x, y = torch.randn(2, 32).to(torch.bfloat16), torch.empty(2, 4)
    with pytest.raises(RuntimeError, match="quant_gemm.*y.*BFloat16"):
        torch.ops.tandem.quant_gemm(q, scales, None, 32, x, None, y)


def test_offsets_and_fp8_dequantize_group_by_group():
    generator = torch.Generator().manual_seed(7)
    q = torch.randint(-8, 8, (3, 40), dtype=torch.int8, generator=generator)
    scales, offsets = torch.rand(3, 3, generator=generator), torch.randn(3, 3, generator=generator)
    weight = dequantize(pack_int4(q), scales, 16, 40, offsets)
    for group in range(3):
        columns = slice(16 * group, min(16 * group + 16, 40))
        expected = q[:, columns].float() * scales[:, group:group + 1] + offsets[:, group:group + 1]
        assert torch.equal(weight[:, columns], expected)
    fp8 = torch.randn(3, 40, generator=generator).to(torch.float8_e4m3fn)
    torch.testing.assert_close(dequantize(fp8, scales, 16, 40), fp8.float() * scales.repeat_interleave(16, 1)[:, :40])
    x = torch.randn(2, 40, generator=generator)
    torch.testing.assert_close(quant_linear(x, fp8, scales, 16, None), x @ dequantize(fp8, scales, 16, 40).T)


@native
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_moe_experts_run_the_native_kernels(scheme):
    """QuantStackedLinear's experts, each on its own slice of the stacked weights: a decode's few tokens in
    registers (bit for bit quant_gemm's result), a prefill's many by panels, both the reference's values."""
    from runtime.layers.moe import StackedLinear
    from runtime.layers.quantized import QuantStackedLinear

    stacked = StackedLinear(3, 160, 48)
    torch.nn.init.normal_(stacked.weight, generator=torch.Generator().manual_seed(5))
    experts = QuantStackedLinear(stacked, scheme)
    for expert in range(3):
        q, scales = experts.qweight[expert], experts.scales[expert]
        assert q.is_contiguous() and native_runs(q, None, experts.group_size, 160)
        for rows in (3, 40):
            x = torch.randn(rows, 160)
            got = experts(expert, x)
            torch.testing.assert_close(got, quant_linear_ref(x, q, scales, experts.group_size, None),
                                       rtol=1e-5, atol=1e-5 * got.abs().max().item())
            if rows <= quant_module.native_max_rows():
                assert torch.equal(got, cpu_native.quant_gemm(x, q, scales, experts.group_size, None))


amx = pytest.mark.skipif(not cpu_native.amx_ready(), reason="no AMX tiles here (or Linux refused their state)")


@amx
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("rows, out_features, in_features, bias",
                         [(17, 40, 64, True), (32, 96, 128, False), (45, 70, 384, True), (100, 33, 256, True)])
def test_a_bfloat16_prefill_on_amx_tiles_matches_the_reference(scheme, rows, out_features, in_features, bias):
    # Tiles of 16 and 32 rows, a last partial panel of output features, one group (int8) or several (int4, 128).
    g = torch.Generator().manual_seed(rows + in_features)
    weight = torch.randn(out_features, in_features, generator=g)
    x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
    b = torch.randn(out_features, generator=g) if bias else None
    qweight, scales, group_size = quantize(weight, scheme)
    expected = quant_linear_ref(x, qweight, scales, group_size, b)
    assert quant_module.amx_runs(x, qweight, None, group_size)
    for got in (cpu_native.amx_quant_gemm(x, qweight, scales, group_size, b),
                quant_module.quant_linear(x, qweight, scales, group_size, b)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@amx
def test_amx_quant_gemm_refuses_what_its_tiles_cannot_hold():
    qweight, scales, group_size = quantize(torch.randn(8, 48), "int8")
    with pytest.raises(RuntimeError, match="tandem::amx_quant_gemm: argument 'x' must have a multiple of 32 columns"):
        cpu_native.amx_quant_gemm(torch.randn(20, 48).to(torch.bfloat16), qweight, scales, group_size, None)
    assert not quant_module.amx_runs(torch.randn(20, 48).to(torch.bfloat16), qweight, None, group_size)
    assert not quant_module.amx_runs(torch.randn(20, 48), qweight, None, group_size)  # float32 x: exact float32 path
