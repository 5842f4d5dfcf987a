from __future__ import annotations

import torch
from torch import nn

from runtime.layers.activation import gated
from runtime.layers.moe import TOPK_THEN_SOFTMAX, PackedMoE
from runtime.layers.norm import RMSNorm
from runtime.layers.rotary import RotaryEmbedding
from runtime.models.bamba.model import bamba_mixer
from runtime.models.causal_lm import CausalLM
from runtime.models.granitemoehybrid.declaration import GraniteMoeHybridDims
from runtime.models.llama.model import SelfAttention, scaled


class SharedMLP(nn.Module):
    """The always-active expert: `input_linear` holds gate then up, `output_linear` projects back."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str):
        super().__init__()
        self.input_linear = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.output_linear = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_and_mul = gated(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(self.act_and_mul(gate, up))


class GraniteMoeHybridDecoderLayer(nn.Module):
    def __init__(self, config: GraniteMoeHybridDims, layer_idx: int):
        super().__init__()
        self.is_attention = config.layers_block_type[layer_idx] != "linear_attention"
        self.residual_multiplier = config.residual_multiplier
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.is_attention:
            self.self_attn = SelfAttention(config, layer_idx, scale=config.attention_multiplier)
        else:
            self.mamba = bamba_mixer(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # num_local_experts=0 is a dense model: the shared MLP alone.
        self.block_sparse_moe = None
        if config.num_local_experts > 0:
            self.block_sparse_moe = PackedMoE(config.hidden_size, config.intermediate_size, config.num_local_experts,
                                              config.num_experts_per_tok, config.hidden_act, TOPK_THEN_SOFTMAX)
        self.shared_mlp = SharedMLP(config.hidden_size, config.shared_intermediate_size, config.hidden_act)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        mixed = self.self_attn(normed, cos, sin) if self.is_attention else self.mamba(normed)
        hidden = hidden + scaled(mixed, self.residual_multiplier)
        normed = self.post_attention_layernorm(hidden)
        ffn = self.shared_mlp(normed)
        if self.block_sparse_moe is not None:
            ffn = self.block_sparse_moe(normed) + ffn
        return hidden + scaled(ffn, self.residual_multiplier)


class GraniteMoeHybridModel(nn.Module):
    def __init__(self, config: GraniteMoeHybridDims):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            GraniteMoeHybridDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embedding_multiplier = config.embedding_multiplier
        # Any other position_embedding_type ("nope", None) means no position embedding, as in HF.
        self.rotary = None
        if config.position_embedding_type == "rope":
            self.rotary = RotaryEmbedding(config.rope)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = scaled(self.embed_tokens(input_ids), self.embedding_multiplier)
        cos, sin = self.rotary(positions, hidden.dtype) if self.rotary is not None else (None, None)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return self.norm(hidden)


class GraniteMoeHybridForCausalLM(CausalLM):
    def __init__(self, config: GraniteMoeHybridDims):
        super().__init__(config)
        self.model = GraniteMoeHybridModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logits_scaling = config.logits_scaling

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        return logits if self.logits_scaling == 1.0 else logits / self.logits_scaling

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens
