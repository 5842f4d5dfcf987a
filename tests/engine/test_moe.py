"""The MoE layer equals HF's MoE blocks: routing (softmax before or after the top-k) and the expert sum."""

import pytest
import torch
from transformers import GraniteMoeHybridConfig, JambaConfig
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMoE
from transformers.models.jamba.modeling_jamba import JambaSparseMoeBlock

from runtime.layers.moe import SOFTMAX_THEN_TOPK, TOPK_THEN_SOFTMAX, PackedMoE, PerExpertMoE, select_experts

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, TOKENS = 32, 48, 6, 2, 40


def granite_pair():
    config = GraniteMoeHybridConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_local_experts=EXPERTS,
                                    num_experts_per_tok=TOP_K, mamba_n_heads=4)
    hf = GraniteMoeHybridMoE(config)
    ours = PackedMoE(HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, "silu", TOPK_THEN_SOFTMAX)
    with torch.no_grad():
        for tensor in (hf.router.weight, hf.experts.gate_up_proj, hf.experts.down_proj):
            tensor.normal_(0, 0.3)
        ours.router.layer.weight.copy_(hf.router.weight)
        ours.input_linear.weight.copy_(hf.experts.gate_up_proj)
        ours.output_linear.weight.copy_(hf.experts.down_proj)
    return hf, ours


def jamba_pair():
    config = JambaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_experts=EXPERTS,
                         num_experts_per_tok=TOP_K)
    hf = JambaSparseMoeBlock(config)
    ours = PerExpertMoE(HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, "silu", SOFTMAX_THEN_TOPK)
    with torch.no_grad():
        for tensor in (hf.router.weight, hf.experts.gate_up_proj, hf.experts.down_proj):
            tensor.normal_(0, 0.3)
        ours.router.weight.copy_(hf.router.weight)
        for e, expert in enumerate(ours.experts):
            gate, up = hf.experts.gate_up_proj[e].chunk(2, dim=0)
            expert.gate_proj.weight.copy_(gate)
            expert.up_proj.weight.copy_(up)
            expert.down_proj.weight.copy_(hf.experts.down_proj[e])
    return hf, ours


@pytest.mark.parametrize("pair", [granite_pair, jamba_pair])
@torch.no_grad()
def test_moe_matches_transformers(pair):
    torch.manual_seed(0)
    hf, ours = pair()
    x = torch.randn(TOKENS, HIDDEN)
    torch.testing.assert_close(ours(x), hf(x[None])[0], atol=1e-5, rtol=1e-5)


def test_softmax_placement():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = select_experts(logits, 2, SOFTMAX_THEN_TOPK)
    assert ids.tolist() == [[0, 1]] and weights.sum() < 0.95  # the top 2 of the full softmax, as they are
    weights, ids = select_experts(logits, 2, TOPK_THEN_SOFTMAX)
    assert ids.tolist() == [[0, 1]] and torch.isclose(weights.sum(), torch.tensor(1.0))  # a softmax over the 2
