"""The engine's own Mamba-2 mixer (runtime/layers/mamba2.py, built as the Bamba model builds it)
reproduces HF's BambaMixer, prefill and decode.

This pins the semantics the engine relies on: the in_proj split (gate, xBC, dt), the conv over
xBC with SiLU, the x/B/C split, dt_bias/softplus/time_step_limit (clamped by HF's chunked scan,
never by its decode step), D, the gated RMSNorm and the state hand-over between prefill chunks and
decode steps. HF runs each prompt alone with its own cache; ours runs them packed, with chunked
prefill and batched decode, on NaN-filled state pools, inside the forward context the runner builds.
"""

import pytest
import torch
from mixer_steps import PackedMixer, engine_dims
from tiny_models import randomize
from transformers import BambaConfig, DynamicCache
from transformers.models.bamba.modeling_bamba import BambaMixer

from runtime.models.bamba.model import bamba_mixer

HIDDEN, NUM_SLOTS, CHUNK = 64, 4, 16


def tiny_mixers(time_step_limit):
    config = BambaConfig(
        hidden_size=HIDDEN, num_hidden_layers=2, attn_layer_indices=[1], num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, vocab_size=128, mamba_n_heads=8, mamba_d_head=16,
        mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=CHUNK,
        time_step_limit=time_step_limit,
    )  # fmt: skip
    hf = BambaMixer(config, layer_idx=0)
    randomize(hf, seed=0)  # D, dt_bias, A_log, the norm weight and the conv bias are no longer constants
    ours = bamba_mixer(engine_dims(config), 0)
    ours.load_state_dict(hf.state_dict())
    return config, hf.eval(), ours.eval()


# (0.05, 0.5) clamps most time steps of the random dt_bias (softplus in [1e-3, 1e-1]) in HF's prefill.
@pytest.mark.parametrize("time_step_limit", [(0.0, float("inf")), (0.05, 0.5)])
@torch.no_grad()
def test_chunked_prefill_and_decode_match_hf(time_step_limit):
    torch.manual_seed(0)
    config, hf, mixer = tiny_mixers(time_step_limit)
    assert mixer.dt_limit == tuple(time_step_limit)
    lens, decode_steps = [40, 23], 3
    prompts = [torch.randn(n + decode_steps, HIDDEN) for n in lens]

    # HF: each prompt alone, one-shot prefill then one token at a time.
    expected = []
    for s, prompt in enumerate(prompts):
        cache = DynamicCache(config=config)
        outs = [hf(prompt[None, : lens[s]], cache=cache)[0]]
        outs += [hf(prompt[None, t : t + 1], cache=cache)[0] for t in range(lens[s], lens[s] + decode_steps)]
        expected.append((torch.cat(outs), cache.layers[0].conv_states[0], cache.layers[0].recurrent_states[0]))

    # Ours: step 1 prefills A[:21] and all of B; step 2 resumes A at 21 (not a multiple of Q = 16)
    # while B decodes; then both decode together. Slots are out of order on purpose.
    ours = PackedMixer(mixer, NUM_SLOTS, CHUNK)
    slots = [2, 0]
    got = [[], []]
    y = ours.step(prefills=[(slots[0], prompts[0][:21], 0), (slots[1], prompts[1][:23], 0)])
    got[0].append(y[:21])
    got[1].append(y[21:])
    y = ours.step(decodes=[(slots[1], prompts[1][23])], prefills=[(slots[0], prompts[0][21:40], 21)])
    got[1].append(y[:1])
    got[0].append(y[1:])
    position, end = [40, 24], [n + decode_steps for n in lens]
    while active := [s for s in range(2) if position[s] < end[s]]:
        y = ours.step(decodes=[(slots[s], prompts[s][position[s]]) for s in active])
        for row, s in enumerate(active):
            got[s].append(y[row : row + 1])
            position[s] += 1

    for s in range(2):
        out, conv_state, ssm_state = expected[s]
        torch.testing.assert_close(torch.cat(got[s]), out, atol=1e-5, rtol=1e-5)
        # HF's conv cache keeps the last W inputs (channels first); ours keeps the last W-1.
        torch.testing.assert_close(ours.conv_states[slots[s]], conv_state[0, :, 1:].T, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ours.ssm_states[slots[s]], ssm_state[0], atol=1e-5, rtol=1e-5)
