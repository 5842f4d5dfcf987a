"""silu_and_mul: the reference is HF's `act_fn(gate) * up`; the native CPU kernel and the Triton kernel
meet the reference on random inputs, with the gate and up halves as strided views of one projection."""

import pytest
import torch
import torch.nn.functional as F
from triton_helpers import DEVICE, assert_close, needs_device

from runtime.kernels import cpu_native
from runtime.kernels.silu_and_mul import silu_and_mul_ref, silu_and_mul_triton
from runtime.layers.activation import gated


def halves(rows: int, dim: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    """gate and up as the two halves of one (rows, 2 * dim) projection, as a merged gate-up linear gives them."""
    torch.manual_seed(seed)
    projection = (torch.randn(rows, 2 * dim, device=device) * 3).to(dtype)
    return projection.chunk(2, dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_is_hf_act_fn_times_up(dtype):
    from transformers.activations import ACT2FN

    gate, up = halves(5, 40, dtype)
    assert torch.equal(silu_and_mul_ref(gate, up), ACT2FN["silu"](gate) * up)


@pytest.mark.skipif(not cpu_native.available(), reason="the native CPU kernels do not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, dim", [(1, 8), (3, 37), (9, 1100)])  # a vector tail; more than one 512 block
def test_native_matches_the_reference(dtype, rows, dim):
    gate, up = halves(rows, dim, dtype, seed=dim)
    out = cpu_native.silu_and_mul_native(gate, up)
    expected = silu_and_mul_ref(gate, up)
    assert out.dtype == dtype and out.shape == expected.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    else:
        # The exponential is within 2 float32 ulps of libm's: silu's bfloat16 rounding can differ by one
        # bfloat16 ulp where the float32 value sits on a rounding boundary, and the product with it.
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=2 * 2.0**-8)
        assert (out != expected).float().mean() < 0.01


@pytest.mark.skipif(not cpu_native.available(), reason="the native CPU kernels do not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_is_finite_where_the_exponential_overflows(dtype):
    """Gates far below -88 (exp(-x) overflows) and far above: silu is 0 and x there, never NaN."""
    gate = torch.tensor([[-1e4, -500.0, -100.0, -89.0, -88.0, -20.0, 0.0, 20.0, 88.0, 89.0, 100.0, 1e4] * 4]).to(dtype)
    up = torch.ones_like(gate)
    out = cpu_native.silu_and_mul_native(gate, up)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, silu_and_mul_ref(gate, up), atol=1e-30, rtol=1e-6)


def test_native_hands_float16_to_the_reference():
    gate, up = halves(3, 16, torch.float16)
    assert torch.equal(cpu_native.silu_and_mul_native(gate, up), silu_and_mul_ref(gate, up))


@needs_device
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_matches_the_reference(dtype):
    gate, up = halves(3, 1030, dtype, device=DEVICE)  # a masked tail in the second block
    out = silu_and_mul_triton(gate, up)
    assert out.dtype == dtype
    assert_close(out, silu_and_mul_ref(gate, up), dtype)


def test_gated_keeps_other_activations_as_two_ops():
    gate, up = halves(2, 8, torch.float32)
    torch.testing.assert_close(gated("gelu")(gate, up), F.gelu(gate) * up)
    torch.testing.assert_close(gated("silu")(gate[None], up[None]), (F.silu(gate) * up)[None])
