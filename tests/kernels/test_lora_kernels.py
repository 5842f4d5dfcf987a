"""Batched LoRA (runtime/kernels/lora.py): the reference is each row's own (x @ A.T) @ B.T + bias in a loop; the native
CPU kernels and the Triton kernels meet the reference on random pools, with rows of several adapters and of the
base model (the last, zero slot) mixed, ranks that are not powers of two, and y as a strided view."""

import pytest
import torch
from triton_helpers import DEVICE, assert_close, needs_device

from runtime.kernels import cpu_native
from runtime.kernels.lora import (
    ROWS_PER_GATHER,
    lora_expand_ref,
    lora_expand_triton,
    lora_shrink_ref,
    lora_shrink_triton,
)


def pools(slots: int, rank: int, dim: int, out: int, seed: int, device: str = "cpu", dtype=torch.float32):
    """Random A, B (in `dtype`: a bfloat16 model's pools are bfloat16) and a float32 bias for `slots` adapters plus
    the zero slot (last)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(slots + 1, rank, dim, generator=g)
    b = torch.randn(slots + 1, rank, out, generator=g)
    bias = torch.randn(slots + 1, out, generator=g)
    for t in (a, b, bias):
        t[-1] = 0
    return a.to(device, dtype), b.to(device, dtype), bias.to(device)


def rows(count: int, slots: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """Slot per row: each adapter and the zero slot, in a shuffled order."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, slots + 1, (count,), generator=g).to(device)


def loop_oracle(x, a, b, bias, indices, y):
    """y + x @ A.T @ B + bias, one row at a time, in float64 (B stored (rank, out))."""
    out = y.double().clone()
    for t, slot in enumerate(indices.tolist()):
        out[t] += (x[t].double() @ a[slot].double().T) @ b[slot].double() + bias[slot].double()
    return out


# (rows, slots, rank, in, out): one row; decode batches across the reference's row groups; a rank of 1 and of 5.
SHAPES = [(1, 1, 4, 64, 96), (7, 3, 5, 33, 70), (ROWS_PER_GATHER + 3, 4, 16, 80, 130), (40, 2, 1, 16, 8)]
# The native kernels group rows by slot in chunks of 8 and use threads above 128K multiply-adds: a prefill-sized
# call crosses both (about 200 rows per adapter).
NATIVE_SHAPES = SHAPES + [(800, 3, 16, 512, 520)]


@pytest.mark.parametrize("pool", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_is_each_rows_own_adapter(shape, pool):
    n, slots, rank, dim, out = shape
    a, b, bias = pools(slots, rank, dim, out, seed=n, dtype=pool)
    x, y, indices = torch.randn(n, dim), torch.randn(n, out), rows(n, slots, seed=n)
    expected = loop_oracle(x, a, b, bias, indices, y)
    lora_expand_ref(lora_shrink_ref(x, a, indices), b, bias, indices, y)
    torch.testing.assert_close(y.double(), expected, atol=1e-4, rtol=1e-5)


def test_rows_of_the_zero_slot_are_left_exactly_as_they_were():
    a, b, bias = pools(2, 4, 16, 24, seed=1)
    x, y = torch.randn(5, 16), torch.randn(5, 24).bfloat16()
    indices = torch.tensor([2, 0, 2, 1, 2])
    before = y.clone()
    lora_expand_ref(lora_shrink_ref(x, a, indices), b, bias, indices, y)
    assert torch.equal(y[indices == 2], before[indices == 2]) and not torch.equal(y[1], before[1])


native = pytest.mark.skipif(not cpu_native.available(), reason="the native CPU kernels do not build here")


@native
@pytest.mark.parametrize("pool", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", NATIVE_SHAPES)
def test_native_matches_the_reference(shape, dtype, pool):
    n, slots, rank, dim, out = shape
    a, b, bias = pools(slots, rank, dim, out, seed=n + 1, dtype=pool)
    x, indices = torch.randn(n, dim).to(dtype), rows(n, slots, seed=n + 1)
    wide = torch.randn(n, out + 9).to(dtype)  # y as a view with a row stride wider than its width
    y_ref, y_native = wide.clone()[:, 3:3 + out], wide.clone()[:, 3:3 + out]
    s_ref, s_native = lora_shrink_ref(x, a, indices), cpu_native.lora_shrink_native(x, a, indices)
    torch.testing.assert_close(s_native, s_ref, atol=1e-4, rtol=1e-5)
    lora_expand_ref(s_ref, b, bias, indices, y_ref)
    cpu_native.lora_expand_native(s_ref, b, bias, indices, y_native)
    if dtype == torch.float32:
        torch.testing.assert_close(y_native, y_ref, atol=1e-4, rtol=1e-5)
    else:  # one bfloat16 ulp where the float32 sum sits on a rounding boundary
        torch.testing.assert_close(y_native, y_ref, atol=1e-2, rtol=2.0**-7)
    base = indices == slots
    assert torch.equal(y_native[base], wide[:, 3:3 + out][base])


@native
def test_native_refuses_a_slot_outside_the_pool():
    a, _, _ = pools(1, 2, 8, 8, seed=0)
    with pytest.raises(RuntimeError, match="tandem::lora_shrink: argument 'indices' holds 5"):
        cpu_native.lora_shrink_native(torch.randn(1, 8), a, torch.tensor([5]))


@needs_device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES[:2] + [(5, 2, 16, 80, 130)])
def test_triton_matches_the_reference(shape, dtype):
    n, slots, rank, dim, out = shape
    a, b, bias = pools(slots, rank, dim, out, seed=n + 2, device=DEVICE)
    x, indices = torch.randn(n, dim, device=DEVICE).to(dtype), rows(n, slots, seed=n + 2, device=DEVICE)
    s = lora_shrink_ref(x, a, indices)
    assert_close(lora_shrink_triton(x, a, indices), s, torch.float32)
    y_ref, y_triton = (torch.randn(n, out, device=DEVICE).to(dtype) for _ in range(2))
    y_triton.copy_(y_ref)
    lora_expand_ref(s, b, bias, indices, y_ref)
    lora_expand_triton(s, b, bias, indices, y_triton)
    assert_close(y_triton, y_ref, dtype)


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_rows_do_not_depend_on_their_neighbours(dtype):
    # Rows of one slot are computed in blocks of 8, 4, 2 or 1 (and bfloat16 ones with another instruction where the
    # CPU has AVX512-BF16): a request's output must be the same alone as beside others, bit for bit.
    a, b, bias = pools(2, 16, 200, 96, seed=3, dtype=dtype if dtype == torch.bfloat16 else torch.float32)
    x = torch.randn(11, 200).to(dtype)
    indices = torch.tensor([0] * 9 + [1, 0])
    s_all = cpu_native.lora_shrink_native(x, a, indices)
    y_all = torch.zeros(11, 96, dtype=dtype)
    cpu_native.lora_expand_native(s_all, b, bias, indices, y_all)
    for t in range(11):
        s_one = cpu_native.lora_shrink_native(x[t:t + 1], a, indices[t:t + 1])
        y_one = torch.zeros(1, 96, dtype=dtype)
        cpu_native.lora_expand_native(s_one, b, bias, indices[t:t + 1], y_one)
        assert torch.equal(s_one[0], s_all[t]) and torch.equal(y_one[0], y_all[t]), t
