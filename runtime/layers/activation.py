"""The activations config.json names (`hidden_act`), as HF's ACT2FN computes them."""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

from runtime import kernels
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


def gated(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """act(gate) * up for the named activation: SiLU's through the silu_and_mul op (one pass over both,
    where the backend fuses it), any other as two ops."""
    act = activation(name)
    if act is F.silu:
        return _silu_and_mul
    return lambda gate, up: act(gate) * up


def _silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    size = gate.shape[-1]
    return kernels.silu_and_mul(gate.reshape(-1, size), up.reshape(-1, size)).view(gate.shape)
