"""Nemotron-H's MLP and mixture of experts, as HF's NemotronHMLP / NemotronHMoE compute them.

Experts are ungated MLPs, down(act(up(x))), with act relu² in the published checkpoints. The
router scores experts with a sigmoid in float32, picks the top k after adding a per-expert
correction bias (optionally within the best `topk_group` of `n_group` groups), and weights each
chosen expert by its uncorrected score, normalised and scaled. A shared expert sees every token.
Parameter names follow the hub checkpoint: `experts.{e}.up_proj.weight`, `gate.weight`, ...
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.layers.activation import activation


class UpDownMLP(nn.Module):
    """down(act(up(x))), without a gate."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool):
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


class TopkRouter(nn.Module):
    """DeepSeek-V3-style routing: sigmoid scores, bias-corrected group-limited top-k."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float):
        super().__init__()
        if num_experts % n_group or top_k > num_experts:
            raise ValueError(
                f"Nemotron-H MoE: {num_experts} experts cannot be split into n_group={n_group} groups with "
                f"num_experts_per_tok={top_k}; fix n_routed_experts, n_group or num_experts_per_tok in config.json"
            )
        # HF keeps the router in float32 whatever the model dtype (_keep_in_fp32_modules_strict).
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size, dtype=torch.float32))
        # A persistent buffer in HF; a frozen parameter here, so that the loader fills it by name.
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                    requires_grad=False)
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: (T, hidden_size) -> routing weights (T, top_k) float32 and expert ids (T, top_k)."""
        scores = F.linear(hidden.float(), self.weight.float()).sigmoid()
        choice = self._mask_groups(scores + self.e_score_correction_bias.float())
        expert_ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, expert_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, expert_ids

    def _mask_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Keep the experts of the `topk_group` groups whose two best experts score highest."""
        grouped = choice.unflatten(-1, (self.n_group, -1))  # (T, n_group, experts per group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).flatten(-2)


class NemotronMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        *,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        shared_intermediate_size: int,
        latent_size: int | None,
        act: str,
        mlp_bias: bool,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
    ):
        super().__init__()
        self.gate = TopkRouter(hidden_size, num_experts, top_k, n_group, topk_group, norm_topk_prob,
                               routed_scaling_factor)
        expert_size = latent_size or hidden_size
        self.experts = nn.ModuleList(
            UpDownMLP(expert_size, intermediate_size, act, bias=False) for _ in range(num_experts)
        )
        self.shared_experts = UpDownMLP(hidden_size, shared_intermediate_size, act, mlp_bias)
        # Experts may work in a smaller latent space, projected into and out of around them.
        self.fc1_latent_proj = nn.Linear(hidden_size, latent_size, bias=mlp_bias) if latent_size else nn.Identity()
        self.fc2_latent_proj = nn.Linear(latent_size, hidden_size, bias=mlp_bias) if latent_size else nn.Identity()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (T, hidden_size) -> (T, hidden_size)."""
        weights, expert_ids = self.gate(hidden)
        x = self.fc1_latent_proj(hidden)
        # Weighted expert outputs accumulate in float32, as in HF, then return to the model dtype.
        routed = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert in expert_ids.unique().tolist():
            tokens, slots = torch.where(expert_ids == expert)
            out = self.experts[expert](x[tokens]) * weights[tokens, slots, None]
            routed.index_add_(0, tokens, out.float())
        return self.fc2_latent_proj(routed.to(hidden.dtype)) + self.shared_experts(hidden)
