from __future__ import annotations

import torch
from torch import nn

from runtime.layers.moe import grouped_experts
from runtime.models.lfm2.model import Lfm2ForCausalLM, Lfm2MLP
from runtime.models.lfm2_moe.declaration import Lfm2MoeDims


class Lfm2MoeBlock(nn.Module):
    """Sigmoid router (`gate`), experts chosen by score + `expert_bias` but weighted by the score alone,
    renormalised and scaled; one w1/w3/w2 MLP per expert (the checkpoint's `experts.N.*`)."""

    def __init__(self, dims: Lfm2MoeDims):
        super().__init__()
        self.num_experts, self.top_k = dims.num_experts, dims.top_k
        self.norm_topk_prob, self.routed_scaling_factor = dims.norm_topk_prob, dims.routed_scaling_factor
        self.gate = nn.Linear(dims.hidden_size, dims.num_experts, bias=False)
        self.experts = nn.ModuleList(Lfm2MLP(dims.hidden_size, dims.moe_intermediate_size)
                                     for _ in range(dims.num_experts))
        # A loaded selection bias (HF keeps it as a float32 buffer).
        self.expert_bias = None
        if dims.use_expert_bias:
            self.expert_bias = nn.Parameter(torch.zeros(dims.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        scores = self.gate(x).sigmoid()
        if self.expert_bias is None:
            weights, ids = scores.topk(self.top_k, dim=-1)
        else:
            ids = (scores + self.expert_bias).topk(self.top_k, dim=-1).indices
            weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
        weights = weights * self.routed_scaling_factor
        return grouped_experts(x, weights, ids, self.num_experts, lambda e, rows: self.experts[e](rows))


def moe_feed_forward(dims: Lfm2MoeDims, layer_idx: int) -> nn.Module:
    if layer_idx < dims.num_dense_layers:
        return Lfm2MLP(dims.hidden_size, dims.intermediate_size)
    return Lfm2MoeBlock(dims)


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    def __init__(self, dims: Lfm2MoeDims):
        super().__init__(dims, moe_feed_forward)
