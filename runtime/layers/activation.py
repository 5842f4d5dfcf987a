"""The activations config.json names (`hidden_act`), as HF's ACT2FN computes them."""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

from runtime.hf_config import ConfigError


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "relu2": relu2,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ConfigError(f"unknown activation {name!r} in config.json; Tandem knows {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]
