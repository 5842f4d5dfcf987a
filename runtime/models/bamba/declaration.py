from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.hf_config import ConfigError, HFConfig
from runtime.models.common import ON_ENGINE, capabilities
from runtime.models.dims import AttentionDims, attention_fields, read_dims
from runtime.models.interface import AttentionShape, LayerKind, ModelDeclaration, supported
from runtime.models.shapes import kv_shape, mamba2_state_shape

# transformers' BambaConfig defaults for the fields the declaration reads.
MAMBA2_HYBRID_DEFAULTS = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "mamba_n_heads": 128,
    "mamba_d_head": "auto",
    "mamba_n_groups": 1,
    "mamba_d_state": 256,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 256,
}


@dataclass(frozen=True)
class Mamba2HybridDims(AttentionDims):
    """The `mamba_*` keys Bamba, Granite 4.0-H and Falcon-H1 share (BambaConfig's defaults), and the MLP."""

    mamba_n_heads: int = 128
    mamba_d_head: int = 0  # derived: mamba_expand * hidden_size / mamba_n_heads unless given
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    rms_norm_eps: float = 1e-5
    intermediate_size: int = 14336
    hidden_act: str = "silu"
    mlp_bias: bool = False
    attn_layer_indices: tuple[int, ...] = ()


def mamba2_hybrid_fields(cfg: HFConfig, partial_rotary_factor: float | None = None,
                         rope: bool = True) -> dict[str, Any]:
    head = cfg.first("mamba_d_head", default="auto")
    if head == "auto":
        head = cfg.positive_int("mamba_expand") * cfg.positive_int("hidden_size") // cfg.positive_int("mamba_n_heads")
    return {**attention_fields(cfg, {}, partial_rotary_factor, rope), "mamba_d_head": head}


def layer_indices(cfg: HFConfig, key: str) -> set[int]:
    num_layers = cfg.positive_int("num_hidden_layers")
    indices = set(cfg.first(key, default=[]))
    outside = sorted(i for i in indices if not (isinstance(i, int) and 0 <= i < num_layers))
    if outside:
        raise ConfigError(f"{cfg.architecture}: {key} names layers {outside}, but the model has {num_layers} layers")
    return indices


class BambaForCausalLM(ModelDeclaration):
    """Mamba-2 layers with attention layers at `attn_layer_indices`."""

    architecture = "BambaForCausalLM"
    model_name = "Bamba"
    example_models = ("ibm-ai-platform/Bamba-9B", "ibm-ai-platform/Bamba-9B-v2")
    layer_kinds = frozenset({LayerKind.ATTENTION, LayerKind.MAMBA2})
    capabilities = capabilities(ON_ENGINE, chunked_prefill=supported(), prefix_caching=supported(),
                                tensor_parallel=supported(),
                                pipeline_parallel=supported(), lora=supported())
    implementation = "runtime.models.bamba.model:BambaForCausalLM"
    quantizations = ("int8", "int4", "compressed-tensors", "gguf")
    defaults = MAMBA2_HYBRID_DEFAULTS

    @classmethod
    def dims(cls, cfg: HFConfig) -> Mamba2HybridDims:
        # BambaConfig rotates half of each head, whatever config.json says.
        return read_dims(Mamba2HybridDims, cfg, **mamba2_hybrid_fields(cfg, partial_rotary_factor=0.5))

    @classmethod
    def layout(cls, cfg: HFConfig) -> tuple[LayerKind, ...]:
        attention = layer_indices(cfg, "attn_layer_indices")
        return tuple(
            LayerKind.ATTENTION if i in attention else LayerKind.MAMBA2
            for i in range(cfg.positive_int("num_hidden_layers"))
        )

    @classmethod
    def attention_shape(cls, cfg: HFConfig, tp: int) -> AttentionShape:
        dims = cls.dims(cfg)
        return kv_shape(cls.architecture, dims.num_attention_heads, dims.num_key_value_heads, dims.head_dim, tp)

    @classmethod
    def mamba_inner_size(cls, cfg: HFConfig) -> int:
        return cfg.positive_int("mamba_expand") * cfg.positive_int("hidden_size")

    @classmethod
    def mamba_state_shape(cls, cfg: HFConfig, tp: int) -> tuple[tuple[int, ...], ...]:
        dims = cls.dims(cfg)
        return mamba2_state_shape(
            cls.architecture,
            d_inner=cls.mamba_inner_size(cfg),
            n_heads=dims.mamba_n_heads,
            head_dim=dims.mamba_d_head,
            n_groups=dims.mamba_n_groups,
            d_state=dims.mamba_d_state,
            d_conv=dims.mamba_d_conv,
            tp=tp,
        )

    @classmethod
    def mamba_chunk_size(cls, cfg: HFConfig) -> int:
        return cfg.positive_int("mamba_chunk_size")
