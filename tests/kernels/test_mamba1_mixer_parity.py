"""The engine's own Mamba-1 mixer (runtime/layers/mamba1.py, built as the Mamba and Jamba models build it)
reproduces HF's MambaMixer and JambaMambaMixer, prefill and decode.

Pins the Mamba-1 data flow the engine relies on: in_proj chunked into (x, gate), the conv over x,
x_proj split into (dt, B, C), Jamba's dt/B/C RMSNorms, dt_proj's weight applied before the scan
and its bias added inside it as dt_bias, D, the silu(z) gate and the state hand-over between
prefill chunks and decode steps. HF runs each prompt alone; ours runs them packed, with a resumed
prefill chunk and batched decode, on NaN-filled state pools, inside the runner's forward context.
"""

import pytest
import torch
from mixer_steps import PackedMixer, engine_dims
from tiny_models import randomize
from transformers import DynamicCache, JambaConfig, MambaConfig
from transformers.models.jamba.modeling_jamba import JambaMambaMixer
from transformers.models.mamba.modeling_mamba import MambaMixer

from runtime.models.jamba.model import jamba_mixer
from runtime.models.mamba.model import mamba1_mixer

HIDDEN, D_STATE, NUM_SLOTS = 32, 8, 4


def tiny_mixers(kind):
    if kind == "mamba":
        config = MambaConfig(
            hidden_size=HIDDEN, state_size=D_STATE, intermediate_size=64, conv_kernel=4, time_step_rank=4,
            num_hidden_layers=1, vocab_size=64,
        )  # fmt: skip
        hf, ours = MambaMixer(config, layer_idx=0), mamba1_mixer(engine_dims(config), 0)
    else:
        config = JambaConfig(
            hidden_size=HIDDEN, mamba_d_state=D_STATE, mamba_expand=2, mamba_d_conv=4, mamba_dt_rank=4,
            num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, num_experts=1, intermediate_size=64,
            vocab_size=64, num_attention_heads=4, num_key_value_heads=2,
        )  # fmt: skip
        hf, ours = JambaMambaMixer(config, layer_idx=0), jamba_mixer(engine_dims(config), 0)
    randomize(hf, seed=0)  # D, A_log, dt_proj's bias, the conv bias and Jamba's norm weights
    ours.load_state_dict(hf.state_dict())
    return config, hf.eval(), ours.eval()


@pytest.mark.parametrize("kind", ["mamba", "jamba"])
@torch.no_grad()
def test_chunked_prefill_and_decode_match_hf(kind):
    torch.manual_seed(0)
    config, hf, mixer = tiny_mixers(kind)
    lens, decode_steps = [37, 11], 3
    prompts = [torch.randn(n + decode_steps, HIDDEN) for n in lens]

    expected = []
    for s, prompt in enumerate(prompts):
        cache = DynamicCache(config=config)
        outs = [hf(prompt[None, : lens[s]], cache=cache)[0]]
        outs += [hf(prompt[None, t : t + 1], cache=cache)[0] for t in range(lens[s], lens[s] + decode_steps)]
        expected.append((torch.cat(outs), cache.layers[0].conv_states[0], cache.layers[0].recurrent_states[0]))

    # Step 1 prefills A[:20] and all of B; step 2 resumes A at 20 while B decodes; then both decode.
    ours = PackedMixer(mixer, NUM_SLOTS, 16)
    slots = [3, 1]
    got = [[], []]
    y = ours.step(prefills=[(slots[0], prompts[0][:20], 0), (slots[1], prompts[1][:11], 0)])
    got[0].append(y[:20])
    got[1].append(y[20:])
    y = ours.step(decodes=[(slots[1], prompts[1][11])], prefills=[(slots[0], prompts[0][20:37], 20)])
    got[1].append(y[:1])
    got[0].append(y[1:])
    position, end = [37, 12], [n + decode_steps for n in lens]
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
