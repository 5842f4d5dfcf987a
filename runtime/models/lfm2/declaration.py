from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.hf_config import ConfigError, HFConfig
from runtime.models.common import ON_ENGINE, capabilities
from runtime.models.dims import RopeDims, read_rope
from runtime.models.granitemoehybrid.declaration import layers_from_types
from runtime.models.interface import AttentionShape, LayerKind, ModelDeclaration, supported
from runtime.models.shapes import attention_shape

LAYER_TYPES = {"conv": LayerKind.SHORT_CONV, "full_attention": LayerKind.ATTENTION, "attention": LayerKind.ATTENTION}
# transformers' Lfm2Config defaults for the fields the declaration reads.
LFM2_DEFAULTS = {
    "vocab_size": 65536, "hidden_size": 2560, "intermediate_size": 12288, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "norm_eps": 1e-5, "tie_word_embeddings": True,
    "conv_bias": False, "conv_L_cache": 3, "block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0,
    "block_auto_adjust_ff_dim": True, "rope_theta": 1_000_000.0,
}


@dataclass(frozen=True)
class Lfm2Dims:
    """Everything the LFM2 torch module is built from, read once from config.json."""

    vocab_size: int
    hidden_size: int
    layers: tuple[LayerKind, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the MLP's real width, after LFM2's auto-adjustment
    norm_eps: float
    conv_width: int
    conv_bias: bool
    rope: RopeDims
    tie_word_embeddings: bool


def mlp_width(cfg: HFConfig) -> int:
    """Lfm2MLP's width: 2/3 of intermediate_size, times the multiplier, rounded up to block_multiple_of."""
    width = cfg.positive_int("intermediate_size")
    if not cfg.block_auto_adjust_ff_dim:
        return width
    width = int(2 * width / 3)
    if cfg.first("block_ffn_dim_multiplier") is not None:
        multiple = cfg.positive_int("block_multiple_of")
        width = int(cfg.block_ffn_dim_multiplier * width)
        width = multiple * -(-width // multiple)
    return width


class Lfm2ForCausalLM(ModelDeclaration):
    """Gated short-convolution layers with a few attention layers."""

    architecture = "Lfm2ForCausalLM"
    model_name = "LFM2"
    example_models = ("LiquidAI/LFM2-700M", "LiquidAI/LFM2-1.2B")
    layer_kinds = frozenset({LayerKind.ATTENTION, LayerKind.SHORT_CONV})
    state_name = "short-conv state"
    capabilities = capabilities(ON_ENGINE, chunked_prefill=supported(), prefix_caching=supported(),
                                tensor_parallel=supported(),
                                pipeline_parallel=supported(), lora=supported())
    implementation = "runtime.models.lfm2.model:Lfm2ForCausalLM"
    quantizations = ("gguf",)
    defaults = LFM2_DEFAULTS

    @classmethod
    def translate_legacy(cls, raw: dict[str, Any]) -> dict[str, Any]:
        # Early LFM2 configs list the attention layers (full_attn_idxs) instead of every layer's type,
        # and spell two keys as transformers still accepts them.
        if raw.get("layer_types") is None and raw.get("full_attn_idxs") is not None:
            attention = set(raw["full_attn_idxs"])
            raw["layer_types"] = [
                "full_attention" if i in attention else "conv" for i in range(raw.get("num_hidden_layers", 0))
            ]
        for legacy, current in (("block_ff_dim", "intermediate_size"), ("tie_embedding", "tie_word_embeddings")):
            if legacy in raw:
                raw[current] = raw.pop(legacy)
        return raw

    @classmethod
    def layout(cls, cfg: HFConfig) -> tuple[LayerKind, ...]:
        if cfg.first("layer_types") is None:
            raise ConfigError(f"{cls.architecture}: config.json needs layer_types or full_attn_idxs")
        return layers_from_types(cfg, "layer_types", LAYER_TYPES)

    @classmethod
    def attention_shape(cls, cfg: HFConfig, tp: int) -> AttentionShape:
        return attention_shape(cfg, tp)

    @classmethod
    def mamba_state_shape(cls, cfg: HFConfig, tp: int) -> tuple[tuple[int, ...], ...]:
        hidden = cfg.positive_int("hidden_size")
        if hidden % tp:
            raise ConfigError(f"{cls.architecture}: hidden_size={hidden} is not divisible by tensor_parallel_size={tp}")
        return ((cfg.positive_int("conv_L_cache") - 1, hidden // tp),)

    @classmethod
    def dims(cls, cfg: HFConfig) -> Lfm2Dims:
        attention = attention_shape(cfg, 1)
        return Lfm2Dims(
            vocab_size=cfg.positive_int("vocab_size"),
            hidden_size=cfg.positive_int("hidden_size"),
            layers=cls.layout(cfg),
            num_heads=cfg.positive_int("num_attention_heads"),
            num_kv_heads=attention.num_kv_heads,
            head_dim=attention.head_size,
            intermediate_size=mlp_width(cfg),
            norm_eps=float(cfg.norm_eps),
            conv_width=cfg.positive_int("conv_L_cache"),
            conv_bias=bool(cfg.conv_bias),
            rope=read_rope(cfg, attention.head_size),
            tie_word_embeddings=bool(cfg.tie_word_embeddings),
        )
