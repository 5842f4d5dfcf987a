"""The quantized linears: on-the-fly int8/int4 quantization as the scheme states it, and the native kernels
(tandem::int8_gemm, tandem::int4_gemm) against quant_linear_ref on random inputs, edge shapes included."""

import ctypes
import platform
import shutil
import subprocess

import pytest
import torch

from runtime.kernels import cpu_native, native_build
from runtime.kernels.quant_linear import (INT4_GROUP_SIZE, dequantize, pack_int4, quant_linear, quant_linear_ref,
                                          quantize, unpack_int4)

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
    with pytest.raises(RuntimeError, match="tandem::int4_gemm: argument 'group_size' must be a multiple of 16"):
        torch.ops.tandem.int4_gemm(q, torch.ones(2, 2), 8, torch.randn(1, 10), None, torch.empty(1, 2))


@pytest.fixture(scope="module")
def portable_library(tmp_path_factory):
    """quant.c built without -march (no AVX2 on x86-64): its portable C path, loaded with ctypes."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    target = tmp_path_factory.mktemp("portable") / "libquant.so"
    subprocess.run([compiler, "-O2", "-std=c11", "-fPIC", "-shared", "-fopenmp", str(native_build.QUANT_SOURCE),
                    "-o", str(target)], check=True, capture_output=True)
    return ctypes.CDLL(str(target))


@pytest.mark.skipif(platform.machine() != "x86_64", reason="elsewhere the baseline build may vectorise")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("rows, n, k", [(1, 7, 300), (3, 13, 17), (5, 4, 1000)])
def test_the_portable_path_matches_the_reference(portable_library, scheme, rows, n, k):
    weight, x, bias = torch.randn(n, k), torch.randn(rows, k), torch.randn(n)
    qweight, scales, group_size = quantize(weight, scheme)
    y = torch.empty(rows, n)
    pointer = ctypes.c_void_p
    portable_library.tandem_quant_gemm(
        pointer(qweight.data_ptr()), ctypes.c_int(8 if scheme == "int8" else 4), pointer(scales.data_ptr()),
        ctypes.c_int(group_size), pointer(x.data_ptr()), pointer(bias.data_ptr()), pointer(y.data_ptr()),
        ctypes.c_int(rows), ctypes.c_int(n), ctypes.c_int(k), ctypes.c_int(1))
    torch.testing.assert_close(y, quant_linear_ref(x, qweight, scales, group_size, bias), rtol=1e-5,
                               atol=1e-4 * k ** 0.5)


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
