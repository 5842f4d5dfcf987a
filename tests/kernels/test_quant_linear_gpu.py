"""The GPU paths of the quantized linears against their references on random inputs: the Triton kernel
(quant_linear_triton) against quant_linear_ref for every storage format, with and without offsets, edge shapes
included (tiles of 32 x 64 x 32 cut by M, N and K; partial groups); fp8_scaled_mm against fp8_scaled_mm_ref on
torch's CPU _scaled_mm. Under TRITON_INTERPRET=1 on the CPU (tiny shapes); on a GPU with TRITON_INTERPRET=0."""

import pytest
import torch
from test_quant_linear import random_format  # the CPU kernels' inputs: the same formats, the same ranges
from triton_helpers import DEVICE, needs_device

from runtime.kernels.quant_linear import quant_linear_ref
from runtime.kernels.quant_linear_gpu import (fp8_scaled_mm, fp8_scaled_mm_ref, quant_linear_triton,
                                              quantize_rows_fp8, scaled_mm_runs)

pytestmark = needs_device


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("rows, n, k, group_size", [(1, 7, 40, 16), (5, 70, 17, 17), (33, 9, 100, 32)])
@pytest.mark.parametrize("offsets", [False, True])
def test_the_triton_kernel_matches_the_reference(fmt, rows, n, k, group_size, offsets):
    generator = torch.Generator().manual_seed(rows * 1000 + n + k)
    q, scales, shifts = random_format(fmt, n, k, group_size, offsets, generator)
    x, bias = torch.randn(rows, k, generator=generator), torch.randn(n, generator=generator)
    expected = quant_linear_ref(x, q, scales, group_size, bias, shifts)
    on = [t.to(DEVICE) if t is not None else None for t in (x, q, scales, bias, shifts)]
    got = quant_linear_triton(on[0], on[1], on[2], group_size, on[3], on[4])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_every_fp8_byte_converts_as_torch_converts_it():
    """The kernel's bit-built FP8 values: each of the 256 bytes alone in its weight row (NaN rows are NaN)."""
    codes = torch.arange(256, dtype=torch.uint8)
    raw = torch.zeros(256, 16, dtype=torch.uint8)
    raw[torch.arange(256), codes.long() % 16] = codes
    weight = raw.view(torch.float8_e4m3fn)
    x = torch.rand(1, 16) + 0.5
    expected = x[0, codes.long() % 16] * codes.view(torch.float8_e4m3fn).float()
    got = quant_linear_triton(x.to(DEVICE), weight.to(DEVICE), torch.ones(256, 1, device=DEVICE), 16, None)[0]
    torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.skipif(DEVICE != "cpu", reason="torch's CPU _scaled_mm: the launcher's arguments, not the GPU's kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_scaled_mm_matches_its_reference(dtype):
    generator = torch.Generator().manual_seed(11)
    q, scales, _ = random_format("fp8", 32, 48, 48, False, generator)
    x, bias = torch.randn(5, 48, generator=generator).to(dtype), torch.randn(32, generator=generator)
    got = fp8_scaled_mm(x, q, scales, bias)
    expected = fp8_scaled_mm_ref(x, q, scales, bias)
    assert got.dtype == dtype
    rtol = 1e-5 if dtype == torch.float32 else 2.0**-7
    torch.testing.assert_close(got.float(), expected, rtol=rtol, atol=rtol * expected.abs().max().item())
    # The activations' FP8 rounding (3 mantissa bits) is all that separates it from the weight-only reference.
    weight_only = quant_linear_ref(x, q, scales, 48, bias)
    assert (expected - weight_only).abs().max() <= 0.1 * weight_only.abs().max()


def test_rows_quantize_to_fp8_within_their_range():
    x = torch.randn(4, 40) * torch.tensor([1.0, 100.0, 1e-3, 0.0])[:, None]
    xq, scale = quantize_rows_fp8(x)
    assert xq.dtype == torch.float8_e4m3fn and scale.shape == (4, 1) and scale[3] == 1
    assert xq.float().abs().amax(dim=1)[:3].eq(448).all()
    torch.testing.assert_close(xq.float() * scale, x, rtol=2.0**-3, atol=0)


def test_scaled_mm_takes_only_per_channel_fp8_with_bfloat16_activations_on_a_gpu():
    q = torch.randn(32, 48).to(torch.float8_e4m3fn)
    assert not scaled_mm_runs(torch.randn(2, 48, dtype=torch.bfloat16), q, torch.ones(32, 1), None)  # the CPU
    assert not scaled_mm_runs(torch.randn(2, 48), q.view(torch.int8), torch.ones(32, 1), None)
