from __future__ import annotations

from typing import Any

import torch
from torch import nn


def head_dtype(head: nn.Module) -> torch.dtype:
    """The type an LM head multiplies its input in: a packed one's own (which may keep no `weight`), else its
    weight's."""
    return getattr(head, "input_dtype", None) or head.weight.dtype


class CausalLM(nn.Module):
    """What the model runner needs from every implementation."""

    def __init__(self, config: Any):
        super().__init__()
        self.config = config  # the declaration's frozen dims

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: (T,) packed tokens of this step -> hidden states (T, hidden_size)."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden.to(head_dtype(self.lm_head))).float()

    def input_embeddings(self) -> nn.Embedding:
        raise NotImplementedError

    def tie_weights(self) -> None:
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.input_embeddings().weight

    def checkpoint_name(self, name: str) -> str | None:
        """The parameter a checkpoint tensor loads into, or None to skip it."""
        if name == "lm_head.weight" and getattr(self.config, "tie_word_embeddings", False):
            return None
        return name
