"""The `backbone.{embeddings, layers, norm_f}` + `lm_head` layout of HF's Mamba, Mamba-2 and Nemotron-H.

Each layer is one block: norm -> mixer -> residual; the models differ only in their mixers
and norms.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from runtime.models.causal_lm import CausalLM


class MixerBlock(nn.Module):
    def __init__(self, norm: nn.Module, mixer: nn.Module, residual_in_fp32: bool = False):
        super().__init__()
        self.residual_in_fp32 = residual_in_fp32
        self.norm = norm
        self.mixer = mixer

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.residual_in_fp32:
            return hidden + self.mixer(self.norm(hidden))
        # HF keeps the residual stream in float32 when asked; the mixer runs in the model dtype.
        return hidden.float() + self.mixer(self.norm(hidden.to(self.norm.weight.dtype)))


class Backbone(nn.Module):
    def __init__(self, config: Any, layers: Iterable[nn.Module], norm_f: nn.Module):
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm_f = norm_f

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(input_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.norm_f(hidden)


class BackboneForCausalLM(CausalLM):
    def __init__(self, config: Any, layers: Iterable[nn.Module], norm_f: nn.Module):
        super().__init__(config)
        self.backbone = Backbone(config, layers, norm_f)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.backbone(input_ids)

    def input_embeddings(self) -> nn.Embedding:
        return self.backbone.embeddings

    def checkpoint_name(self, name: str) -> str | None:
        # Checkpoints converted from mamba_ssm spell the embedding "embedding" (HF renames it on load too).
        return super().checkpoint_name(name.replace("backbone.embedding.", "backbone.embeddings."))
