from __future__ import annotations

import torch
from torch import nn

from runtime.layers.mamba2 import Mamba2Mixer
from runtime.layers.mlp import GatedMLP
from runtime.layers.norm import RMSNorm
from runtime.layers.rotary import RotaryEmbedding
from runtime.models.bamba.declaration import Mamba2HybridDims
from runtime.models.causal_lm import CausalLM
from runtime.models.llama.model import SelfAttention


def bamba_mixer(config: Mamba2HybridDims, layer_idx: int, d_inner: int | None = None, **options) -> Mamba2Mixer:
    """The Mamba-2 mixer from the `mamba_*` keys Bamba, Granite 4.0-H and Falcon-H1 share; `options` are
    Mamba2Mixer's optional arguments (Falcon-H1's multipliers and norm)."""
    if d_inner is None:
        d_inner = int(config.mamba_expand * config.hidden_size)
    return Mamba2Mixer(
        layer_idx,
        hidden_size=config.hidden_size,
        d_inner=d_inner,
        num_heads=config.mamba_n_heads,
        head_dim=config.mamba_d_head,
        n_groups=config.mamba_n_groups,
        d_state=config.mamba_d_state,
        d_conv=config.mamba_d_conv,
        conv_bias=config.mamba_conv_bias,
        proj_bias=config.mamba_proj_bias,
        eps=config.rms_norm_eps,
        dt_limit=config.time_step_limit,
        **options,
    )


class BambaDecoderLayer(nn.Module):
    def __init__(self, config: Mamba2HybridDims, layer_idx: int, is_attention: bool):
        super().__init__()
        self.is_attention = is_attention
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if is_attention:
            self.self_attn = SelfAttention(config, layer_idx)
        else:
            self.mamba = bamba_mixer(config, layer_idx)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                                     config.mlp_bias)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        hidden = hidden + (self.self_attn(normed, cos, sin) if self.is_attention else self.mamba(normed))
        return hidden + self.feed_forward(self.pre_ff_layernorm(hidden))


class BambaModel(nn.Module):
    def __init__(self, config: Mamba2HybridDims):
        super().__init__()
        attention = set(config.attn_layer_indices)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            BambaDecoderLayer(config, i, i in attention) for i in range(config.num_hidden_layers)
        )
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.rope)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return self.final_layernorm(hidden)


class BambaForCausalLM(CausalLM):
    def __init__(self, config: Mamba2HybridDims):
        super().__init__(config)
        self.model = BambaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens
