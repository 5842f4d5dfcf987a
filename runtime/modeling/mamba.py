from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from runtime.layers.mamba1 import Mamba1Mixer
from runtime.layers.norm import RMSNorm
from runtime.modeling.base import CausalLM

# The conv kernels apply SiLU; HF's Mamba-1 mixers take the conv activation from hidden_act.
CONV_ACTIVATIONS = ("silu", "swish")


def check_conv_activation(config: PretrainedConfig) -> None:
    if config.hidden_act not in CONV_ACTIVATIONS:
        raise ValueError(
            f"{type(config).__name__}: hidden_act={config.hidden_act!r} is not supported by the Mamba-1 conv; "
            f"Tandem runs {' or '.join(CONV_ACTIVATIONS)} (the value every published checkpoint uses)"
        )


def mamba1_mixer(config: PretrainedConfig, layer_idx: int) -> Mamba1Mixer:
    check_conv_activation(config)
    return Mamba1Mixer(
        layer_idx,
        hidden_size=config.hidden_size,
        d_inner=config.intermediate_size,
        d_state=config.state_size,
        d_conv=config.conv_kernel,
        dt_rank=int(config.time_step_rank),
        conv_bias=config.use_conv_bias,
        proj_bias=config.use_bias,
    )


class MambaBlock(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int):
        super().__init__()
        self.residual_in_fp32 = config.residual_in_fp32
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.mixer = mamba1_mixer(config, layer_idx)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        residual = hidden.float() if self.residual_in_fp32 else hidden
        # HF keeps the residual stream in float32 when asked; the mixer runs in the model dtype.
        return residual + self.mixer(self.norm(hidden.to(self.norm.weight.dtype)))


class MambaModel(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MambaBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(input_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.norm_f(hidden)


class MambaForCausalLM(CausalLM):
    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.backbone = MambaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.backbone(input_ids)

    def input_embeddings(self) -> nn.Embedding:
        return self.backbone.embeddings

    def checkpoint_name(self, name: str) -> str | None:
        # Checkpoints converted from mamba_ssm spell the embedding "embedding" (HF renames it on load too).
        return super().checkpoint_name(name.replace("backbone.embedding.", "backbone.embeddings."))
