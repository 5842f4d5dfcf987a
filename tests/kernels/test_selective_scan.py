"""Mamba-1: selective_scan_ref / selective_state_update_mamba1_ref against the token-by-token recurrence.

States live in strided views of a random-byte page pool; fresh sequences' slots hold NaN.
"""

import pytest
import torch
import torch.nn.functional as F

from runtime.kernels.metadata import build_mamba_prefill_metadata
from runtime.kernels.selective_scan import selective_scan_ref, selective_state_update_mamba1_ref

DM, N, NUM_SLOTS = 12, 8, 8
PER_TOKEN = ("x", "dt", "B", "C", "z")
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 1e-2)}


def mamba1_oracle(x, dt, A, B, C, D, dt_bias, z, state):
    """One sequence, float64: x, dt, z (L, Dm); B, C (L, N); state (Dm, N) -> y (L, Dm), final state."""
    dt = F.softplus(dt.double() + (0 if dt_bias is None else dt_bias.double()))
    h = state.double()
    ys = []
    for t in range(x.shape[0]):
        h = torch.exp(dt[t][:, None] * A.double()) * h + (dt[t] * x[t].double())[:, None] * B[t].double()
        y = h @ C[t].double() + D.double() * x[t].double()
        ys.append(y * F.silu(z[t].double()) if z is not None else y)
    return torch.stack(ys), h


def random_inputs(num_tokens, dtype=torch.float32, gated=True, with_dt_bias=True):
    return dict(
        x=torch.randn(num_tokens, DM, dtype=dtype),
        dt=(torch.randn(num_tokens, DM) - 1).to(dtype),
        A=-torch.exp(torch.randn(DM, N) * 0.5),
        B=torch.randn(num_tokens, N, dtype=dtype),
        C=torch.randn(num_tokens, N, dtype=dtype),
        D=torch.randn(DM, dtype=dtype),
        dt_bias=(torch.rand(DM) * 0.5).to(dtype) if with_dt_bias else None,
        z=torch.randn(num_tokens, DM, dtype=dtype) if gated else None,
    )


def select_tokens(inputs, rows):
    return {k: v[rows] if k in PER_TOKEN and v is not None else v for k, v in inputs.items()}


def state_view(page_pool, state_dtype):
    nbytes = DM * N * state_dtype.itemsize
    pool = page_pool(NUM_SLOTS, 2, nbytes + 40, seed=5)
    states = pool.view(1, 40, state_dtype, (DM, N))
    states.copy_(torch.randn(states.shape))
    return pool, states


def run_scan(inputs, states, slots, meta, sub_chunk_len=None):
    out = torch.full_like(inputs["x"], float("nan"))
    result = selective_scan_ref(
        **inputs, ssm_states=states, state_indices=slots, meta=meta, out=out, sub_chunk_len=sub_chunk_len
    )
    assert result is out
    return out


DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("dtype, state_dtype", DTYPES)
@pytest.mark.parametrize("gated, with_dt_bias", [(True, True), (False, False)])
# None: the default (about sqrt(30) here); 1: a sub-chunk per token; 30: one sub-chunk per sequence.
@pytest.mark.parametrize("sub_chunk_len", [None, 1, 7, 30])
def test_varlen_matches_recurrence(page_pool, dtype, state_dtype, gated, with_dt_bias, sub_chunk_len):
    torch.manual_seed(0)
    pool, states = state_view(page_pool, state_dtype)
    query_lens, computed = [1, 30, 7, 17, 4], [0, 9, 3, 0, 2]
    slots = torch.tensor([4, 0, 7, 2, -1])
    for s, n in enumerate(computed):
        if n == 0 and slots[s] >= 0:
            states[slots[s]] = float("nan")
    meta = build_mamba_prefill_metadata(query_lens, computed, 16, "cpu")
    inputs = random_inputs(sum(query_lens), dtype, gated, with_dt_bias)
    initial = states.clone()
    pool.allow_writes(states, slots[slots >= 0])
    before = pool.snapshot()

    out = run_scan(inputs, states, slots, meta, sub_chunk_len)

    assert out.dtype == dtype
    atol, rtol = TOLERANCES[dtype if state_dtype == torch.float32 else torch.bfloat16]
    starts = meta.query_start_loc.tolist()
    for s, slot in enumerate(slots.tolist()):
        piece = slice(starts[s], starts[s + 1])
        start = initial[slot] if slot >= 0 and computed[s] else torch.zeros(DM, N)
        expected, final = mamba1_oracle(**select_tokens(inputs, piece), state=start)
        torch.testing.assert_close(out[piece].double(), expected, atol=atol, rtol=rtol)
        if slot >= 0:
            torch.testing.assert_close(states[slot].double(), final, atol=atol, rtol=rtol)
    pool.assert_untouched_outside_allowed(before)


def test_split_prefill_then_decode_equals_one_shot(page_pool):
    torch.manual_seed(1)
    _, states = state_view(page_pool, torch.float32)
    total, prefilled = [45, 20], [[(0, 10), (10, 41)], [(0, 3), (3, 17)]]
    slots = torch.tensor([5, 1])
    seqs = [random_inputs(n) for n in total]
    shared = {k: v for k, v in seqs[0].items() if k not in PER_TOKEN}

    def packed(ranges):
        return {k: torch.cat([seqs[s][k][a:b] for s, (a, b) in enumerate(ranges)]) for k in PER_TOKEN} | shared

    meta = build_mamba_prefill_metadata(total, [0, 0], 16, "cpu")
    one_shot = run_scan(packed([(0, 45), (0, 20)]), states, slots, meta)
    one_shot_states = states[slots].clone()

    outs = [[], []]
    for step in range(2):
        piece = [ranges[step] for ranges in prefilled]
        lens = [b - a for a, b in piece]
        meta = build_mamba_prefill_metadata(lens, [a for a, _ in piece], 16, "cpu")
        y = run_scan(packed(piece), states, slots, meta)
        outs[0].append(y[: lens[0]])
        outs[1].append(y[lens[0] :])
    position = [ranges[-1][1] for ranges in prefilled]
    while active := [s for s in range(2) if position[s] < total[s]]:
        step_inputs = {k: torch.stack([seqs[s][k][position[s]] for s in active]) for k in PER_TOKEN}
        out = torch.empty(len(active), DM)
        selective_state_update_mamba1_ref(states, **step_inputs, **shared, state_indices=slots[active], out=out)
        for row, s in enumerate(active):
            outs[s].append(out[row : row + 1])
            position[s] += 1

    torch.testing.assert_close(torch.cat(outs[0] + outs[1]), one_shot, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[slots], one_shot_states, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype, state_dtype", DTYPES)
def test_decode_matches_recurrence_and_skips_padding(page_pool, dtype, state_dtype):
    torch.manual_seed(2)
    pool, states = state_view(page_pool, state_dtype)
    slots = torch.tensor([-1, 6, 3, -1])
    inputs = random_inputs(len(slots), dtype)
    initial = states.clone()
    pool.allow_writes(states, slots[slots >= 0])
    before = pool.snapshot()
    out = torch.full_like(inputs["x"], float("nan"))

    assert selective_state_update_mamba1_ref(states, **inputs, state_indices=slots, out=out) is out

    atol, rtol = TOLERANCES[dtype if state_dtype == torch.float32 else torch.bfloat16]
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            assert torch.equal(out[row], torch.zeros(DM, dtype=dtype))
            continue
        expected, final = mamba1_oracle(**select_tokens(inputs, slice(row, row + 1)), state=initial[slot])
        torch.testing.assert_close(out[row].double(), expected[0], atol=atol, rtol=rtol)
        torch.testing.assert_close(states[slot].double(), final, atol=atol, rtol=rtol)
    pool.assert_untouched_outside_allowed(before)
