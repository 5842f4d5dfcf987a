"""Our Nemotron-H MoE equals HF's NemotronHMoE, including what the tiny checkpoints leave at defaults:
a nonzero score-correction bias, group-limited routing, unnormalised weights and latent projections."""

import pytest
import torch
from transformers import NemotronHConfig
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

from runtime.models.nemotron_h.model import nemotron_moe

HIDDEN = 64


def hf_moe(**overrides) -> tuple[NemotronHConfig, NemotronHMoE]:
    config = NemotronHConfig(
        hidden_size=HIDDEN, hybrid_override_pattern="ME", n_routed_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, **overrides,
    )  # fmt: skip
    torch.manual_seed(0)
    moe = NemotronHMoE(config).eval()
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
        moe.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.5)
    return config, moe


def our_moe(config: NemotronHConfig, hf: NemotronHMoE):
    ours = nemotron_moe(config).eval()
    # HF fuses the experts in memory; the hub checkpoint (and our module) keeps one MLP per expert.
    weights = {name: t for name, t in hf.state_dict().items() if not name.startswith("experts.")}
    for e in range(config.n_routed_experts):
        weights[f"experts.{e}.up_proj.weight"] = hf.experts.up_proj[e]
        weights[f"experts.{e}.down_proj.weight"] = hf.experts.down_proj[e]
    ours.load_state_dict(weights, strict=True)
    return ours


@pytest.mark.parametrize("overrides", [{}, {"norm_topk_prob": False, "moe_latent_size": 16}])
def test_moe_matches_transformers(overrides):
    config, hf = hf_moe(**overrides)
    ours = our_moe(config, hf)
    hidden = torch.randn(2, 11, HIDDEN)
    with torch.no_grad():
        expected = hf(hidden)
        actual = ours(hidden.view(-1, HIDDEN)).view_as(expected)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_routing_keeps_to_the_best_groups():
    config, hf = hf_moe()
    ours = our_moe(config, hf)
    with torch.no_grad():
        weights, expert_ids = ours.gate(torch.randn(32, HIDDEN))
    groups_used = (expert_ids // (config.n_routed_experts // config.n_group)).tolist()
    assert all(len(set(row)) <= config.topk_group for row in groups_used)
    assert torch.allclose(weights.sum(-1), torch.full((32,), config.routed_scaling_factor))


def test_a_bad_expert_grouping_names_the_fields():
    config, _ = hf_moe()
    config.n_group = 3
    with pytest.raises(ValueError, match="n_group=3"):
        nemotron_moe(config)
