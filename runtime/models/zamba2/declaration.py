from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.hf_config import ConfigError, HFConfig
from runtime.models.common import LORA_ZAMBA2, ON_ENGINE, capabilities
from runtime.models.dims import RopeDims, read_dims, read_rope
from runtime.models.granitemoehybrid.declaration import layers_from_types
from runtime.models.interface import AttentionShape, LayerKind, ModelDeclaration, supported
from runtime.models.shapes import kv_shape, mamba2_state_shape

LAYER_TYPES = {
    "mamba": LayerKind.MAMBA2,
    "linear_attention": LayerKind.MAMBA2,
    "hybrid": LayerKind.HYBRID,
}
# Zyphra's checkpoints before transformers 4.48 used other names for the same fields.
LEGACY_KEYS = {
    "state_size": "mamba_d_state",
    "conv_dimension": "mamba_d_conv",
    "expansion_factor": "mamba_expand",
    "ffn_hidden_size": "intermediate_size",
    "lora_rank": "adapter_rank",
    "use_shared_attention_lora": "use_shared_attention_adapter",
}


@dataclass(frozen=True)
class Zamba2Dims:
    """Zamba2Config's defaults; the fields after `rope` are derived as Zamba2Config derives them."""

    rope: RopeDims
    hybrid_layer_ids: tuple[int, ...]
    num_key_value_heads: int
    intermediate_size: int
    attention_hidden_size: int  # 2 x hidden: the shared block reads [hidden, original embedding]
    attention_head_dim: int
    mamba_headdim: int
    vocab_size: int = 32000
    hidden_size: int = 2560
    num_hidden_layers: int = 54
    num_attention_heads: int = 32
    hidden_act: str = "gelu"
    rms_norm_eps: float = 1e-5
    add_bias_linear: bool = False
    adapter_rank: int = 128
    num_mem_blocks: int = 1
    use_shared_attention_adapter: bool = False
    use_mem_rope: bool = False
    mamba_d_state: int = 64
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_ngroups: int = 1
    n_mamba_heads: int = 8
    time_step_min: float = 0.001
    tie_word_embeddings: bool = True


class Zamba2ForCausalLM(ModelDeclaration):
    """Mamba-2 layers; some also apply a shared attention block, each application with its own KV cache."""

    architecture = "Zamba2ForCausalLM"
    model_name = "Zamba2"
    example_models = ("Zyphra/Zamba2-1.2B", "Zyphra/Zamba2-2.7B-Instruct-v2")
    layer_kinds = frozenset({LayerKind.MAMBA2, LayerKind.HYBRID})
    capabilities = capabilities(ON_ENGINE, chunked_prefill=supported(), prefix_caching=supported(),
                                tensor_parallel=supported(),
                                pipeline_parallel=supported(), lora=LORA_ZAMBA2)
    implementation = "runtime.models.zamba2.model:Zamba2ForCausalLM"
    defaults = {
        "hidden_size": 2560,
        "num_hidden_layers": 54,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "mamba_d_state": 64,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_ngroups": 1,
        "n_mamba_heads": 8,
        "chunk_size": 256,
    }

    @classmethod
    def translate_legacy(cls, raw: dict[str, Any]) -> dict[str, Any]:
        for old, new in LEGACY_KEYS.items():
            if old in raw and new not in raw:
                raw[new] = raw.pop(old)
        types = raw.get("layers_block_type")
        if isinstance(types, list):
            raw["layers_block_type"] = [{"m": "mamba", "g": "hybrid"}.get(t, t) for t in types]
        if "mamba_headdim" in raw and "n_mamba_heads" not in raw:
            d_inner = raw.get("mamba_expand", 2) * raw.get("hidden_size", cls.defaults["hidden_size"])
            raw["n_mamba_heads"] = d_inner // raw["mamba_headdim"]
        return raw

    @classmethod
    def dims(cls, cfg: HFConfig) -> Zamba2Dims:
        hidden, heads = cfg.positive_int("hidden_size"), cfg.positive_int("num_attention_heads")
        return read_dims(
            Zamba2Dims, cfg,
            rope=read_rope(cfg, 2 * hidden // heads),  # rotates whole heads of the doubled width
            hybrid_layer_ids=tuple(i for i, kind in enumerate(cls.layout(cfg)) if kind is LayerKind.HYBRID),
            num_key_value_heads=cfg.first("num_key_value_heads", default=heads),
            intermediate_size=cfg.first("intermediate_size", default=4 * hidden),
            attention_hidden_size=2 * hidden,
            attention_head_dim=2 * hidden // heads,
            mamba_headdim=cfg.positive_int("mamba_expand") * hidden // cfg.positive_int("n_mamba_heads"),
        )

    @classmethod
    def layout(cls, cfg: HFConfig) -> tuple[LayerKind, ...]:
        if cfg.first("layers_block_type") is None:
            raise ConfigError(f"{cls.architecture}: config.json needs layers_block_type")
        return layers_from_types(cfg, "layers_block_type", LAYER_TYPES)

    @classmethod
    def attention_shape(cls, cfg: HFConfig, tp: int) -> AttentionShape:
        # The shared block attends over [hidden, embedding], twice the hidden width.
        dims = cls.dims(cfg)
        return kv_shape(cls.architecture, dims.num_attention_heads, dims.num_key_value_heads,
                        dims.attention_head_dim, tp)

    @classmethod
    def mamba_state_shape(cls, cfg: HFConfig, tp: int) -> tuple[tuple[int, ...], ...]:
        dims = cls.dims(cfg)
        return mamba2_state_shape(
            cls.architecture,
            d_inner=dims.mamba_expand * dims.hidden_size,
            n_heads=dims.n_mamba_heads,
            head_dim=dims.mamba_headdim,
            n_groups=dims.mamba_ngroups,
            d_state=dims.mamba_d_state,
            d_conv=dims.mamba_d_conv,
            tp=tp,
        )

    @classmethod
    def mamba_chunk_size(cls, cfg: HFConfig) -> int:
        return cfg.positive_int("chunk_size")
