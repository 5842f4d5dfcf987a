"""Nemotron-H: one mixer per block (Mamba-2, attention, MLP or MoE), as `layers_block_type` lists them.

Every block is norm -> mixer -> residual. Attention has no rotary embedding; MLP and MoE blocks
cache nothing. Weights live under `backbone.`, as the hub checkpoints (and transformers' own
save_pretrained) write them.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.kernels.common import NO_DT_LIMIT
from runtime.layers.attention import PagedAttention
from runtime.layers.mamba2 import Mamba2Mixer
from runtime.layers.nemotron_moe import NemotronMoE, UpDownMLP
from runtime.layers.norm import RMSNorm
from runtime.models.backbone import BackboneForCausalLM, MixerBlock
from runtime.models.nemotron_h.declaration import NemotronHDims

# transformers' legacy names, which 4.x configs and hybrid_override_pattern use.
BLOCK_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}


class NemotronRMSNorm(RMSNorm):
    """RMSNorm whose weight multiplies in float32 before the cast back (HF's NemotronHRMSNorm order)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


class NemotronAttention(nn.Module):
    """Grouped-query attention without positional embedding and without biases."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.attn = PagedAttention(layer_idx, num_heads, num_kv_heads, head_dim, head_dim**-0.5)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(hidden).view(-1, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(-1, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v))


def nemotron_mixer(config: NemotronHDims, layer_idx: int) -> Mamba2Mixer:
    if config.mamba_hidden_act != "silu":
        raise ValueError(
            f"Nemotron-H with mamba_hidden_act={config.mamba_hidden_act!r}: the engine's Mamba conv kernels "
            "apply silu only; use a checkpoint with mamba_hidden_act='silu'"
        )
    return Mamba2Mixer(
        layer_idx,
        hidden_size=config.hidden_size,
        d_inner=config.mamba_num_heads * config.mamba_head_dim,
        num_heads=config.mamba_num_heads,
        head_dim=config.mamba_head_dim,
        n_groups=config.n_groups,
        d_state=config.ssm_state_size,
        d_conv=config.conv_kernel,
        conv_bias=config.use_conv_bias,
        proj_bias=config.use_bias,
        eps=config.layer_norm_epsilon,
        # HF's mixer ignores config.time_step_limit: the scan clamps dt below at time_step_min, decode never.
        dt_limit=(config.time_step_min, float("inf")),
        decode_dt_limit=NO_DT_LIMIT,
    )


def nemotron_moe(config: NemotronHDims) -> NemotronMoE:
    return NemotronMoE(
        config.hidden_size,
        num_experts=config.n_routed_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        shared_intermediate_size=config.moe_shared_expert_intermediate_size,
        latent_size=config.moe_latent_size,
        act=config.mlp_hidden_act,
        mlp_bias=config.mlp_bias,
        n_group=config.n_group,
        topk_group=config.topk_group,
        norm_topk_prob=config.norm_topk_prob,
        routed_scaling_factor=config.routed_scaling_factor,
    )


def block_mixer(config: NemotronHDims, block_type: str, layer_idx: int) -> nn.Module:
    block_type = BLOCK_TYPES.get(block_type, block_type)
    if block_type == "linear_attention":
        return nemotron_mixer(config, layer_idx)
    if block_type == "full_attention":
        return NemotronAttention(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                                 config.head_dim, layer_idx)
    if block_type == "mlp":
        return UpDownMLP(config.hidden_size, config.intermediate_size, config.mlp_hidden_act, config.mlp_bias)
    if block_type == "moe":
        return nemotron_moe(config)
    raise ValueError(
        f"Nemotron-H layer {layer_idx} has block type {block_type!r}; layers_block_type takes "
        "'linear_attention' (M), 'full_attention' (*), 'mlp' (-) or 'moe' (E)"
    )


class NemotronHForCausalLM(BackboneForCausalLM):
    def __init__(self, config: NemotronHDims):
        eps = config.layer_norm_epsilon
        layers = (MixerBlock(NemotronRMSNorm(config.hidden_size, eps), block_mixer(config, block_type, i))
                  for i, block_type in enumerate(config.layers_block_type))
        super().__init__(config, layers, NemotronRMSNorm(config.hidden_size, eps))

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith("mtp."):
            return None  # multi-token-prediction layers: HF skips them too; the engine predicts one token
        if name.startswith("model."):
            # transformers' in-memory spelling, for checkpoints saved without its hub conversion
            name = "backbone." + name.removeprefix("model.")
        return super().checkpoint_name(name)
