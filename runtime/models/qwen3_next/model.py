from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from runtime.layers.gated_attention import GatedAttention, ZeroCenteredRMSNorm
from runtime.layers.gated_deltanet import Qwen3NextGatedDeltaNet
from runtime.layers.mlp import GatedMLP
from runtime.layers.moe import grouped_experts
from runtime.layers.rotary import RotaryEmbedding
from runtime.models.causal_lm import CausalLM
from runtime.models.interface import LayerKind
from runtime.models.qwen3_next.declaration import Qwen3NextDims


class Qwen3NextSparseMoeBlock(nn.Module):
    """Softmax router (`gate`), top-k experts (renormalised when norm_topk_prob), one gated MLP per expert
    (the checkpoint's `experts.N.*`), plus a shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, dims: Qwen3NextDims):
        super().__init__()
        hidden = dims.hidden_size
        self.num_experts, self.top_k = dims.num_experts, dims.num_experts_per_tok
        self.norm_topk_prob = dims.norm_topk_prob
        self.gate = nn.Linear(hidden, dims.num_experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(hidden, dims.moe_intermediate_size, dims.hidden_act)
                                     for _ in range(dims.num_experts))
        self.shared_expert = GatedMLP(hidden, dims.shared_expert_intermediate_size, dims.hidden_act)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        logits = self.gate(x)
        weights, ids = torch.softmax(logits, dim=-1, dtype=torch.float).topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        routed = grouped_experts(x, weights.to(logits.dtype), ids, self.num_experts,
                                 lambda e, rows: self.experts[e](rows))
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen3NextDecoderLayer(nn.Module):
    linear_attention = Qwen3NextGatedDeltaNet  # Qwen3.5 swaps in its own projection layout

    def __init__(self, dims: Qwen3NextDims, layer_idx: int):
        super().__init__()
        hidden = dims.hidden_size
        self.is_attention = dims.layers[layer_idx] is LayerKind.ATTENTION
        if self.is_attention:
            self.self_attn = GatedAttention(layer_idx, hidden_size=hidden, num_heads=dims.num_heads,
                                            num_kv_heads=dims.num_kv_heads, head_dim=dims.head_dim,
                                            eps=dims.rms_norm_eps, bias=dims.attention_bias)
        else:
            self.linear_attn = self.linear_attention(
                layer_idx, hidden_size=hidden, num_k_heads=dims.linear_num_key_heads,
                num_v_heads=dims.linear_num_value_heads, head_k_dim=dims.linear_key_head_dim,
                head_v_dim=dims.linear_value_head_dim, conv_width=dims.linear_conv_kernel_dim, eps=dims.rms_norm_eps,
            )
        moe = bool(dims.moe_layers) and dims.moe_layers[layer_idx]
        self.mlp = Qwen3NextSparseMoeBlock(dims) if moe else GatedMLP(hidden, dims.intermediate_size, dims.hidden_act)
        self.input_layernorm = ZeroCenteredRMSNorm(hidden, dims.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(hidden, dims.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        hidden = hidden + (self.self_attn(normed, cos, sin) if self.is_attention else self.linear_attn(normed))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen3NextModel(nn.Module):
    def __init__(self, dims: Qwen3NextDims, layer: type[Qwen3NextDecoderLayer]):
        super().__init__()
        self.embed_tokens = nn.Embedding(dims.vocab_size, dims.hidden_size)
        self.layers = nn.ModuleList(layer(dims, i) for i in range(len(dims.layers)))
        self.norm = ZeroCenteredRMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.rotary = RotaryEmbedding(dims.rope)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return self.norm(hidden)


class Qwen3NextForCausalLM(CausalLM):
    decoder_layer = Qwen3NextDecoderLayer

    def __init__(self, dims: Qwen3NextDims):
        super().__init__(dims)
        self.model = Qwen3NextModel(dims, self.decoder_layer)
        self.lm_head = nn.Linear(dims.hidden_size, dims.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def load_mtp_head(self, model_dir: Path, configured_layers: int | None, quant: Any = None) -> nn.Module:
        """The checkpoint's multi-token-prediction head, for speculative decoding (runtime/spec_decode/mtp.py);
        `quant`: the checkpoint's quantization (runtime.quant.config.CheckpointQuant), if it has one."""
        from runtime.models.qwen3_next.mtp import load_mtp_head

        return load_mtp_head(self, model_dir, configured_layers, quant)

    def checkpoint_name(self, name: str) -> str | None:
        # The multi-token-prediction head (`mtp.*`) is loaded by load_mtp_head only when it speculates (HF skips it).
        if name.startswith("mtp."):
            return None
        return super().checkpoint_name(name)

