from __future__ import annotations

import torch
from torch import nn

from runtime.layers.mamba1 import Mamba1Mixer
from runtime.layers.mlp import GatedMLP
from runtime.layers.moe import SOFTMAX_THEN_TOPK, PerExpertMoE
from runtime.layers.norm import RMSNorm
from runtime.models.causal_lm import CausalLM
from runtime.models.jamba.declaration import JambaDims
from runtime.models.llama.model import SelfAttention
from runtime.models.mamba.model import check_conv_activation


def jamba_mixer(config: JambaDims, layer_idx: int) -> Mamba1Mixer:
    check_conv_activation(config)
    return Mamba1Mixer(
        layer_idx,
        hidden_size=config.hidden_size,
        d_inner=config.mamba_expand * config.hidden_size,
        d_state=config.mamba_d_state,
        d_conv=config.mamba_d_conv,
        dt_rank=config.mamba_dt_rank,
        conv_bias=config.mamba_conv_bias,
        proj_bias=config.mamba_proj_bias,
        dt_bc_norm_eps=config.rms_norm_eps,
    )


def jamba_feed_forward(config: JambaDims, layer_idx: int) -> nn.Module:
    # HF builds an MoE block only where a layer has more than one expert.
    num_experts = config.layers_num_experts[layer_idx]
    if num_experts > 1:
        return PerExpertMoE(config.hidden_size, config.intermediate_size, num_experts, config.num_experts_per_tok,
                            config.hidden_act, SOFTMAX_THEN_TOPK)
    return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)


class JambaDecoderLayer(nn.Module):
    def __init__(self, config: JambaDims, layer_idx: int):
        super().__init__()
        self.is_attention = config.layers_block_type[layer_idx] == "attention"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.is_attention:
            self.self_attn = SelfAttention(config, layer_idx)
        else:
            self.mamba = jamba_mixer(config, layer_idx)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = jamba_feed_forward(config, layer_idx)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        # Jamba's attention has no position embedding: the Mamba layers carry the order.
        hidden = hidden + (self.self_attn(normed, None, None) if self.is_attention else self.mamba(normed))
        return hidden + self.feed_forward(self.pre_ff_layernorm(hidden))


class JambaModel(nn.Module):
    def __init__(self, config: JambaDims):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(JambaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.final_layernorm(hidden)


class JambaForCausalLM(CausalLM):
    def __init__(self, config: JambaDims):
        super().__init__(config)
        self.model = JambaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens
