"""A verify's decode rows in waves (runtime/waves.py): each decode kernel, given the page chains of
runtime.kernels.common.in_waves, reads a sequence's state from one page and writes it to the next. That must be
what stepping each sequence one token at a time does, with a copy of its state kept after each token: the
oracle here is each kernel's reference run token by token, sequence by sequence. Random inputs and states."""

import pytest
import torch
from mamba2_oracle import random_ssm_inputs
from triton_helpers import DEVICE, needs_device

from runtime.kernels import cpu_native
from runtime.kernels.causal_conv1d import causal_conv1d_update_ref, causal_conv1d_update_triton
from runtime.kernels.gated_delta_rule import gated_delta_rule_update_ref, gated_delta_rule_update_triton
from runtime.kernels.selective_scan import selective_state_update_mamba1_ref, selective_state_update_mamba1_triton
from runtime.kernels.short_conv import short_conv_update_ref, short_conv_update_triton
from runtime.kernels.ssm_state_update import selective_state_update_ref, selective_state_update_triton
from runtime.waves import decode_waves, wave_rows

# Three sequences verifying 2, 1 and 0 drafts: waves of 3, 2 and 1 sequences, 6 rows.
COUNTS = [3, 2, 1]
WAVES = tuple(decode_waves(COUNTS))
ROWS = sum(COUNTS)
# Row 0: each sequence's page; row i + 1: where wave i writes it (a kept page while the sequence goes on).
CHAINS = torch.tensor([[3, 0, 6], [1, 4, 6], [2, 0, 6], [3, 0, 6]])
NUM_SLOTS = 8  # slots 5 and 7 belong to no chain: never written
KEPT = {(0, 0): 1, (0, 1): 2, (1, 0): 4}  # (sequence, after its position i) -> page, for positions before its last


def mamba2_case(dtype):
    inputs = random_ssm_inputs(ROWS, 4, 8, 2, 16, dtype)
    states = torch.randn(NUM_SLOTS, 4, 8, 16) * 0.5

    def call(kernel, states, rows, pages, waves):
        picked = {k: v[rows] if k in ("x", "dt", "B", "C") else v for k, v in inputs.items()}
        out = torch.full(picked["x"].shape, float("nan"), dtype=dtype, device=picked["x"].device)
        kernel(states, **picked, dt_limit=(0.0, float("inf")), state_indices=pages, out=out, waves=waves)
        return out

    return inputs, states, call


def mamba1_case(dtype):
    d_inner, d_state = 12, 8
    inputs = dict(x=torch.randn(ROWS, d_inner), dt=torch.randn(ROWS, d_inner) - 1.0,
                  A=-torch.exp(torch.randn(d_inner, d_state) * 0.5), B=torch.randn(ROWS, d_state),
                  C=torch.randn(ROWS, d_state), D=torch.randn(d_inner), dt_bias=torch.rand(d_inner) * 0.5,
                  z=torch.randn(ROWS, d_inner))
    inputs = {k: v.to(dtype) if k != "A" else v for k, v in inputs.items()}
    states = torch.randn(NUM_SLOTS, d_inner, d_state) * 0.5

    def call(kernel, states, rows, pages, waves):
        picked = {k: v[rows] if k in ("x", "dt", "B", "C", "z") else v for k, v in inputs.items()}
        out = torch.full(picked["x"].shape, float("nan"), dtype=dtype, device=picked["x"].device)
        return kernel(states, **picked, state_indices=pages, out=out, waves=waves)

    return inputs, states, call


def conv_case(dtype, width=4, dim=40):
    inputs = dict(x=torch.randn(ROWS, dim).to(dtype), weight=torch.randn(dim, width), bias=torch.randn(dim))
    states = torch.randn(NUM_SLOTS, width - 1, dim)

    def call(kernel, states, rows, pages, waves):
        return kernel(inputs["x"][rows], inputs["weight"], inputs["bias"], states, pages, "silu", waves=waves)

    return inputs, states, call


def short_conv_case(dtype, width=3, dim=16):
    inputs = dict(bcx=torch.randn(ROWS, 3 * dim).to(dtype), weight=torch.randn(dim, width), bias=None)
    states = torch.randn(NUM_SLOTS, width - 1, dim)

    def call(kernel, states, rows, pages, waves):
        return kernel(inputs["bcx"][rows], inputs["weight"], None, states, pages, waves=waves)

    return inputs, states, call


def delta_rule_case(dtype, k_heads=1, heads=2, dk=8, dv=8):
    inputs = dict(q=torch.randn(ROWS, k_heads, dk), k=torch.randn(ROWS, k_heads, dk), v=torch.randn(ROWS, heads, dv),
                  a=torch.randn(ROWS, heads), b=torch.randn(ROWS, heads))
    inputs = {k: v.to(dtype) for k, v in inputs.items()}
    A_log, dt_bias = torch.randn(heads) * 0.5, torch.randn(heads) - 2
    states = torch.randn(NUM_SLOTS, heads, dk, dv) * 0.5

    def call(kernel, states, rows, pages, waves):
        picked = [inputs[name][rows] for name in ("q", "k", "v", "a", "b")]
        return kernel(*picked, A_log.to(picked[0].device), dt_bias.to(picked[0].device), states, pages, 0.9,
                      waves=waves)

    return inputs, states, call


CASES = {"mamba2": mamba2_case, "mamba1": mamba1_case, "conv": conv_case, "short_conv": short_conv_case,
         "delta_rule": delta_rule_case}
REFERENCES = {"mamba2": selective_state_update_ref, "mamba1": selective_state_update_mamba1_ref,
              "conv": causal_conv1d_update_ref, "short_conv": short_conv_update_ref,
              "delta_rule": gated_delta_rule_update_ref}
TRITON = {"mamba2": selective_state_update_triton, "mamba1": selective_state_update_mamba1_triton,
          "conv": causal_conv1d_update_triton, "short_conv": short_conv_update_triton,
          "delta_rule": gated_delta_rule_update_triton}
NATIVE = {"mamba2": cpu_native.selective_state_update_native, "conv": cpu_native.causal_conv1d_update_native}


def token_by_token(case: str, dtype):
    """The oracle: each sequence stepped alone, one token per call, in place on its own page; returns the
    outputs by row, the pool after, and the state after each position (the kept pages' expected contents)."""
    torch.manual_seed(0)
    _, states, call = CASES[case](dtype)
    initial = states.clone()
    outputs, kept = [None] * ROWS, {}
    for seq, rows in enumerate(wave_rows(COUNTS)):
        page = CHAINS[0, seq : seq + 1]
        for position, row in enumerate(rows):
            outputs[row] = call(REFERENCES[case], states, [row], page, None)[0]
            if position + 1 < len(rows):
                kept[(seq, position)] = states[page[0]].clone()
    return torch.stack(outputs), states, kept, initial


def assert_verify_matches_token_by_token(case, kernel, dtype, tolerance, device="cpu"):
    expected, after, kept, initial = token_by_token(case, dtype)
    torch.manual_seed(0)
    inputs, states, call = CASES[case](dtype)
    assert torch.equal(states, initial)  # the same random draw as the oracle's
    on = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    inputs.update(on)
    states = states.to(device)
    out = call(kernel, states, slice(None), CHAINS.to(device), WAVES).cpu()
    states = states.cpu()
    torch.testing.assert_close(out.float(), expected.float(), **tolerance)
    for (seq, position), page in KEPT.items():
        torch.testing.assert_close(states[page], kept[(seq, position)], **tolerance)
    for page in CHAINS[0]:  # each sequence's own page holds the state after its last position
        torch.testing.assert_close(states[page], after[page], **tolerance)
    for page in (5, 7):
        assert torch.equal(states[page], initial[page])


FLOAT32 = dict(atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("case", CASES)
def test_the_references_verify_waves_as_token_by_token_steps(case):
    # Batched matmuls sum in an order that depends on the batch: equal to an ulp, not bit for bit.
    assert_verify_matches_token_by_token(case, REFERENCES[case], torch.float32, FLOAT32)


@pytest.mark.skipif(not cpu_native.available(), reason="the native CPU kernels do not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", NATIVE)
def test_the_native_kernels_verify_waves_in_one_launch_as_token_by_token_steps(case, dtype):
    tolerance = FLOAT32 if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    assert_verify_matches_token_by_token(case, NATIVE[case], dtype, tolerance)


@needs_device
@pytest.mark.parametrize("case", TRITON)
def test_the_triton_kernels_verify_waves_as_token_by_token_steps(case):
    assert_verify_matches_token_by_token(case, TRITON[case], torch.float32, FLOAT32, device=DEVICE)


@pytest.mark.skipif(not cpu_native.available(), reason="the native CPU kernels do not build here")
@pytest.mark.parametrize("waves, pages, message", [
    ([2, 4], CHAINS, "must be positive and must not grow"),
    ([3, 2], CHAINS, "must add up to the rows of 'x', 6"),
    (list(WAVES), CHAINS[:3], "must have shape \\[4, 3\\]"),
    (list(WAVES), CHAINS.clone().index_fill_(0, torch.tensor([2]), 8), "holds 8 at 6, outside \\[-1, 8\\)"),
])
def test_the_operators_name_a_bad_wave_layout(waves, pages, message):
    states, x = torch.zeros(NUM_SLOTS, 3, 40), torch.randn(ROWS, 40)
    with pytest.raises(RuntimeError, match=f"tandem::conv_update: argument '(waves|slots)' {message}"):
        torch.ops.tandem.conv_update(states, pages, x, torch.randn(40, 4), None, True, torch.empty_like(x),
                                     waves=waves)
