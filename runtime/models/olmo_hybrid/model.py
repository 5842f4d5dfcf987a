from __future__ import annotations

import torch
from torch import nn

from runtime.layers.attention import PagedAttention
from runtime.layers.gated_deltanet import OlmoHybridGatedDeltaNet
from runtime.layers.mlp import GatedMLP
from runtime.layers.rotary import RotaryEmbedding, apply_rotary
from runtime.models.causal_lm import CausalLM
from runtime.models.interface import LayerKind
from runtime.models.olmo_hybrid.declaration import OlmoHybridDims


class OlmoRMSNorm(nn.Module):
    """HF's OlmoHybridRMSNorm: normalise and scale in float32, then cast back."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


class OlmoHybridAttention(nn.Module):
    """OLMo-3 attention: RMS norms over the whole q and k projections (not per head), then rotary (or none)."""

    def __init__(self, dims: OlmoHybridDims, layer_idx: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = dims.num_heads, dims.num_kv_heads, dims.head_dim
        hidden, bias = dims.hidden_size, dims.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = OlmoRMSNorm(self.num_heads * self.head_dim, dims.rms_norm_eps)
        self.k_norm = OlmoRMSNorm(self.num_kv_heads * self.head_dim, dims.rms_norm_eps)
        self.attn = PagedAttention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        q = self.q_norm(self.q_proj(hidden)).view(-1, self.num_heads, self.head_dim)
        k = self.k_norm(self.k_proj(hidden)).view(-1, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(-1, self.num_kv_heads, self.head_dim)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        return self.o_proj(self.attn(q, k, v))


class OlmoHybridDecoderLayer(nn.Module):
    """Attention layers norm their outputs (OLMo-2 style); Gated DeltaNet layers norm their inputs. The norms
    keep the checkpoint's names: an attention layer's norm of its attention output is `feedforward_layer_norm`
    there too (HF renames it post_attention_layernorm on load)."""

    def __init__(self, dims: OlmoHybridDims, layer_idx: int):
        super().__init__()
        hidden, eps = dims.hidden_size, dims.rms_norm_eps
        self.is_attention = dims.layers[layer_idx] is LayerKind.ATTENTION
        if self.is_attention:
            self.self_attn = OlmoHybridAttention(dims, layer_idx)
            self.post_feedforward_layernorm = OlmoRMSNorm(hidden, eps)
        else:
            self.linear_attn = OlmoHybridGatedDeltaNet(
                layer_idx, hidden_size=hidden, num_k_heads=dims.linear_num_key_heads,
                num_v_heads=dims.linear_num_value_heads, head_k_dim=dims.linear_key_head_dim,
                head_v_dim=dims.linear_value_head_dim, conv_width=dims.linear_conv_kernel_dim, eps=eps,
            )
            if not dims.linear_allow_neg_eigval:
                self.linear_attn.beta_scale = 1.0
            self.attention_layer_norm = OlmoRMSNorm(hidden, eps)
        self.feedforward_layer_norm = OlmoRMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, dims.intermediate_size, dims.hidden_act)

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        if self.is_attention:
            hidden = hidden + self.feedforward_layer_norm(self.self_attn(hidden, rope))
            return hidden + self.post_feedforward_layernorm(self.mlp(hidden))
        hidden = hidden + self.linear_attn(self.attention_layer_norm(hidden))
        return hidden + self.mlp(self.feedforward_layer_norm(hidden))


class OlmoHybridModel(nn.Module):
    def __init__(self, dims: OlmoHybridDims):
        super().__init__()
        self.embed_tokens = nn.Embedding(dims.vocab_size, dims.hidden_size)
        self.layers = nn.ModuleList(OlmoHybridDecoderLayer(dims, i) for i in range(len(dims.layers)))
        self.norm = OlmoRMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.rotary = RotaryEmbedding(dims.rope) if dims.rope is not None else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary(positions, hidden.dtype) if self.rotary is not None else None
        for layer in self.layers:
            hidden = layer(hidden, rope)
        return self.norm(hidden)


class OlmoHybridForCausalLM(CausalLM):
    def __init__(self, dims: OlmoHybridDims):
        super().__init__(dims)
        self.model = OlmoHybridModel(dims)
        self.lm_head = nn.Linear(dims.hidden_size, dims.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens
