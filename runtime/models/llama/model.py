from __future__ import annotations

import torch
from torch import nn

from runtime.layers.attention import PagedAttention
from runtime.layers.mlp import GatedMLP
from runtime.layers.norm import RMSNorm
from runtime.layers.rotary import RotaryEmbedding, apply_rotary
from runtime.models.causal_lm import CausalLM
from runtime.models.llama.declaration import LlamaDims


class SelfAttention(nn.Module):
    """q/k/v/o projections with rotary embeddings (Llama's names), over paged attention."""

    def __init__(self, config: LlamaDims, layer_idx: int, scale: float | None = None):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        scale = self.head_dim**-0.5 if scale is None else scale
        self.attn = PagedAttention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim, scale)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        q = self.q_proj(hidden).view(-1, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(-1, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(-1, self.num_kv_heads, self.head_dim)
        if cos is not None:  # None: no position embedding (Jamba, Granite 4.0-H "nope")
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaDims, layer_idx: int):
        super().__init__()
        scale = config.attention_multiplier  # Granite replaces 1/sqrt(head_dim)
        self.residual_multiplier = config.residual_multiplier
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, layer_idx, scale)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden = hidden + scaled(self.self_attn(self.input_layernorm(hidden), cos, sin), self.residual_multiplier)
        return hidden + scaled(self.mlp(self.post_attention_layernorm(hidden)), self.residual_multiplier)


def scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    """x * factor; Llama's factors are 1 (Granite's are not), and x * 1 is x: a pass over it saved."""
    return x if factor == 1.0 else x * factor


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaDims):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.rope)
        self.embedding_multiplier = config.embedding_multiplier

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = scaled(self.embed_tokens(input_ids), self.embedding_multiplier)
        cos, sin = self.rotary(positions, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return self.norm(hidden)


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: LlamaDims):
        super().__init__(config)
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logits_scaling = config.logits_scaling

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        return logits if self.logits_scaling == 1.0 else logits / self.logits_scaling

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens


class GraniteForCausalLM(LlamaForCausalLM):
    """Llama with Granite's embedding, attention, residual and logits multipliers (read from the config)."""
