from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from runtime.layers.attention import PagedAttention
from runtime.layers.norm import RMSNorm
from runtime.layers.rotary import RotaryEmbedding, apply_rotary
from runtime.layers.short_conv import ShortConv
from runtime.models.causal_lm import CausalLM
from runtime.models.interface import LayerKind
from runtime.models.lfm2.declaration import Lfm2Dims


class Lfm2Attention(nn.Module):
    """q/k/v projections with per-head RMS norms on q and k, rotary embeddings, paged attention, out_proj."""

    def __init__(self, dims: Lfm2Dims, layer_idx: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = dims.num_heads, dims.num_kv_heads, dims.head_dim
        hidden = dims.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.out_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_layernorm = RMSNorm(self.head_dim, dims.norm_eps)
        self.k_layernorm = RMSNorm(self.head_dim, dims.norm_eps)
        self.attn = PagedAttention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self.q_layernorm(self.q_proj(hidden).view(-1, self.num_heads, self.head_dim))
        k = self.k_layernorm(self.k_proj(hidden).view(-1, self.num_kv_heads, self.head_dim))
        v = self.v_proj(hidden).view(-1, self.num_kv_heads, self.head_dim)
        return self.out_proj(self.attn(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v))


class Lfm2MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, dims: Lfm2Dims, layer_idx: int, feed_forward: nn.Module):
        super().__init__()
        self.is_attention = dims.layers[layer_idx] is LayerKind.ATTENTION
        if self.is_attention:
            self.self_attn = Lfm2Attention(dims, layer_idx)
        else:
            self.conv = ShortConv(layer_idx, hidden_size=dims.hidden_size, width=dims.conv_width, bias=dims.conv_bias)
        self.feed_forward = feed_forward
        self.operator_norm = RMSNorm(dims.hidden_size, dims.norm_eps)
        self.ffn_norm = RMSNorm(dims.hidden_size, dims.norm_eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        normed = self.operator_norm(hidden)
        hidden = hidden + (self.self_attn(normed, cos, sin) if self.is_attention else self.conv(normed))
        return hidden + self.feed_forward(self.ffn_norm(hidden))


def dense_feed_forward(dims: Lfm2Dims, layer_idx: int) -> nn.Module:
    return Lfm2MLP(dims.hidden_size, dims.intermediate_size)


class Lfm2Model(nn.Module):
    def __init__(self, dims: Lfm2Dims, feed_forward: Callable[[Lfm2Dims, int], nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(dims.vocab_size, dims.hidden_size)
        self.layers = nn.ModuleList(Lfm2DecoderLayer(dims, i, feed_forward(dims, i)) for i in range(len(dims.layers)))
        # HF names the final norm embedding_norm.
        self.embedding_norm = RMSNorm(dims.hidden_size, dims.norm_eps)
        self.rotary = RotaryEmbedding(dims.rope)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return self.embedding_norm(hidden)


class Lfm2ForCausalLM(CausalLM):
    def __init__(self, dims: Lfm2Dims, feed_forward: Callable[[Lfm2Dims, int], nn.Module] = dense_feed_forward):
        """feed_forward(dims, layer_idx) builds each layer's feed-forward block (LFM2-MoE: MLP or experts)."""
        super().__init__(dims)
        self.model = Lfm2Model(dims, feed_forward)
        self.lm_head = nn.Linear(dims.hidden_size, dims.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens
