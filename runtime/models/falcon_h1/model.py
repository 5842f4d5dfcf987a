"""Falcon-H1: attention and a Mamba-2 mixer side by side in every layer, with muP multipliers.

Each layer holds a PagedAttention and a Mamba2Mixer under the same layer index, so the pool
gives it both a KV page table and a state page. Every multiplier is applied where HF's
FalconH1 modeling applies it, in the same order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.kernels.common import NO_DT_LIMIT
from runtime.layers.activation import activation
from runtime.layers.mamba2 import Mamba2Mixer
from runtime.layers.norm import RMSNorm
from runtime.layers.rotary import RotaryEmbedding, apply_rotary
from runtime.models.bamba.model import bamba_mixer
from runtime.models.causal_lm import CausalLM, head_dtype
from runtime.models.falcon_h1.declaration import FalconH1Dims
from runtime.models.llama.model import SelfAttention


class SiluGate(nn.Module):
    """y * silu(z): Falcon-H1's mixer output when `mamba_rms_norm` is off (HF keeps an Identity norm)."""

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return y * F.silu(z)


class FalconGatedRMSNorm(nn.Module):
    """HF's FalconH1RMSNormGated: grouped RMS norm with the weight applied in float32, gated after
    the norm (`norm_before_gate`, the default) or before it."""

    def __init__(self, hidden_size: int, n_groups: int, eps: float, norm_before_gate: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.n_groups, self.eps, self.norm_before_gate = n_groups, eps, norm_before_gate

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        h = y if self.norm_before_gate else y * F.silu(z.float())
        groups = h.float().unflatten(-1, (self.n_groups, -1))
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        h = (self.weight.view(self.n_groups, -1) * groups).flatten(-2)
        if self.norm_before_gate:
            h = h * F.silu(z.float())
        return h.to(dtype)


def mup_vector(config: FalconH1Dims, d_inner: int) -> torch.Tensor:
    """One multiplier per in_proj channel: ssm_multipliers over (z, x, B, C, dt), as HF's compute_mup_vector."""
    group_state = config.mamba_n_groups * config.mamba_d_state
    sizes = [d_inner, d_inner, group_state, group_state, config.mamba_n_heads]
    multipliers = config.ssm_multipliers
    assert len(multipliers) == len(sizes), "ssm_multipliers has one entry for each of z, x, B, C, dt"
    return torch.cat([torch.full((size,), float(m)) for size, m in zip(sizes, multipliers)])


def falcon_mixer(config: FalconH1Dims, layer_idx: int) -> Mamba2Mixer:
    if config.hidden_act != "silu":
        raise ValueError(
            f"Falcon-H1 with hidden_act={config.hidden_act!r}: the Mamba convolution applies hidden_act, and "
            "the engine's conv kernels implement silu only; use a checkpoint with hidden_act='silu'"
        )
    d_inner = int(config.mamba_expand * config.hidden_size) if config.mamba_d_ssm is None else config.mamba_d_ssm
    if config.mamba_rms_norm:
        norm = FalconGatedRMSNorm(d_inner, config.mamba_n_groups, config.rms_norm_eps, config.mamba_norm_before_gate)
    else:
        norm = SiluGate()
    return bamba_mixer(
        config,
        layer_idx,
        d_inner,
        decode_dt_limit=NO_DT_LIMIT,
        out_proj_bias=config.projectors_bias,
        in_proj_multipliers=mup_vector(config, d_inner),
        norm=norm,
    )


class FalconH1Attention(SelfAttention):
    """Llama attention whose keys are scaled by `key_multiplier` before the rotary embedding."""

    def __init__(self, config: FalconH1Dims, layer_idx: int):
        super().__init__(config, layer_idx)
        self.key_multiplier = config.key_multiplier

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(hidden).view(-1, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(-1, self.num_kv_heads, self.head_dim) * self.key_multiplier
        v = self.v_proj(hidden).view(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v))


class FalconH1MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool,
                 multipliers: tuple[float, float]):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = activation(act)
        self.gate_multiplier, self.down_multiplier = multipliers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.up_proj(x) * self.act_fn(self.gate_proj(x) * self.gate_multiplier)
        return self.down_proj(y) * self.down_multiplier


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, config: FalconH1Dims, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mamba = falcon_mixer(config, layer_idx)
        self.self_attn = FalconH1Attention(config, layer_idx)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = FalconH1MLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                                        config.mlp_bias, tuple(config.mlp_multipliers))
        self.ssm_in_multiplier = config.ssm_in_multiplier
        self.ssm_out_multiplier = config.ssm_out_multiplier
        self.attention_in_multiplier = config.attention_in_multiplier
        self.attention_out_multiplier = config.attention_out_multiplier

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        mamba = self.mamba(normed * self.ssm_in_multiplier) * self.ssm_out_multiplier
        attention = self.self_attn(normed * self.attention_in_multiplier, cos, sin) * self.attention_out_multiplier
        hidden = hidden + (mamba + attention)
        return hidden + self.feed_forward(self.pre_ff_layernorm(hidden))


class FalconH1Model(nn.Module):
    def __init__(self, config: FalconH1Dims):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(FalconH1DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.rope)
        self.embedding_multiplier = config.embedding_multiplier

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.embedding_multiplier
        cos, sin = self.rotary(positions, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return self.final_layernorm(hidden)


class FalconH1ForCausalLM(CausalLM):
    def __init__(self, config: FalconH1Dims):
        super().__init__(config)
        self.model = FalconH1Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head_multiplier = config.lm_head_multiplier

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # HF scales in the model dtype, before the logits are widened.
        return (self.lm_head(hidden.to(head_dtype(self.lm_head))) * self.lm_head_multiplier).float()

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens
