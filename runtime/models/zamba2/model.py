"""Zamba2: Mamba-2 layers, some of which first apply a shared attention block.

The shared block (HF's Zamba2AttentionDecoderLayer) attends over [hidden, original embedding],
twice the hidden width. `num_mem_blocks` such blocks take turns over the hybrid layers: the
i-th application uses block i % num_mem_blocks, its own LoRA-like adapters (stored inside that
block, at index i) and its own KV cache, held by a PagedAttention in the hybrid layer. Each
shared block is one module registered in every hybrid layer that applies it, so its parameters
carry the name of the first one: `model.layers.{first}.shared_transformer.*`, which is where
save_pretrained writes the block, once.
"""

from __future__ import annotations

import re
from typing import Callable

import torch
from torch import nn

from runtime.kernels.common import NO_DT_LIMIT
from runtime.layers.activation import activation
from runtime.layers.attention import PagedAttention
from runtime.layers.mamba2 import Mamba2Mixer
from runtime.layers.norm import RMSNorm
from runtime.layers.rotary import RotaryEmbedding, apply_rotary
from runtime.models.causal_lm import CausalLM
from runtime.models.zamba2.declaration import Zamba2Dims

SHARED_BLOCK_NAME = re.compile(r"^model\.layers\.(\d+)\.shared_transformer\.")


def low_rank(in_features: int, rank: int, out_features: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(in_features, rank, bias=False), nn.Linear(rank, out_features, bias=False))


def adapter_list(block_id: int, num_blocks: int, num_applications: int,
                 make: Callable[[], nn.Module]) -> nn.ModuleList:
    """Adapters for the applications this block serves; placeholders keep HF's indices for the others."""
    return nn.ModuleList(make() if i % num_blocks == block_id else nn.Identity() for i in range(num_applications))


class Zamba2MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool, adapters: nn.ModuleList):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = activation(act)
        self.gate_up_proj_adapter_list = adapters

    def forward(self, x: torch.Tensor, application: int) -> torch.Tensor:
        gate_up = self.gate_up_proj(x) + self.gate_up_proj_adapter_list[application](x)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


class Zamba2Attention(nn.Module):
    """The shared projections; the caller passes the application's index and its PagedAttention."""

    def __init__(self, config: Zamba2Dims, block_id: int, num_applications: int):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.attention_head_dim
        width = config.attention_hidden_size  # 2 x hidden: [hidden, original embedding]
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.use_adapters = config.use_shared_attention_adapter
        self.use_rope = config.use_mem_rope
        if self.use_adapters:
            if self.num_kv_heads != self.num_heads:
                # HF's adapters output attention_hidden_size channels for q, k and v alike (its forward fails too).
                raise ValueError(
                    f"Zamba2 with use_shared_attention_adapter needs num_key_value_heads == num_attention_heads "
                    f"({self.num_kv_heads} != {self.num_heads}); fix config.json"
                )

            def make() -> nn.Sequential:
                return low_rank(width, config.adapter_rank, width)

            self.linear_q_adapter_list = adapter_list(block_id, config.num_mem_blocks, num_applications, make)
            self.linear_k_adapter_list = adapter_list(block_id, config.num_mem_blocks, num_applications, make)
            self.linear_v_adapter_list = adapter_list(block_id, config.num_mem_blocks, num_applications, make)

    def forward(self, x: torch.Tensor, application: int, attn: PagedAttention, cos: torch.Tensor | None,
                sin: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.use_adapters:
            q = q + self.linear_q_adapter_list[application](x)
            k = k + self.linear_k_adapter_list[application](x)
            v = v + self.linear_v_adapter_list[application](x)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.use_rope:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(attn(q, k, v))


class Zamba2SharedBlock(nn.Module):
    """HF's Zamba2AttentionDecoderLayer: norm([hidden, embedding]) -> attention -> norm -> MLP, no residual."""

    def __init__(self, config: Zamba2Dims, block_id: int, num_applications: int):
        super().__init__()
        hidden, rank = config.hidden_size, config.adapter_rank
        self.input_layernorm = RMSNorm(config.attention_hidden_size, config.rms_norm_eps)
        self.self_attn = Zamba2Attention(config, block_id, num_applications)
        self.pre_ff_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        mlp_adapters = adapter_list(block_id, config.num_mem_blocks, num_applications,
                                    lambda: low_rank(hidden, rank, 2 * config.intermediate_size))
        self.feed_forward = Zamba2MLP(hidden, config.intermediate_size, config.hidden_act, config.add_bias_linear,
                                      mlp_adapters)

    def forward(self, hidden: torch.Tensor, original: torch.Tensor, application: int, attn: PagedAttention,
                cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        x = self.input_layernorm(torch.cat([hidden, original], dim=-1))
        x = self.self_attn(x, application, attn, cos, sin)
        return self.feed_forward(self.pre_ff_layernorm(x), application)


def zamba2_mixer(config: Zamba2Dims, layer_idx: int) -> Mamba2Mixer:
    d_inner = int(config.mamba_expand * config.hidden_size)
    return Mamba2Mixer(
        layer_idx,
        hidden_size=config.hidden_size,
        d_inner=d_inner,
        num_heads=config.n_mamba_heads,
        head_dim=config.mamba_headdim,
        n_groups=config.mamba_ngroups,
        d_state=config.mamba_d_state,
        d_conv=config.mamba_d_conv,
        conv_bias=True,  # HF's Zamba2 mixer always has one, whatever use_conv_bias says
        proj_bias=config.add_bias_linear,
        eps=1e-5,  # fixed in HF's mixer norm, not rms_norm_eps
        # HF's mixer clamps dt below at time_step_min in the scan only; its decode step never clamps.
        dt_limit=(config.time_step_min, float("inf")),
        decode_dt_limit=NO_DT_LIMIT,
    )


class Zamba2MambaLayer(nn.Module):
    """HF's Zamba2MambaDecoderLayer: the shared block's output joins the mixer input, not the residual."""

    def __init__(self, config: Zamba2Dims, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mamba = zamba2_mixer(config, layer_idx)

    def forward(self, hidden: torch.Tensor, transformer_out: torch.Tensor | None = None) -> torch.Tensor:
        x = hidden if transformer_out is None else hidden + transformer_out
        return hidden + self.mamba(self.input_layernorm(x))


class Zamba2HybridLayer(nn.Module):
    def __init__(self, config: Zamba2Dims, layer_idx: int, shared: Zamba2SharedBlock, application: int):
        super().__init__()
        self.shared_transformer = shared
        self.linear = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.mamba_decoder = Zamba2MambaLayer(config, layer_idx)
        self.application = application
        attention = shared.self_attn
        # This application's KV cache; the weights that fill it are shared. HF scales scores by
        # (head_dim / 2)^-1/2: the heads span [hidden, embedding], twice the width the scale assumes.
        self.attn = PagedAttention(layer_idx, attention.num_heads, attention.num_kv_heads, attention.head_dim,
                                   (attention.head_dim / 2) ** -0.5)

    def forward(self, hidden: torch.Tensor, original: torch.Tensor, cos: torch.Tensor | None,
                sin: torch.Tensor | None) -> torch.Tensor:
        shared = self.shared_transformer(hidden, original, self.application, self.attn, cos, sin)
        return self.mamba_decoder(hidden, self.linear(shared))


class Zamba2Model(nn.Module):
    def __init__(self, config: Zamba2Dims):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        hybrid = list(config.hybrid_layer_ids)
        blocks = [Zamba2SharedBlock(config, b, len(hybrid)) for b in range(min(config.num_mem_blocks, len(hybrid)))]
        self.layers = nn.ModuleList(
            Zamba2HybridLayer(config, i, blocks[hybrid.index(i) % len(blocks)], hybrid.index(i))
            if i in hybrid else Zamba2MambaLayer(config, i)
            for i in range(config.num_hidden_layers)
        )
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.rope) if config.use_mem_rope else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        original = hidden
        cos, sin = self.rotary(positions, hidden.dtype) if self.rotary is not None else (None, None)
        for layer in self.layers:
            if isinstance(layer, Zamba2HybridLayer):
                hidden = layer(hidden, original, cos, sin)
            else:
                hidden = layer(hidden)
        return self.final_layernorm(hidden)


class Zamba2ForCausalLM(CausalLM):
    # Every application of a shared block reads the embeddings: each pipeline stage computes them itself.
    embeds_every_stage = True

    def __init__(self, config: Zamba2Dims):
        super().__init__(config)
        self.model = Zamba2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        hybrid, num_blocks = list(config.hybrid_layer_ids), config.num_mem_blocks
        # Application i of the shared blocks loads from the layer that first applies block i % num_mem_blocks.
        self.shared_owner = {layer: hybrid[i % num_blocks] for i, layer in enumerate(hybrid)}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def checkpoint_name(self, name: str) -> str | None:
        # save_pretrained stores each shared block once; a checkpoint that repeats it under every hybrid
        # layer holds the same tensors, which load into the one block.
        match = SHARED_BLOCK_NAME.match(name)
        if match and int(match.group(1)) in self.shared_owner:
            owner = self.shared_owner[int(match.group(1))]
            name = f"model.layers.{owner}.shared_transformer." + name[match.end():]
        return super().checkpoint_name(name)
