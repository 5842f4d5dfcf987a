from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from runtime.layers.mamba2 import Mamba2Mixer
from runtime.layers.norm import RMSNorm
from runtime.modeling.base import CausalLM


def mamba2_mixer(config: PretrainedConfig, layer_idx: int, eps: float) -> Mamba2Mixer:
    return Mamba2Mixer(
        layer_idx,
        hidden_size=config.hidden_size,
        d_inner=int(config.expand * config.hidden_size),
        num_heads=config.num_heads,
        head_dim=config.head_dim,
        n_groups=config.n_groups,
        d_state=config.state_size,
        d_conv=config.conv_kernel,
        conv_bias=config.use_conv_bias,
        proj_bias=config.use_bias,
        eps=eps,
        dt_limit=tuple(config.time_step_limit),
    )


class Mamba2Block(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int):
        super().__init__()
        self.residual_in_fp32 = config.residual_in_fp32
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.mixer = mamba2_mixer(config, layer_idx, config.layer_norm_epsilon)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        residual = hidden.float() if self.residual_in_fp32 else hidden
        # HF keeps the residual stream in float32 when asked; the mixer runs in the model dtype.
        return residual + self.mixer(self.norm(hidden.to(self.norm.weight.dtype)))


class Mamba2Model(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Mamba2Block(config, i) for i in range(config.num_hidden_layers))
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(input_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.norm_f(hidden)


class Mamba2ForCausalLM(CausalLM):
    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.backbone = Mamba2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.backbone(input_ids)

    def input_embeddings(self) -> nn.Embedding:
        return self.backbone.embeddings

    def checkpoint_name(self, name: str) -> str | None:
        # Checkpoints converted from mamba_ssm spell the embedding "embedding".
        return super().checkpoint_name(name.replace("backbone.embedding.", "backbone.embeddings."))
