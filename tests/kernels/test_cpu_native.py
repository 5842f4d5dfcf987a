"""The native CPU kernels (the tandem:: operators) against their torch references, on random inputs in strided pool views."""

import os
import subprocess
import sys

import pytest
import torch
from mamba2_oracle import random_ssm_inputs

from runtime.kernels import cpu_native
from runtime.kernels.causal_conv1d import causal_conv1d_fn_ref, causal_conv1d_update_ref
from runtime.kernels.metadata import build_mamba_prefill_metadata
from runtime.kernels.rms_norm_gated import rms_norm_gated_ref
from runtime.kernels.ssd_scan import ssd_scan_ref
from runtime.kernels.ssm_state_update import selective_state_update_ref

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="the native CPU kernels do not build here")

NUM_SLOTS = 7
# The kernel rounds float32 to bfloat16 once, as the reference; sums in another order differ by an ulp.
TOLERANCES = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


def state_views(page_pool, state_dtype, shape, seed):
    """Two pools holding the same random states at a slot stride that is not the state's size."""
    nbytes = state_dtype.itemsize * torch.Size(shape).numel()
    pools = [page_pool(NUM_SLOTS, 2, nbytes + 96, seed=seed) for _ in range(2)]
    views = [pool.view(1, 32, state_dtype, shape) for pool in pools]
    views[0].copy_(torch.randn(views[0].shape) * 0.5)
    views[1].copy_(views[0])
    return pools, views


@pytest.mark.parametrize("dtype, state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("groups, per_channel_d, dt_limit, d_state", [(1, False, (0.0, float("inf")), 40),
                                                                      (2, True, (0.05, 0.8), 64)])
def test_state_update_matches_the_reference(page_pool, dtype, state_dtype, groups, per_channel_d, dt_limit, d_state):
    torch.manual_seed(groups)
    heads, head_dim = 4, 12  # d_state 40: a vector loop's tail; 64: whole vectors only
    pools, (ours, theirs) = state_views(page_pool, state_dtype, (heads, head_dim, d_state), seed=groups)
    slots = torch.tensor([3, -1, 0, 6, 2])
    inputs = random_ssm_inputs(len(slots), heads, head_dim, groups, d_state, dtype)
    if per_channel_d:
        inputs["D"] = torch.randn(heads, head_dim, dtype=dtype)
    # x, dt, B and C as the mixer passes them: slices of one fused row per token, read in place.
    sizes = [heads * head_dim, heads, groups * d_state, groups * d_state]
    fused = torch.cat([inputs[name].reshape(len(slots), -1) for name in ("x", "dt", "B", "C")] +
                      [torch.zeros(len(slots), 3, dtype=dtype)], dim=1)
    x, dt, B, C, _ = fused.split(sizes + [3], dim=1)
    inputs.update(x=x.view(-1, heads, head_dim), dt=dt, B=B.view(-1, groups, d_state), C=C.view(-1, groups, d_state))
    assert inputs["x"].stride(0) == inputs["dt"].stride(0) == sum(sizes) + 3
    pools[0].allow_writes(ours, slots[slots >= 0])
    before = pools[0].snapshot()
    out = torch.full(inputs["x"].shape, float("nan"), dtype=dtype)
    expected = torch.empty(inputs["x"].shape, dtype=dtype)

    result = cpu_native.selective_state_update_native(ours, **inputs, dt_limit=dt_limit, state_indices=slots,
                                                      out=out)
    selective_state_update_ref(theirs, **inputs, dt_limit=dt_limit, state_indices=slots, out=expected)

    assert result is out and out.dtype == dtype
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # padding: zero output
    tolerance = TOLERANCES[torch.bfloat16 if torch.bfloat16 in (dtype, state_dtype) else torch.float32]
    torch.testing.assert_close(out.float(), expected.float(), **tolerance)
    torch.testing.assert_close(ours.float(), theirs.float(), **tolerance)
    pools[0].assert_untouched_outside_allowed(before)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width, dim, bias, activation", [(4, 600, True, "silu"), (3, 40, False, None)])
def test_conv_update_matches_the_reference(page_pool, state_dtype, width, dim, bias, activation):
    torch.manual_seed(width)
    pools, (ours, theirs) = state_views(page_pool, state_dtype, (width - 1, dim), seed=width)
    slots = torch.tensor([5, 1, -1, 4])
    x = torch.randn(len(slots), dim + 9).to(state_dtype)[:, 4 : 4 + dim]  # a slice, as the mixer passes it
    weight, b = torch.randn(dim, width), (torch.randn(dim) if bias else None)
    pools[0].allow_writes(ours, slots[slots >= 0])
    before = pools[0].snapshot()

    out = cpu_native.causal_conv1d_update_native(x, weight, b, ours, slots, activation)
    expected = causal_conv1d_update_ref(x, weight, b, theirs, slots, activation)

    assert out.dtype == x.dtype and torch.equal(out[2], torch.zeros_like(out[2]))
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[state_dtype])
    assert torch.equal(ours, theirs)  # the state only shifts: no arithmetic, so exactly equal
    pools[0].assert_untouched_outside_allowed(before)


def test_a_float16_pool_falls_back_to_the_reference(page_pool):
    torch.manual_seed(0)
    pools, (ours, theirs) = state_views(page_pool, torch.float16, (2, 4, 8), seed=1)
    slots = torch.tensor([1, 4])
    inputs = random_ssm_inputs(2, 2, 4, 1, 8, torch.float16)
    out, expected = torch.empty_like(inputs["x"]), torch.empty_like(inputs["x"])
    cpu_native.selective_state_update_native(ours, **inputs, dt_limit=(0.0, float("inf")), state_indices=slots,
                                             out=out)
    selective_state_update_ref(theirs, **inputs, dt_limit=(0.0, float("inf")), state_indices=slots, out=expected)
    assert torch.equal(out, expected) and torch.equal(ours, theirs)


def test_the_library_builds_into_the_cache_directory_and_can_be_switched_off(tmp_path):
    code = ("from runtime.kernels import cpu_native; import os; print(cpu_native.available()); "
            "os.environ['TANDEM_CPU_NATIVE'] = '0'; print(cpu_native.available())")
    env = {**os.environ, "TANDEM_CACHE_DIR": str(tmp_path)}
    env.pop("TANDEM_CPU_NATIVE", None)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["True", "False"]
    built = sorted((tmp_path / "native").iterdir())
    assert [path.suffix for path in built] == [".json", ".so"]  # the library and the features it was built for
    assert built[1].name.startswith("libtandem_cpu-") and built[0].stem == built[1].stem


@pytest.mark.parametrize("dtype, state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
# The generic loop; register tiles of 8 channels (AVX2; the generic loop under AVX-512); tiles on every ISA.
@pytest.mark.parametrize("head_dim, d_state", [(8, 24), (8, 128), (32, 128)])
def test_scan_matches_the_chunked_reference(page_pool, dtype, state_dtype, head_dim, d_state):
    """Fresh and resumed sequences over several chunks, and a padding slot, against ssd_scan_ref."""
    torch.manual_seed(7)
    heads, groups = 4, 2
    pools, (ours, theirs) = state_views(page_pool, state_dtype, (heads, head_dim, d_state), seed=3)
    # 300: past the native scan's block of tokens (SCAN_TOKENS, 128) twice, and a partial block.
    query_lens, computed = [19, 1, 7, 12, 300], [0, 5, 16, 0, 3]
    slots = torch.tensor([2, 5, -1, 0, 1])
    meta = build_mamba_prefill_metadata(query_lens, computed, chunk_size=8, device="cpu")
    inputs = random_ssm_inputs(sum(query_lens), heads, head_dim, groups, d_state, dtype)
    # A strided view in the model's dtype, as the mixer passes a slice of the conv output.
    x = torch.randn(sum(query_lens), heads * head_dim + 2 * groups * d_state).to(dtype)
    inputs["x"] = x[:, : heads * head_dim].view(-1, heads, head_dim)
    pools[0].allow_writes(ours, slots[slots >= 0])
    before = pools[0].snapshot()
    shape = inputs["x"].shape
    out, expected = torch.full(shape, float("nan"), dtype=dtype), torch.empty(shape, dtype=dtype)

    cpu_native.ssd_scan_native(**inputs, dt_limit=(0.0, float("inf")), ssm_states=ours, state_indices=slots,
                               meta=meta, out=out)
    ssd_scan_ref(**inputs, dt_limit=(0.0, float("inf")), ssm_states=theirs, state_indices=slots, meta=meta,
                 out=expected)

    tolerance = TOLERANCES[state_dtype] if dtype == torch.float32 else dict(atol=6e-2, rtol=3e-2)
    torch.testing.assert_close(out.float(), expected.float(), **tolerance)
    torch.testing.assert_close(ours.float(), theirs.float(), **tolerance)
    pools[0].assert_untouched_outside_allowed(before)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_prefill_conv_matches_the_reference(page_pool, state_dtype):
    """Fresh and resumed sequences, one shorter than the conv's history (its state shifts), and a padding slot;
    one over several of the kernel's blocks of tokens (32), in two passes of channels (256 at a time)."""
    torch.manual_seed(11)
    width, dim = 4, 300
    pools, (ours, theirs) = state_views(page_pool, state_dtype, (width - 1, dim), seed=5)
    query_lens, computed = [9, 2, 5, 1, 70], [0, 7, 0, 3, 4]
    slots = torch.tensor([4, 0, -1, 6, 2])
    meta = build_mamba_prefill_metadata(query_lens, computed, chunk_size=4, device="cpu")
    # A strided view in the model's dtype, as the mixer passes a slice of its input projection.
    x = torch.randn(sum(query_lens), dim + 10).to(state_dtype)[:, 3 : 3 + dim]
    assert x.stride(0) == dim + 10
    weight, bias = torch.randn(dim, width), torch.randn(dim)
    pools[0].allow_writes(ours, slots[slots >= 0])
    before = pools[0].snapshot()

    out = cpu_native.causal_conv1d_fn_native(x, weight, bias, ours, slots, meta)
    expected = causal_conv1d_fn_ref(x, weight, bias, theirs, slots, meta)

    assert out.dtype == x.dtype
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[state_dtype])
    assert torch.equal(ours, theirs)  # states are copied inputs: exactly equal
    pools[0].assert_untouched_outside_allowed(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated, group_size", [(True, 16), (True, 48), (False, 48)])
def test_rms_norm_matches_the_reference(dtype, gated, group_size):
    torch.manual_seed(group_size)
    rows, dim = 9, 48
    wide = torch.randn(rows, 2 * dim + 5, dtype=dtype) * 3
    x, z = wide[:, :dim], (wide[:, dim + 5 :] if gated else None)  # strided rows, as split projections are
    weight = torch.randn(dim, dtype=dtype)

    out = cpu_native.rms_norm_gated_native(x, z, weight, 1e-5, group_size)
    expected = rms_norm_gated_ref(x, z, weight, 1e-5, group_size)

    assert out.dtype == expected.dtype and out.shape == expected.shape
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


def test_rms_norm_of_mixed_dtypes_is_the_reference():
    x, weight = torch.randn(3, 8), torch.randn(8, dtype=torch.bfloat16)
    assert torch.equal(cpu_native.rms_norm_gated_native(x, None, weight, 1e-6, 8),
                       rms_norm_gated_ref(x, None, weight, 1e-6, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, in_features, bias", [(1, 37, True), (2, 24, False), (3, 64, False), (4, 200, True)])
def test_gemv_matches_a_float32_matmul(dtype, rows, in_features, bias):
    """Weights read as stored (bfloat16 widened exactly), rows up to GEMV_MAX_ROWS, K with a vector tail,
    53 output features: every row count's blocks (8, 4, 2 features) end in a partial one."""
    assert_matches_matmul(cpu_native.gemv, dtype, rows, in_features, 53, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, in_features, bias", [(5, 37, True), (8, 64, False), (13, 200, True), (48, 24, False)])
def test_small_gemm_matches_a_float32_matmul(dtype, rows, in_features, bias):
    """Blocks of 8 rows and a partial last one, K with a vector tail, tiles of output features."""
    assert_matches_matmul(cpu_native.small_gemm, dtype, rows, in_features, 1000, bias)


def assert_matches_matmul(kernel, dtype, rows, in_features, out_features, bias):
    torch.manual_seed(rows)
    weight = torch.randn(out_features, in_features).to(dtype)
    x = torch.randn(rows, in_features)
    b = torch.randn(out_features) if bias else None
    expected = x @ weight.float().T + (b if bias else 0)
    torch.testing.assert_close(kernel(x, weight, b), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, in_features, out_features, bias", [
    (1, 37, 53, True),  # odd K (bfloat16 pads a zero pair), a partial last panel of 21 features
    (5, 64, 16, False),  # one panel, half of it past N
    (12, 200, 96, True),  # one full block of rows, whole panels
    (13, 24, 1000, False),  # a block of 12 and one of 1: the second reads the panel again
    (64, 48, 70, True),  # six blocks share the next panel's prefetch
])
def test_panel_gemm_matches_a_float32_matmul(dtype, rows, in_features, out_features, bias):
    """x in the weights' type, rows a stride apart (a slice), against the float32 product of the same values;
    bfloat16 results are that product rounded once."""
    if dtype not in cpu_native.panel_dtypes():
        pytest.skip(f"the panel kernel does not run {dtype} on this CPU (it needs AVX-512, and AVX-512 BF16)")
    torch.manual_seed(rows)
    weight = torch.randn(out_features, in_features).to(dtype)
    x = torch.randn(rows, in_features + 5).to(dtype)[:, 2 : 2 + in_features]
    b = torch.randn(out_features) if bias else None
    expected = x.float() @ weight.float().T + (b if bias else 0)
    out = cpu_native.panel_gemm(x, cpu_native.pack_panels(weight), b, out_features)
    assert out.dtype == dtype and out.shape == (rows, out_features)
    tolerance = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2.0**-8)
    torch.testing.assert_close(out.float(), expected, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features, in_features", [
    (32 * 40, 24),  # whole panels, more than one pass of PANELS_IN_PLACE and a partial one
    (64, 37),  # an odd K: in place for float32; bfloat16 pads a pair member, so a copy
    (70, 16),  # a partial last panel: a copy
])
def test_panels_packed_in_place_equal_the_copy(dtype, out_features, in_features):
    """pack_panels(in_place=True) lays out the same values in the weight's own memory where the layout fits it
    (contiguous, whole panels, an even K for bfloat16), and copies elsewhere, leaving the weight as it was."""
    torch.manual_seed(out_features)
    weight = torch.randn(out_features, in_features).to(dtype)
    original = weight.clone()
    expected = cpu_native.pack_panels(weight)
    packed = cpu_native.pack_panels(weight, in_place=True)
    assert torch.equal(packed, expected) and packed.dtype == dtype
    fits = out_features % cpu_native.PANEL == 0 and not (dtype == torch.bfloat16 and in_features % 2)
    assert (packed.data_ptr() == weight.data_ptr()) == fits
    if not fits:
        assert torch.equal(weight, original)


@pytest.mark.parametrize("rows, in_features, out_features, bias", [
    (1, 32, 53, True),  # one tile of k, a partial last panel
    (16, 64, 96, False),  # one tile of rows: the second pair of accumulators unused
    (17, 96, 40, True),  # both tiles of rows, the second holding one
    (45, 64, 1000, False),  # a block of 32 rows and a partial one, many panels
])
def test_amx_gemm_matches_a_float32_matmul(rows, in_features, out_features, bias):
    """bfloat16 x and weights, x a strided slice, against the float32 product of the same values rounded once."""
    if not cpu_native.amx_ready():
        pytest.skip("AMX does not run here (no AMX in the CPU, or Linux did not grant its state)")
    torch.manual_seed(rows)
    weight = torch.randn(out_features, in_features).to(torch.bfloat16)
    x = torch.randn(rows, in_features + 7).to(torch.bfloat16)[:, 3 : 3 + in_features]
    b = torch.randn(out_features) if bias else None
    expected = x.float() @ weight.float().T + (b if bias else 0)
    out = cpu_native.amx_gemm(x, cpu_native.pack_panels(weight), b, out_features)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2.0**-8)


def test_gemv_of_no_rows_is_empty():
    """A step whose rows are all mid-prompt samples nothing: the LM head gets zero rows."""
    assert cpu_native.gemv(torch.randn(0, 16), torch.randn(8, 16), None).shape == (0, 8)
    assert cpu_native.small_gemm(torch.randn(0, 16), torch.randn(8, 16), None).shape == (0, 8)
    if torch.float32 in cpu_native.panel_dtypes():
        panels = cpu_native.pack_panels(torch.randn(8, 16))
        assert cpu_native.panel_gemm(torch.randn(0, 16), panels, None, 8).shape == (0, 8)
    if cpu_native.amx_ready():
        panels = cpu_native.pack_panels(torch.randn(8, 32).to(torch.bfloat16))
        assert cpu_native.amx_gemm(torch.randn(0, 32), panels, None, 8).shape == (0, 8)
