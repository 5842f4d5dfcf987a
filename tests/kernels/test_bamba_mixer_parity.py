"""Our ops composed as a Mamba-2 mixer reproduce HF's BambaMixer (torch_forward path), prefill and decode.

This pins the semantics the engine relies on: the in_proj split (gate, xBC, dt), the conv over
xBC with SiLU, the x/B/C split, dt_bias/softplus/time_step_limit, D, the gated RMSNorm and the
state hand-over between prefill chunks and decode steps. HF runs each prompt alone with its own
cache; ours runs them packed, with chunked prefill and batched decode, on shared state pools.
"""

import pytest
import torch
from transformers import BambaConfig, DynamicCache
from transformers.models.bamba.modeling_bamba import BambaMixer

from runtime.kernels import (
    build_mamba_prefill_metadata,
    causal_conv1d_fn,
    causal_conv1d_update,
    rms_norm_gated,
    selective_state_update,
    ssd_scan,
)

HIDDEN, NUM_SLOTS = 64, 4


def tiny_mixer(time_step_limit):
    config = BambaConfig(
        hidden_size=HIDDEN, num_hidden_layers=2, attn_layer_indices=[1], num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, vocab_size=128, mamba_n_heads=8, mamba_d_head=16,
        mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
        time_step_limit=time_step_limit,
    )  # fmt: skip
    mixer = BambaMixer(config, layer_idx=0).eval()
    with torch.no_grad():  # move the parameters HF initialises to constants away from them
        mixer.A_log.copy_(torch.randn(8) * 0.5)
        mixer.D.copy_(torch.randn(8))
        mixer.dt_bias.copy_(torch.randn(8) * 0.5)
        mixer.norm.weight.copy_(torch.randn(mixer.intermediate_size))
        mixer.conv1d.bias.copy_(torch.randn(mixer.conv_dim) * 0.1)
    return config, mixer


class OurMixer:
    """The mixer data flow, calling our ops on (slot-indexed) state pools."""

    def __init__(self, mixer: BambaMixer) -> None:
        self.m = mixer
        self.conv_states = torch.full((NUM_SLOTS, mixer.conv_kernel_size - 1, mixer.conv_dim), float("nan"))
        self.ssm_states = torch.full((NUM_SLOTS, mixer.num_heads, mixer.head_dim, mixer.ssm_state_size), float("nan"))

    def _split(self, hidden):
        m = self.m
        return m.in_proj(hidden).split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)

    def _ssm_inputs(self, xBC, dt):
        m, num_tokens = self.m, xBC.shape[0]
        x, B, C = xBC.split([m.intermediate_size, m.n_groups * m.ssm_state_size, m.n_groups * m.ssm_state_size], -1)
        return dict(
            x=x.view(num_tokens, m.num_heads, m.head_dim),
            dt=dt,
            A=-torch.exp(m.A_log.float()),
            B=B.view(num_tokens, m.n_groups, m.ssm_state_size),
            C=C.view(num_tokens, m.n_groups, m.ssm_state_size),
            D=m.D,
            dt_bias=m.dt_bias,
            dt_limit=m.time_step_limit,
        )

    def _finish(self, y, gate):
        m = self.m
        group_size = m.intermediate_size // m.n_groups
        y = rms_norm_gated(y.flatten(1), gate, m.norm.weight, m.norm.variance_epsilon, group_size)
        return m.out_proj(y)

    def prefill(self, hidden, slots, meta):
        m = self.m
        gate, xBC, dt = self._split(hidden)
        xBC = causal_conv1d_fn(xBC, m.conv1d.weight[:, 0], m.conv1d.bias, self.conv_states, slots, meta, m.activation)
        inputs = self._ssm_inputs(xBC, dt)
        y = torch.empty_like(inputs["x"])
        ssd_scan(**inputs, ssm_states=self.ssm_states, state_indices=slots, meta=meta, out=y)
        return self._finish(y, gate)

    def decode(self, hidden, slots):
        m = self.m
        gate, xBC, dt = self._split(hidden)
        xBC = causal_conv1d_update(xBC, m.conv1d.weight[:, 0], m.conv1d.bias, self.conv_states, slots, m.activation)
        inputs = self._ssm_inputs(xBC, dt)
        # HF's decode path (like mamba_ssm's step and vLLM's decode) never clamps dt to time_step_limit,
        # while its chunked prefill does; our op applies whatever limit it is given, so pass none here.
        inputs["dt_limit"] = (0.0, float("inf"))
        y = torch.empty_like(inputs["x"])
        selective_state_update(self.ssm_states, **inputs, state_indices=slots, out=y)
        return self._finish(y, gate)


@pytest.mark.parametrize("time_step_limit", [(0.0, float("inf")), (0.3, 1.5)])
@torch.no_grad()
def test_chunked_prefill_and_decode_match_hf(time_step_limit):
    torch.manual_seed(0)
    config, mixer = tiny_mixer(time_step_limit)
    lens, decode_steps = [40, 23], 3
    prompts = [torch.randn(n + decode_steps, HIDDEN) for n in lens]

    # HF: each prompt alone, one-shot prefill then one token at a time.
    expected = []
    for s, prompt in enumerate(prompts):
        cache = DynamicCache(config=config)
        outs = [mixer(prompt[None, : lens[s]], cache=cache)[0]]
        outs += [mixer(prompt[None, t : t + 1], cache=cache)[0] for t in range(lens[s], lens[s] + decode_steps)]
        expected.append((torch.cat(outs), cache.layers[0].conv_states[0], cache.layers[0].recurrent_states[0]))

    # Ours: step 1 prefills A[:21] and all of B; step 2 resumes A at 21 (not a multiple of Q = 16)
    # while B decodes; then both decode together. Slots are out of order on purpose.
    ours = OurMixer(mixer)
    slots = torch.tensor([2, 0])
    got = [[], []]
    meta = build_mamba_prefill_metadata([21, 23], [0, 0], config.mamba_chunk_size, "cpu")
    y = ours.prefill(torch.cat([prompts[0][:21], prompts[1][:23]]), slots, meta)
    got[0].append(y[:21])
    got[1].append(y[21:])
    meta = build_mamba_prefill_metadata([19], [21], config.mamba_chunk_size, "cpu")
    got[0].append(ours.prefill(prompts[0][21:40], slots[:1], meta))
    got[1].append(ours.decode(prompts[1][23:24], slots[1:]))
    position, end = [40, 24], [n + decode_steps for n in lens]
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
