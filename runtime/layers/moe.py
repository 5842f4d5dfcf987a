"""Sparse mixture-of-experts feed-forward: a top-k router and gated-MLP experts.

Tokens are grouped by expert (one sort), so each expert runs one matmul chain over all of
its tokens; the Python loop is over experts, never over tokens. Two checkpoint layouts
are provided under their HF names: the experts packed in 3-D tensors (GraniteMoe) or one
gated MLP per expert (Jamba, Mixtral).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from runtime.layers.activation import activation
from runtime.layers.mlp import GatedMLP

# Where the softmax sits relative to the top-k, as each HF model defines it.
SOFTMAX_THEN_TOPK = "softmax_then_topk"  # Jamba, Mixtral: top-k of the full softmax, not renormalised
TOPK_THEN_SOFTMAX = "topk_then_softmax"  # GraniteMoe: softmax over the k selected logits
ROUTINGS = (SOFTMAX_THEN_TOPK, TOPK_THEN_SOFTMAX)


def select_experts(router_logits: torch.Tensor, top_k: int, routing: str) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: (T, E) -> routing weights (T, top_k) float32 and expert ids (T, top_k)."""
    assert routing in ROUTINGS, routing
    if routing == SOFTMAX_THEN_TOPK:
        return torch.softmax(router_logits, dim=-1, dtype=torch.float).topk(top_k, dim=-1)
    top_logits, ids = router_logits.float().topk(top_k, dim=-1)
    return torch.softmax(top_logits, dim=-1), ids


def grouped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """sum_k weights[t, k] * expert(ids[t, k], x[t]) for every token t.

    x: (T, hidden); weights, ids: (T, top_k). The (token, expert) pairs are sorted by expert,
    so each expert sees its tokens as one contiguous slice.
    """
    num_tokens, top_k = ids.shape
    order = ids.flatten().argsort(stable=True)
    counts = torch.bincount(ids.flatten(), minlength=num_experts).tolist()
    inputs = x.index_select(0, order // top_k)
    outputs = torch.empty_like(inputs)
    start = 0
    for e, count in enumerate(counts):
        if count:
            outputs[start : start + count] = expert(e, inputs[start : start + count])
        start += count
    # Scaled in the model dtype, as HF does. Back in (token, k) order, each token's k outputs are
    # adjacent and a sum over k combines them: no index_add_, which stalls on a busy CPU (its
    # threads synchronise even for a few rows).
    outputs *= weights.flatten()[order, None].to(x.dtype)
    combined = torch.empty_like(outputs)
    combined[order] = outputs
    return combined.view(num_tokens, top_k, -1).sum(dim=1)


class StackedLinear(nn.Module):
    """One bias-free linear map per expert, stored as a (num_experts, out, in) tensor."""

    def __init__(self, num_experts: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))

    def forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight[expert])


class Router(nn.Module):
    """GraniteMoe keeps its router weight one level down, as `router.layer.weight`."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.layer = nn.Linear(hidden_size, num_experts, bias=False)


class PackedMoE(nn.Module):
    """Experts packed per checkpoint tensor: `input_linear` (E, 2I, H) gate then up, `output_linear` (E, H, I)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, act: str,
                 routing: str):
        super().__init__()
        self.num_experts, self.top_k, self.routing = num_experts, top_k, routing
        self.router = Router(hidden_size, num_experts)
        self.input_linear = StackedLinear(num_experts, hidden_size, 2 * intermediate_size)
        self.output_linear = StackedLinear(num_experts, intermediate_size, hidden_size)
        self.act_fn = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        weights, ids = select_experts(self.router.layer(x), self.top_k, self.routing)
        return grouped_experts(x, weights, ids, self.num_experts, self._expert)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(e, x).chunk(2, dim=-1)
        return self.output_linear(e, self.act_fn(gate) * up)


class PerExpertMoE(nn.Module):
    """One gated MLP per expert (`experts.N.gate_proj/up_proj/down_proj`) and a `router` linear."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, act: str,
                 routing: str):
        super().__init__()
        self.num_experts, self.top_k, self.routing = num_experts, top_k, routing
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(hidden_size, intermediate_size, act) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        weights, ids = select_experts(self.router(x), self.top_k, self.routing)
        return grouped_experts(x, weights, ids, self.num_experts, self._expert)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.experts[e](x)
