"""The Triton kernels compiled for a GPU at Bamba-9B-like layer sizes, against the references on the same device.

Run with `TRITON_INTERPRET=0 pytest -m gpu tests/kernels` on a CUDA machine (the interpreter tests
then also run compiled). Half-precision inputs go through tensor-core dot products (bf16 operands,
float32 accumulation), so their tolerances are a few bf16 ulps of the output; float32 inputs use
IEEE float32 dots (never TF32) and must agree to 1e-4.
"""

import math

import pytest
import torch

from runtime.kernels._triton_utils import interpreting
from runtime.kernels.causal_conv1d import (
    causal_conv1d_fn_ref,
    causal_conv1d_fn_triton,
    causal_conv1d_update_ref,
    causal_conv1d_update_triton,
)
from runtime.kernels.kv_cache import store_kv_ref, store_kv_triton
from runtime.kernels.metadata import build_attention_metadata, build_mamba_prefill_metadata
from runtime.kernels.paged_attention import paged_attention_ref, paged_attention_triton
from runtime.kernels.rms_norm_gated import rms_norm_gated_ref, rms_norm_gated_triton
from runtime.kernels.ssd_scan import ssd_scan_ref, ssd_scan_triton
from runtime.kernels.ssm_state_update import selective_state_update_ref, selective_state_update_triton

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(interpreting(), reason="compiled kernels: run with TRITON_INTERPRET=0"),
]
CUDA = "cuda"
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 3e-2)}
H, P, N, G, W, Q = 128, 64, 128, 1, 4, 256  # Mamba-2 layer of Bamba-9B
HQ, HKV, DH = 32, 8, 128  # its attention layers


def close(actual, expected, dtype):
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def page_views(num_pages, per_page_shapes, dtype):
    """Views like the engine's: each shape's slab of every page of one pool, padded to the largest page."""
    sizes = [math.prod(s) * dtype.itemsize for s in per_page_shapes]
    pool = torch.zeros(num_pages, sum(sizes) + 256, dtype=torch.uint8, device=CUDA)
    offsets = [128 + sum(sizes[:i]) for i in range(len(sizes))]
    return [pool[:, o : o + n].view(dtype).view(num_pages, *s) for o, n, s in zip(offsets, sizes, per_page_shapes)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lens", [[(1, 4096)] * 48 + [(1, 300)] * 16, [(512, 2560), (1, 1000), (37, 37)]])
def test_paged_attention_large(dtype, lens):
    torch.manual_seed(0)
    block_size = 528
    blocks = [math.ceil(s / block_size) for _, s in lens]
    k_cache, v_cache = page_views(sum(blocks) + 1, [(block_size, HKV, DH)] * 2, dtype)
    k_cache.normal_()
    v_cache.normal_()
    pages = torch.randperm(sum(blocks) + 1, device=CUDA)
    block_table = torch.zeros(len(lens), max(blocks), dtype=torch.int32, device=CUDA)
    for s, n in enumerate(blocks):
        block_table[s, :n], pages = pages[:n], pages[n:]
    meta = build_attention_metadata([q for q, _ in lens], [s for _, s in lens], CUDA)
    q = torch.randn(sum(q for q, _ in lens), HQ, DH, device=CUDA).to(dtype)
    expected = paged_attention_ref(q, k_cache, v_cache, block_table, meta, DH**-0.5, torch.empty_like(q))
    close(paged_attention_triton(q, k_cache, v_cache, block_table, meta, DH**-0.5, torch.empty_like(q)),
          expected, dtype)


def test_store_kv_large():
    torch.manual_seed(1)
    k_cache, v_cache = page_views(40, [(528, HKV, DH)] * 2, torch.bfloat16)
    slots = torch.randperm(40 * 528, device=CUDA)[:3000]
    key, value = (torch.randn(3000, HKV, DH, device=CUDA, dtype=torch.bfloat16) for _ in range(2))
    store_kv_triton(key, value, k_cache, v_cache, slots)
    page, offset = slots // 528, slots % 528
    assert torch.equal(k_cache[page, offset], key) and torch.equal(v_cache[page, offset], value)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(key, value, expected_k, expected_v, slots)
    assert torch.equal(k_cache, expected_k)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_ssm_decode_large(state_dtype):
    torch.manual_seed(2)
    num_seqs = 256
    conv_states, ssm_states = page_views(num_seqs + 8, [(W - 1, H * P + 2 * G * N), (H, P, N)], state_dtype)
    conv_states.normal_()
    ssm_states.normal_()
    slots = torch.randperm(num_seqs + 8, device=CUDA)[:num_seqs]
    slots[::17] = -1
    xbc = torch.randn(num_seqs, H * P + 2 * G * N, device=CUDA, dtype=torch.bfloat16)
    weight = torch.randn(H * P + 2 * G * N, W, device=CUDA).bfloat16()
    bias = torch.randn(H * P + 2 * G * N, device=CUDA).bfloat16()
    conv_expected = conv_states.clone()
    y_conv = causal_conv1d_update_ref(xbc, weight, bias, conv_expected, slots)
    close(causal_conv1d_update_triton(xbc, weight, bias, conv_states, slots), y_conv, torch.bfloat16)
    assert torch.equal(conv_states, conv_expected)

    x, B, C = xbc.split([H * P, G * N, G * N], dim=-1)
    args = dict(x=x.reshape(-1, H, P), dt=torch.randn(num_seqs, H, device=CUDA).bfloat16() - 1,
                A=-torch.exp(torch.randn(H, device=CUDA)), B=B.reshape(-1, G, N), C=C.reshape(-1, G, N),
                D=torch.randn(H, device=CUDA), dt_bias=torch.rand(H, device=CUDA), dt_limit=(0.0, float("inf")),
                state_indices=slots)
    expected_states = ssm_states.clone()
    expected = selective_state_update_ref(expected_states, **args, out=torch.empty_like(args["x"]))
    out = selective_state_update_triton(ssm_states, **args, out=torch.empty_like(args["x"]))
    close(out, expected, torch.bfloat16)
    close(ssm_states, expected_states, state_dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ssm_prefill_large(dtype):
    torch.manual_seed(3)
    query_lens, computed = [1500, 700, 3], [0, 100, 4000]
    slots = torch.tensor([3, 0, 5], device=CUDA)
    conv_states, ssm_states = page_views(8, [(W - 1, H * P + 2 * G * N), (H, P, N)], torch.float32)
    conv_states.normal_()
    ssm_states.normal_()
    meta = build_mamba_prefill_metadata(query_lens, computed, Q, CUDA)
    num_tokens = sum(query_lens)
    xbc = torch.randn(num_tokens, H * P + 2 * G * N, device=CUDA).to(dtype)
    weight, bias = (torch.randn(H * P + 2 * G * N, W, device=CUDA) * 0.5).to(dtype), None
    conv_expected = conv_states.clone()
    expected_conv = causal_conv1d_fn_ref(xbc, weight, bias, conv_expected, slots, meta)
    xbc = causal_conv1d_fn_triton(xbc, weight, bias, conv_states, slots, meta)
    close(xbc, expected_conv, dtype)
    close(conv_states, conv_expected, torch.float32)

    x, B, C = expected_conv.split([H * P, G * N, G * N], dim=-1)
    args = dict(x=x.reshape(-1, H, P), dt=(torch.randn(num_tokens, H, device=CUDA) - 2).to(dtype),
                A=-torch.exp(torch.rand(H, device=CUDA) * 2), B=B.reshape(-1, G, N), C=C.reshape(-1, G, N),
                D=torch.randn(H, device=CUDA), dt_bias=torch.rand(H, device=CUDA), dt_limit=(0.0, float("inf")),
                state_indices=slots, meta=meta)
    expected_states = ssm_states.clone()
    expected = ssd_scan_ref(**args, ssm_states=expected_states, out=torch.empty_like(args["x"]))
    out = ssd_scan_triton(**args, ssm_states=ssm_states, out=torch.empty_like(args["x"]))
    # Relative to the output's scale: a bf16 state tile in the dot products rounds at 2^-8 of it.
    scale = expected.abs().amax()
    close(out / scale, expected / scale, dtype)
    close(ssm_states, expected_states, dtype)

    z = torch.randn_like(out.flatten(1))
    norm_weight = torch.rand(H * P, device=CUDA).to(dtype) + 0.5
    close(rms_norm_gated_triton(out.flatten(1), z, norm_weight, 1e-5, H * P // G),
          rms_norm_gated_ref(out.flatten(1), z, norm_weight, 1e-5, H * P // G), dtype)
