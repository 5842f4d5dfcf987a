"""ssd_scan_ref against the token-by-token recurrence, split prefill + decode vs one shot, and HF's chunk scan.

SSM states live in strided views of a random-byte page pool; fresh sequences' slots hold NaN,
so reading them instead of starting from zeros would show.
"""

import importlib

import pytest
import torch
from mamba2_oracle import PER_TOKEN, random_ssm_inputs, recurrence_oracle, select_tokens

from runtime.kernels.metadata import build_mamba_prefill_metadata
from runtime.kernels.ssd_scan import ssd_scan_ref
from runtime.kernels.ssm_state_update import selective_state_update_ref

H, P, G, N, Q = 4, 8, 2, 16, 16
NUM_SLOTS = 8
NO_LIMIT = (0.0, float("inf"))
# Output and states against the float64 oracle; low-precision inputs are rounded before both see them.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 1e-2)}


def ssm_state_view(page_pool, state_dtype, seed=3):
    """(NUM_SLOTS, H, P, N) SSM states in slab 0 of a 3-slab pool, after a conv-state-sized gap."""
    nbytes = H * P * N * state_dtype.itemsize
    pool = page_pool(NUM_SLOTS, 3, nbytes + 200, seed=seed)
    states = pool.view(0, 192, state_dtype, (H, P, N))
    states.copy_(torch.randn(states.shape) * 0.5)
    return pool, states


def run_ssd(inputs, dt_limit, states, slots, meta):
    out = torch.full_like(inputs["x"], float("nan"))
    result = ssd_scan_ref(**inputs, dt_limit=dt_limit, ssm_states=states, state_indices=slots, meta=meta, out=out)
    assert result is out
    return out


DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("dtype, state_dtype", DTYPES)
@pytest.mark.parametrize("dt_limit", [NO_LIMIT, (0.05, 0.8)])
def test_varlen_matches_recurrence(page_pool, dtype, state_dtype, dt_limit):
    torch.manual_seed(0)
    pool, states = ssm_state_view(page_pool, state_dtype)
    # Shorter than Q, several chunks with a short tail, resumed off a Q boundary, resumed on one, padding.
    query_lens, computed = [5, 37, 23, 16, 3], [0, 5, 16, 0, 7]
    slots = torch.tensor([6, 2, 0, 5, -1])
    for s, n in enumerate(computed):
        if n == 0 and slots[s] >= 0:
            states[slots[s]] = float("nan")
    meta = build_mamba_prefill_metadata(query_lens, computed, Q, "cpu")
    inputs = random_ssm_inputs(sum(query_lens), H, P, G, N, dtype)
    initial = states.clone()
    pool.allow_writes(states, slots[slots >= 0])
    before = pool.snapshot()

    out = run_ssd(inputs, dt_limit, states, slots, meta)

    assert out.dtype == dtype
    atol, rtol = TOLERANCES[dtype if state_dtype == torch.float32 else torch.bfloat16]
    starts = meta.query_start_loc.tolist()
    for s, slot in enumerate(slots.tolist()):
        piece = slice(starts[s], starts[s + 1])
        start = initial[slot] if slot >= 0 and computed[s] else torch.zeros(H, P, N)
        expected, final = recurrence_oracle(**select_tokens(inputs, piece), dt_limit=dt_limit, state=start)
        torch.testing.assert_close(out[piece].double(), expected, atol=atol, rtol=rtol)
        if slot >= 0:
            torch.testing.assert_close(states[slot].double(), final, atol=atol, rtol=rtol)
    pool.assert_untouched_outside_allowed(before)


def test_split_prefill_then_decode_equals_one_shot(page_pool):
    torch.manual_seed(1)
    _, states = ssm_state_view(page_pool, torch.float32)
    total = [41, 30]
    slots = torch.tensor([1, 4])
    seqs = [random_ssm_inputs(n, H, P, G, N) for n in total]
    shared = {k: seqs[0][k] for k in ("A", "D", "dt_bias")}

    def packed(ranges):
        return {k: torch.cat([seqs[s][k][a:b] for s, (a, b) in enumerate(ranges)]) for k in PER_TOKEN} | shared

    meta = build_mamba_prefill_metadata(total, [0, 0], Q, "cpu")
    one_shot = run_ssd(packed([(0, 41), (0, 30)]), NO_LIMIT, states, slots, meta)
    one_shot_states = states[slots].clone()

    # A fresh piece, then a resumed piece starting off a Q boundary (7 and 19), then decode steps.
    pieces = [[(0, 7), (0, 19)], [(7, 37), (19, 27)]]
    outs = [[], []]
    for piece in pieces:
        lens = [b - a for a, b in piece]
        meta = build_mamba_prefill_metadata(lens, [a for a, _ in piece], Q, "cpu")
        y = run_ssd(packed(piece), NO_LIMIT, states, slots, meta)
        outs[0].append(y[: lens[0]])
        outs[1].append(y[lens[0] :])
    prefilled = [b for _, b in pieces[-1]]
    for step in range(max(n - done for n, done in zip(total, prefilled))):
        active = [s for s in range(2) if prefilled[s] + step < total[s]]
        step_inputs = {k: torch.stack([seqs[s][k][prefilled[s] + step] for s in active]) for k in PER_TOKEN}
        out = torch.empty(len(active), H, P)
        selective_state_update_ref(
            states, **step_inputs, **shared, dt_limit=NO_LIMIT, state_indices=slots[active], out=out
        )
        for row, s in enumerate(active):
            outs[s].append(out[row : row + 1])

    torch.testing.assert_close(torch.cat(outs[0] + outs[1]), one_shot, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[slots], one_shot_states, atol=1e-5, rtol=1e-5)


def test_matches_hf_chunk_scan():
    """HF's torch mamba2_chunk_scan (one sequence, initial state, Q not dividing the length)."""
    from transformers.models.bamba import modeling_bamba as hf

    torch.manual_seed(2)
    inputs = random_ssm_inputs(45, H, P, G, N)
    init = torch.randn(1, H, P, N)
    theirs, their_final = hf.mamba2_chunk_scan(
        inputs["x"][None], inputs["dt"][None], inputs["A"], inputs["B"][None], inputs["C"][None],
        chunk_size=Q, D=inputs["D"], dt_bias=inputs["dt_bias"], initial_states=init, dt_softplus=True,
        dt_limit=(0.0, float("inf")), return_final_states=True,
    )  # fmt: skip
    states = init.clone()
    meta = build_mamba_prefill_metadata([45], [3], Q, "cpu")  # resumed, so the state is used
    ours = run_ssd(inputs, NO_LIMIT, states, torch.tensor([0]), meta)
    # HF chunks from position 0 while ours realigns to absolute position 3: same math, other grouping.
    torch.testing.assert_close(ours, theirs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, their_final, atol=1e-5, rtol=1e-5)


def test_long_chunk_with_strong_decay_stays_accurate():
    """Cumulative A dt' reaches about -1000 inside one 128-token chunk; exp of differences of that
    cumsum would lose about 1e-4 relative precision, the stable segsum keeps float32 accuracy."""
    torch.manual_seed(3)
    inputs = random_ssm_inputs(128, H, P, G, N)
    inputs["dt"] = inputs["dt"] + 3.0  # dt' about 2-4
    inputs["A"] = -2.0 - torch.rand(H)  # A dt' about -4 to -12 per token
    states = torch.zeros(1, H, P, N)
    out = run_ssd(inputs, NO_LIMIT, states, torch.tensor([0]), build_mamba_prefill_metadata([128], [0], 128, "cpu"))
    expected, final = recurrence_oracle(**inputs, dt_limit=NO_LIMIT, state=torch.zeros(H, P, N))
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[0].double(), final, atol=1e-5, rtol=1e-5)


def test_chunks_taken_one_at_a_time_give_the_same_result(monkeypatch):
    """SEGSUM_ELEMENTS bounds how many chunks' decay matrices exist at once; 1 means one chunk per step."""
    # runtime.kernels.ssd_scan is also the name of the bound op, so fetch the module itself.
    module = importlib.import_module("runtime.kernels.ssd_scan")
    torch.manual_seed(4)
    meta = build_mamba_prefill_metadata([37, 5, 20], [3, 0, 16], Q, "cpu")
    inputs = random_ssm_inputs(62, H, P, G, N)
    slots = torch.tensor([0, 1, 2])
    initial = torch.randn(3, H, P, N)
    states_all, states_one = initial.clone(), initial.clone()
    all_at_once = run_ssd(inputs, NO_LIMIT, states_all, slots, meta)
    monkeypatch.setattr(module, "SEGSUM_ELEMENTS", 1)
    one_at_a_time = run_ssd(inputs, NO_LIMIT, states_one, slots, meta)
    torch.testing.assert_close(one_at_a_time, all_at_once, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(states_one, states_all, atol=1e-6, rtol=1e-6)


def test_fresh_single_chunk_prompts_skip_state_passing_and_match(page_pool):
    """Fresh prompts of one chunk each take the path with no inter-chunk pass: it must give what the
    general path gives for the same prompts batched with a resumed sequence, and the recurrence's states."""
    torch.manual_seed(5)
    pool, states = ssm_state_view(page_pool, torch.float32)
    lens, slots = [9, 16, 3, 12], torch.tensor([3, 0, -1, 6])
    states[slots[slots >= 0]] = float("nan")  # fresh: never read
    inputs = random_ssm_inputs(sum(lens), H, P, G, N)
    meta = build_mamba_prefill_metadata(lens, [0] * len(lens), Q, "cpu")
    pool.allow_writes(states, slots[slots >= 0])
    before = pool.snapshot()
    fast = run_ssd(inputs, NO_LIMIT, states, slots, meta)
    pool.assert_untouched_outside_allowed(before)

    starts = meta.query_start_loc.tolist()
    for s, slot in enumerate(slots.tolist()):
        piece = slice(starts[s], starts[s + 1])
        zero = torch.zeros(H, P, N)
        expected, final = recurrence_oracle(**select_tokens(inputs, piece), dt_limit=NO_LIMIT, state=zero)
        torch.testing.assert_close(fast[piece].double(), expected, atol=1e-5, rtol=1e-5)
        if slot >= 0:
            torch.testing.assert_close(states[slot].double(), final, atol=1e-5, rtol=1e-5)

    # The same prompts after a resumed two-chunk sequence (slot 7) take the general path.
    extra = random_ssm_inputs(20, H, P, G, N)
    mixed = {k: torch.cat([extra[k], inputs[k]]) if k in PER_TOKEN else inputs[k] for k in inputs}
    general_states = states.clone()
    general_states[7] = torch.randn(H, P, N)
    meta = build_mamba_prefill_metadata([20, *lens], [5] + [0] * len(lens), Q, "cpu")
    general = run_ssd(mixed, NO_LIMIT, general_states, torch.cat([torch.tensor([7]), slots]), meta)
    torch.testing.assert_close(general[20:], fast, atol=1e-6, rtol=1e-6)
