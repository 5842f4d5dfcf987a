"""Frozen dimension objects: what a model's modules and its cache are built from, read once from config.json.

Each declaration defines a frozen dataclass whose fields are the config keys its modules read, with
transformers' defaults as field defaults; `read_dims` fills it from the declaration's reading of
config.json (legacy spellings already translated). No torch, no transformers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

from runtime.hf_config import ConfigError, HFConfig

D = TypeVar("D")


def _frozen(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


def _check_type(cfg: HFConfig, name: str, annotation: str, value: Any) -> None:
    if annotation == "int" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ConfigError(f"{cfg.architecture}: {name} must be a non-negative integer, got {value!r}")
    if annotation == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(f"{cfg.architecture}: {name} must be a number, got {value!r}")
    if annotation == "bool" and not isinstance(value, bool):
        raise ConfigError(f"{cfg.architecture}: {name} must be true or false, got {value!r}")


def read_dims(cls: type[D], cfg: HFConfig, **derived: Any) -> D:
    """cls filled from cfg: a key absent or null takes the field's default; `derived` wins over both."""
    values = {}
    for field in dataclasses.fields(cls):
        if field.name in derived:
            values[field.name] = derived[field.name]
        elif cfg.first(field.name) is not None:
            values[field.name] = _frozen(cfg[field.name])
            _check_type(cfg, field.name, str(field.type), values[field.name])
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{cfg.architecture}: config.json has no {field.name!r}")
    return cls(**values)


ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


@dataclass(frozen=True)
class RopeDims:
    """Rotary embedding parameters, from `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling`."""

    head_dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    partial_rotary_factor: float = 1.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


def read_rope(cfg: HFConfig, head_dim: int, partial_rotary_factor: float | None = None) -> RopeDims:
    """`partial_rotary_factor` forces a factor the architecture fixes (Bamba rotates half of each head)."""
    params = {**(cfg.first("rope_scaling") or {}), **(cfg.first("rope_parameters") or {})}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"{cfg.architecture}: rope type {rope_type!r} is not supported; Tandem has {', '.join(ROPE_TYPES)}"
        )
    factor = partial_rotary_factor or params.get("partial_rotary_factor",
                                                 cfg.first("partial_rotary_factor", default=1.0))
    scaling = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    extra = {k: v for k, v in params.items() if k in scaling}
    return RopeDims(head_dim=head_dim, theta=params.get("rope_theta", cfg.first("rope_theta", default=10000.0)),
                    rope_type="default" if rope_type == "dynamic" else rope_type,
                    partial_rotary_factor=factor, **extra)


@dataclass(frozen=True)
class AttentionDims:
    """The fields the shared attention block (runtime.models.llama.model.SelfAttention) reads.

    num_key_value_heads, head_dim and rope are always derived (see `attention_fields`).
    """

    hidden_size: int = 4096
    vocab_size: int = 32000
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 0
    head_dim: int = 0
    rope: RopeDims | None = None
    attention_bias: bool = False
    attention_multiplier: float | None = None  # None: 1/sqrt(head_dim)
    tie_word_embeddings: bool = False


def attention_fields(cfg: HFConfig, defaults: dict[str, Any], partial_rotary_factor: float | None = None,
                     rope: bool = True) -> dict[str, Any]:
    """num_key_value_heads (default: one per head), head_dim (default: hidden / heads) and the rope."""
    heads = cfg.first("num_attention_heads", default=defaults.get("num_attention_heads", 32))
    hidden = cfg.first("hidden_size", default=defaults.get("hidden_size", 4096))
    head_dim = cfg.first("head_dim", default=hidden // heads)
    return {"num_key_value_heads": cfg.first("num_key_value_heads", default=heads), "head_dim": head_dim,
            "rope": read_rope(cfg, head_dim, partial_rotary_factor) if rope else None}
