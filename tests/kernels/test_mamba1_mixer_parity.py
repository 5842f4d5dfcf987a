"""Our ops composed as a Mamba-1 mixer reproduce HF's MambaMixer and JambaMambaMixer, prefill and decode.

Pins the Mamba-1 data flow the engine relies on: in_proj chunked into (x, gate), the conv over x,
x_proj split into (dt, B, C), Jamba's dt/B/C RMSNorms applied by the caller, dt_proj's weight
applied by the caller and its bias passed as dt_bias, D, the silu(z) gate inside the op, and
the state hand-over between prefill chunks and decode steps. HF runs each prompt alone; ours
runs them packed, with a resumed prefill chunk and batched decode on shared state pools.
"""

import pytest
import torch
from transformers import DynamicCache, JambaConfig, MambaConfig
from transformers.models.jamba.modeling_jamba import JambaMambaMixer
from transformers.models.mamba.modeling_mamba import MambaMixer

from runtime.kernels import (
    build_mamba_prefill_metadata,
    causal_conv1d_fn,
    causal_conv1d_update,
    selective_scan,
    selective_state_update_mamba1,
)

HIDDEN, D_STATE, NUM_SLOTS = 32, 8, 4


def tiny_mixer(kind):
    if kind == "mamba":
        config = MambaConfig(
            hidden_size=HIDDEN, state_size=D_STATE, intermediate_size=64, conv_kernel=4, time_step_rank=4,
            num_hidden_layers=1, vocab_size=64,
        )  # fmt: skip
        mixer = MambaMixer(config, layer_idx=0)
    else:
        config = JambaConfig(
            hidden_size=HIDDEN, mamba_d_state=D_STATE, mamba_expand=2, mamba_d_conv=4, mamba_dt_rank=4,
            num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, num_experts=1, intermediate_size=64,
            vocab_size=64, num_attention_heads=4, num_key_value_heads=2,
        )  # fmt: skip
        mixer = JambaMambaMixer(config, layer_idx=0)
        with torch.no_grad():
            for norm in (mixer.dt_layernorm, mixer.b_layernorm, mixer.c_layernorm):
                norm.weight.copy_(torch.randn_like(norm.weight))
    with torch.no_grad():  # move the parameters HF initialises to constants away from them
        mixer.A_log.copy_(torch.randn_like(mixer.A_log) * 0.5)
        mixer.D.copy_(torch.randn_like(mixer.D))
        mixer.dt_proj.bias.copy_(torch.randn_like(mixer.dt_proj.bias) * 0.5)
    return config, mixer.eval()


class OurMixer:
    def __init__(self, mixer) -> None:
        self.m = mixer
        self.conv_states = torch.full((NUM_SLOTS, mixer.conv_kernel_size - 1, mixer.intermediate_size), float("nan"))
        self.ssm_states = torch.full((NUM_SLOTS, mixer.intermediate_size, D_STATE), float("nan"))

    def _ssm_inputs(self, x, gate):
        m = self.m
        dt, B, C = m.x_proj(x).split([m.time_step_rank, D_STATE, D_STATE], dim=-1)
        if isinstance(m, JambaMambaMixer):
            dt, B, C = m.dt_layernorm(dt), m.b_layernorm(B), m.c_layernorm(C)
        return dict(
            x=x, dt=dt @ m.dt_proj.weight.T, A=-torch.exp(m.A_log.float()), B=B, C=C, D=m.D,
            dt_bias=m.dt_proj.bias, z=gate,
        )  # fmt: skip

    def prefill(self, hidden, slots, meta):
        m = self.m
        x, gate = m.in_proj(hidden).chunk(2, dim=-1)
        x = causal_conv1d_fn(x, m.conv1d.weight[:, 0], m.conv1d.bias, self.conv_states, slots, meta, m.activation)
        out = torch.empty_like(x)
        selective_scan(**self._ssm_inputs(x, gate), ssm_states=self.ssm_states, state_indices=slots, meta=meta, out=out)
        return m.out_proj(out)

    def decode(self, hidden, slots):
        m = self.m
        x, gate = m.in_proj(hidden).chunk(2, dim=-1)
        x = causal_conv1d_update(x, m.conv1d.weight[:, 0], m.conv1d.bias, self.conv_states, slots, m.activation)
        out = torch.empty_like(x)
        selective_state_update_mamba1(self.ssm_states, **self._ssm_inputs(x, gate), state_indices=slots, out=out)
        return m.out_proj(out)


@pytest.mark.parametrize("kind", ["mamba", "jamba"])
@torch.no_grad()
def test_chunked_prefill_and_decode_match_hf(kind):
    torch.manual_seed(0)
    config, mixer = tiny_mixer(kind)
    lens, decode_steps = [37, 11], 3
    prompts = [torch.randn(n + decode_steps, HIDDEN) for n in lens]

    expected = []
    for s, prompt in enumerate(prompts):
        cache = DynamicCache(config=config)
        outs = [mixer(prompt[None, : lens[s]], cache=cache)[0]]
        outs += [mixer(prompt[None, t : t + 1], cache=cache)[0] for t in range(lens[s], lens[s] + decode_steps)]
        expected.append((torch.cat(outs), cache.layers[0].conv_states[0], cache.layers[0].recurrent_states[0]))

    # Step 1 prefills A[:20] and all of B; step 2 resumes A at 20 while B decodes; then both decode.
    ours = OurMixer(mixer)
    slots = torch.tensor([3, 1])
    got = [[], []]
    meta = build_mamba_prefill_metadata([20, 11], [0, 0], 16, "cpu")
    y = ours.prefill(torch.cat([prompts[0][:20], prompts[1][:11]]), slots, meta)
    got[0].append(y[:20])
    got[1].append(y[20:])
    meta = build_mamba_prefill_metadata([17], [20], 16, "cpu")
    got[0].append(ours.prefill(prompts[0][20:37], slots[:1], meta))
    got[1].append(ours.decode(prompts[1][11:12], slots[1:]))
    position, end = [37, 12], [n + decode_steps for n in lens]
    while active := [s for s in range(2) if position[s] < end[s]]:
        y = ours.decode(torch.stack([prompts[s][position[s]] for s in active]), slots[active])
        for row, s in enumerate(active):
            got[s].append(y[row : row + 1])
            position[s] += 1

    for s in range(2):
        out, conv_state, ssm_state = expected[s]
        torch.testing.assert_close(torch.cat(got[s]), out, atol=1e-5, rtol=1e-5)
        # HF's conv cache keeps the last W inputs (channels first); ours keeps the last W-1.
        torch.testing.assert_close(ours.conv_states[slots[s]], conv_state[0, :, 1:].T, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ours.ssm_states[slots[s]], ssm_state[0], atol=1e-5, rtol=1e-5)
