"""The gated delta rule (Gated DeltaNet): the chunked reference against a naive per-token recurrence, and the
Triton kernel against the reference (under the interpreter on a CPU), with states in strided views of a
random-byte page pool, varlen batches and nonzero initial states."""

import pytest
import torch
import torch.nn.functional as F
from triton_helpers import DEVICE, assert_close, needs_device, on_device

from runtime.kernels.gated_delta_rule import (
    GDN_BLOCK_T,
    gated_delta_rule_fn_ref,
    gated_delta_rule_fn_triton,
    gated_delta_rule_update_ref,
    gated_delta_rule_update_triton,
)
from runtime.kernels.metadata import build_mamba_prefill_metadata

NUM_K_HEADS, NUM_HEADS, DK, DV, NUM_SLOTS = 2, 4, 16, 12, 8  # DV is not a power of two


def inputs(num_tokens, dtype, device="cpu"):
    """q, k as strided slices (as a split of the conv output is), v, a, b, A_log, dt_bias; never zeros."""
    qk = torch.randn(num_tokens, 2 * NUM_K_HEADS * DK + 4, device=device).to(dtype)[:, 4:]
    q, k = (x.view(num_tokens, NUM_K_HEADS, DK) for x in qk.split(NUM_K_HEADS * DK, dim=-1))
    v = torch.randn(num_tokens, NUM_HEADS, DV, device=device).to(dtype)
    a = torch.randn(num_tokens, NUM_HEADS, device=device).to(dtype)
    b = torch.randn(num_tokens, NUM_HEADS, device=device).to(dtype)
    A_log = torch.log(torch.empty(NUM_HEADS, device=device).uniform_(1, 16)).to(dtype)
    dt_bias = (torch.randn(NUM_HEADS, device=device) - 2).to(dtype)
    return q, k, v, a, b, A_log, dt_bias


def naive_recurrence(q, k, v, a, b, A_log, dt_bias, state, beta_scale=1.0):
    """HF's torch_recurrent_gated_delta_rule for one sequence, token by token, in float64."""
    q, k, v, a, b = (x.double() for x in (q, k, v, a, b))
    repeat = NUM_HEADS // NUM_K_HEADS
    q = F.normalize(q, dim=-1, eps=0).repeat_interleave(repeat, 1) * DK**-0.5
    k = F.normalize(k, dim=-1, eps=0).repeat_interleave(repeat, 1)
    g = -A_log.double().exp() * F.softplus(a + dt_bias.double())
    state = state.double().clone()
    out = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", state, k[t])) * beta_scale * b[t].sigmoid()[:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(out), state


@pytest.mark.parametrize("beta_scale", [1.0, 2.0])  # 2: OLMo-Hybrid's negative eigenvalues
def test_reference_equals_the_recurrence_over_varlen_chunks_and_decode(beta_scale):
    torch.manual_seed(0)
    # A fresh sequence over several chunks, one resumed mid-chunk from a nonzero state, a one-token
    # one, then a decode step for each.
    query_lens, computed, chunk = [21, 6, 1], [0, 5, 0], 8
    q, k, v, a, b, A_log, dt_bias = inputs(sum(query_lens) + 3, torch.float64)
    states = torch.full((5, NUM_HEADS, DK, DV), float("nan"), dtype=torch.float64)
    slots = torch.tensor([3, 0, 4])
    states[0] = torch.randn(NUM_HEADS, DK, DV, dtype=torch.float64)
    initial = [torch.zeros(NUM_HEADS, DK, DV, dtype=torch.float64), states[0].clone(),
               torch.zeros(NUM_HEADS, DK, DV, dtype=torch.float64)]
    meta = build_mamba_prefill_metadata(query_lens, computed, chunk, "cpu")
    assert meta.cu_chunk_seqlens.numel() - 1 == 3 + 2 + 1, "the fresh sequence must span several chunks"
    num_prefill = sum(query_lens)
    out = gated_delta_rule_fn_ref(*(x[:num_prefill] for x in (q, k, v, a, b)), A_log, dt_bias, states, slots, meta,
                                  beta_scale)
    decode = gated_delta_rule_update_ref(*(x[num_prefill:] for x in (q, k, v, a, b)), A_log, dt_bias, states, slots,
                                         beta_scale)

    starts = [0, 21, 27]
    for i, (start, n) in enumerate(zip(starts, query_lens)):
        rows = list(range(start, start + n)) + [num_prefill + i]
        expected, final = naive_recurrence(q[rows], k[rows], v[rows], a[rows], b[rows], A_log, dt_bias, initial[i],
                                           beta_scale)
        torch.testing.assert_close(out[start : start + n].double(), expected[:n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(decode[i].double(), expected[n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(states[slots[i]], final, atol=1e-5, rtol=1e-5)
    assert states[1:3].isnan().all(), "slots no sequence owns are never written"


def test_reference_decode_skips_padding():
    torch.manual_seed(1)
    q, k, v, a, b, A_log, dt_bias = inputs(2, torch.float32)
    states = torch.randn(3, NUM_HEADS, DK, DV)
    before = states.clone()
    out = gated_delta_rule_update_ref(q, k, v, a, b, A_log, dt_bias, states, torch.tensor([-1, 2]))
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(states[:2], before[:2]) and not torch.equal(states[2], before[2])


def state_pool(page_pool, dtype):
    nbytes = NUM_HEADS * DK * DV * dtype.itemsize
    pool = on_device(page_pool(NUM_SLOTS, 2, nbytes + 64, seed=5))
    states = pool.view(1, 32, dtype, (NUM_HEADS, DK, DV))
    states.copy_(torch.randn(states.shape).to(dtype))
    return pool, states


@needs_device
@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("dtype, state_dtype, beta_scale", [
    (torch.float32, torch.float32, 1.0),
    (torch.float32, torch.float32, 2.0),
    (torch.bfloat16, torch.float32, 1.0),
])
def test_prefill_kernel_matches_reference(page_pool, dtype, state_dtype, beta_scale):
    torch.manual_seed(2)
    pool, states = state_pool(page_pool, state_dtype)
    # A resumed sequence (from a nonzero state) longer than the kernel's chunk, a fresh one over several of
    # the reference's chunks, a one-token one, a padded one.
    query_lens, computed = [GDN_BLOCK_T + 5, 13, 1, 3], [6, 0, 0, 0]
    slots = torch.tensor([5, 1, 2, -1], device=DEVICE)
    states[1] = float("nan")  # the fresh sequence's slot: reading it would show
    meta = build_mamba_prefill_metadata(query_lens, computed, chunk_size=8, device=DEVICE)
    args = inputs(sum(query_lens), dtype, DEVICE)
    expected_states = states.clone()
    expected = gated_delta_rule_fn_ref(*args, expected_states, slots, meta, beta_scale)
    pool.allow_writes(states, slots[slots >= 0])
    before = pool.snapshot()

    out = gated_delta_rule_fn_triton(*args, states, slots, meta, beta_scale)

    assert out.dtype == dtype and out.shape == (sum(query_lens), NUM_HEADS, DV)
    written = slots[slots >= 0]
    if DEVICE == "cuda" and dtype != torch.float32:
        # Compiled, half-precision activations go through tensor-core dots (half operands, float32
        # accumulation): a few half ulps, as tests/kernels/test_triton_gpu.py allows.
        torch.testing.assert_close(out.float().cpu(), expected.float().cpu(), atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(states[written].cpu(), expected_states[written].cpu(), atol=3e-2, rtol=3e-2)
    else:
        assert_close(out, expected)
        assert_close(states[written], expected_states[written])
    pool.assert_untouched_outside_allowed(before)


@needs_device
@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("dtype, beta_scale", [(torch.float32, 2.0), (torch.bfloat16, 1.0)])
def test_update_kernel_matches_reference(page_pool, dtype, beta_scale):
    torch.manual_seed(3)
    pool, states = state_pool(page_pool, torch.float32)
    args = inputs(4, dtype, DEVICE)
    slots = torch.tensor([4, -1, 0, 7], device=DEVICE)
    expected_states = states.clone()
    expected = gated_delta_rule_update_ref(*args, expected_states, slots, beta_scale)
    pool.allow_writes(states, slots[slots >= 0])
    before = pool.snapshot()

    out = gated_delta_rule_update_triton(*args, states, slots, beta_scale)

    assert_close(out, expected)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_close(states[slots[slots >= 0]], expected_states[slots[slots >= 0]])
    pool.assert_untouched_outside_allowed(before)
