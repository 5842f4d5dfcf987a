"""int4 linears on integer activations (csrc/quant_x16.c, tandem::quant_x16_gemm): x quantized in blocks of 32 as
quantize_activations states it, the kernel against quant_linear_x16_ref on random inputs (every group size it takes,
offsets, rows of x in tiles of 4 and a few left over, float32 and bfloat16), each build of the C file, and the
launcher that runs it for a bfloat16 model's int4 decode where the CPU lacks AVX-512 BF16."""

import ctypes

import pytest
import torch
from c_builds import build_with_flags, pointer

from runtime.kernels import cpu_native, native_build, quant_linear as quant_module
from runtime.kernels.quant_linear import (X16_MAX_ROWS, pack_int4, quant_linear, quant_linear_ref,
                                          quant_linear_x16_ref, quantize, quantize_activations)

native = pytest.mark.skipif(not cpu_native.available(), reason="the native CPU kernels do not build here")


def test_activations_are_two_8_bit_integers_a_value_in_blocks_of_32():
    first = torch.zeros(32)
    # d = 1: q rounds to nearest, ties to even; r is the rest in 256ths, to nearest
    first[:6] = torch.tensor([127.0, 0.5, 2.5, -1.5, 63.7, 1 / 512])
    second = torch.linspace(-2, 1, 32)  # d = 2 / 127
    x = torch.stack([torch.cat([first, second]), torch.zeros(64)])
    got = quantize_activations(x)
    # 0.5 is q = 0 (a tie, to even) and r = 128, clamped to 127, and so are 2.5 and -1.5 about 2 and -2; 63.7 is 64
    # less 76.8 / 256; 1 / 512 is r = 0.5, a tie, to 0
    expected = torch.tensor([127.0, 127 / 256, 2 + 127 / 256, -2 + 127 / 256, 64 - 77 / 256, 0.0])
    assert torch.equal(got[0, :6], expected)
    d = torch.tensor(2.0) / 127
    assert (got[0, 32:] - second).abs().max() <= d / 256  # d / 512, or d / 256 where r clamps
    assert torch.equal(got[1], torch.zeros(64))  # an all-zero block is zeros, not 0 / 0


def random_int4(n, k, group_size, offsets, generator):
    """Weights over int4's whole range [-8, 7], positive scales, offsets or none."""
    groups = -(-k // group_size)
    q = pack_int4(torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=generator))
    scales = torch.rand(n, groups, generator=generator) + 0.05
    shifts = torch.randn(n, groups, generator=generator) if offsets else None
    return q, scales, shifts


# (n, k, group_size): groups of 64, 128 (one step and two), of 32 (two to a step, scaled lane by lane), of the whole
# row (group_size past K too), a partial last group (K = 448 in groups of 128); N not a multiple of a tile of 4 or
# of a block of 8 features.
SHAPES = [(7, 64, 64), (13, 320, 32), (9, 256, 128), (11, 192, 64), (5, 512, 512), (33, 256, 32), (9, 448, 128),
          (6, 128, 4096)]
# Rows of x: one (tiles of 4 features), 2 (4), 3 and 4 (tiles of 2), 5 and 13 (passes of 4 and one left), up to
# X16_MAX_ROWS.
ROWS = [1, 2, 3, 4, 5, 13, X16_MAX_ROWS]


@native
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n, k, group_size", SHAPES)
@pytest.mark.parametrize("offsets", [False, True])
def test_the_kernel_matches_its_reference(rows, n, k, group_size, offsets):
    generator = torch.Generator().manual_seed(rows * 1000 + n + k)
    q, scales, shifts = random_int4(n, k, group_size, offsets, generator)
    x, bias = torch.randn(rows, k, generator=generator), torch.randn(n, generator=generator)
    expected = quant_linear_x16_ref(x, q, scales, group_size, bias, shifts)
    got = cpu_native.quant_x16_gemm(x, q, scales, group_size, bias, shifts)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    # a bfloat16 model's linear: x as bfloat16 values, the float32 sums rounded once
    wide = quant_linear_x16_ref(x.to(torch.bfloat16).float(), q, scales, group_size, bias, shifts)
    bf16 = cpu_native.quant_x16_gemm(x.to(torch.bfloat16), q, scales, group_size, bias, shifts, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), wide, rtol=2 ** -7, atol=1e-5 * wide.abs().max().item())


@native
def test_the_rounding_of_x_costs_a_hundredth_of_bfloat16s():
    """What the integer activations cost, on a weight quantized as quantization="int4" quantizes it (groups of 128)
    and x of a normal spread, root mean square over the outputs: 1.2 % of what rounding x to bfloat16 costs, and
    that 1.4 % of int4's own error. (q alone, 8-bit activations as llama.cpp's, cost 3x bfloat16's rounding.)"""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(512, 2048, generator=generator) * 0.05
    x = torch.randn(8, 2048, generator=generator)
    q, scales, group_size = quantize(weight, "int4")
    exact = x.double() @ weight.double().T
    weight_only = quant_linear_ref(x, q, scales, group_size, None).double()
    on_x16 = cpu_native.quant_x16_gemm(x, q, scales, group_size, None).double()
    bfloat16 = quant_linear_ref(x.to(torch.bfloat16).float(), q, scales, group_size, None).double()
    def spread(a, b):
        return (a - b).pow(2).mean().sqrt()
    assert spread(on_x16, weight_only) < 0.03 * spread(bfloat16, weight_only)
    assert spread(bfloat16, weight_only) < 0.03 * spread(weight_only, exact)


@native
def test_a_bfloat16_int4_decode_runs_on_integer_activations():
    """The launcher: a bfloat16 model's int4 linear up to X16_MAX_ROWS rows on quant_x16_gemm where the CPU lacks
    AVX-512 BF16, bit for bit; float32 (the parity tests' dtype), int8, more rows, or a K that is not whole steps of
    64 keep the weight-only kernels."""
    generator = torch.Generator().manual_seed(1)
    q, scales, _ = random_int4(24, 256, 128, False, generator)
    x = torch.randn(X16_MAX_ROWS + 1, 256, generator=generator)
    decode, prefill = x[:X16_MAX_ROWS].to(torch.bfloat16), x.to(torch.bfloat16)
    runs = not quant_module.bfloat16_native()
    assert quant_module.x16_runs(decode, q, 128) == runs
    got = quant_linear(decode, q, scales, 128, None, None, torch.bfloat16)
    if runs:
        assert torch.equal(got, cpu_native.quant_x16_gemm(decode, q, scales, 128, None, None, torch.bfloat16))
    assert not quant_module.x16_runs(prefill, q, 128)
    assert not quant_module.x16_runs(x[:1], q, 128)  # float32
    assert torch.equal(quant_linear(x[:1], q, scales, 128, None), cpu_native.quant_gemm(x[:1], q, scales, 128, None))
    int8, int8_scales, _ = quantize(torch.randn(24, 256, generator=generator), "int8")
    assert not quant_module.x16_runs(decode, int8, 256)
    q96, scales96, _ = random_int4(24, 96, 32, False, generator)
    assert not quant_module.x16_runs(torch.randn(1, 96).to(torch.bfloat16), q96, 32)  # 96 is not whole steps of 64


# quant_x16.c built with no -march (x86-64's baseline: the portable C path) and with AVX2 (-march=haswell: the vector
# path), each where this CPU has what it needs.
BUILDS = {"portable": ([], set()), "avx2": (["-march=haswell"], {"avx2", "fma"})}


@pytest.fixture(scope="module", params=list(BUILDS))
def built_library(request, tmp_path_factory):
    flags, needs = BUILDS[request.param]
    return build_with_flags(native_build.QUANT_X16_SOURCE, flags, needs,
                            tmp_path_factory.mktemp(request.param) / "libquant_x16.so")


@pytest.mark.parametrize("rows", [1, 3, 5])
@pytest.mark.parametrize("n, k, group_size", SHAPES)
@pytest.mark.parametrize("offsets", [False, True])
def test_each_build_matches_the_reference(built_library, rows, n, k, group_size, offsets):
    generator = torch.Generator().manual_seed(rows + n + k)
    q, scales, shifts = random_int4(n, k, group_size, offsets, generator)
    x, bias = torch.randn(rows, k, generator=generator), torch.randn(n, generator=generator)
    assert built_library.tandem_quant_x16_runs(4, group_size, k)
    y = torch.empty(rows, n)
    built_library.tandem_quant_x16_gemm(
        pointer(q), pointer(scales), pointer(shifts), ctypes.c_int(group_size), pointer(x), pointer(bias),
        pointer(y), ctypes.c_int(rows), ctypes.c_int(n), ctypes.c_int(k), ctypes.c_int(1))
    expected = quant_linear_x16_ref(x, q, scales, group_size, bias, shifts)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
