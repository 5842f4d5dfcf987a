from __future__ import annotations

from dataclasses import dataclass

from runtime.hf_config import HFConfig
from runtime.models.common import ON_ENGINE, capabilities
from runtime.models.dims import AttentionDims, attention_fields, read_dims
from runtime.models.interface import AttentionShape, LayerKind, ModelDeclaration, supported
from runtime.models.shapes import kv_shape


@dataclass(frozen=True)
class LlamaDims(AttentionDims):
    """Llama's, and Granite's with its multipliers (which Llama leaves at 1 and 1/sqrt(head_dim))."""

    intermediate_size: int = 11008
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    mlp_bias: bool = False
    residual_multiplier: float = 1.0
    embedding_multiplier: float = 1.0
    logits_scaling: float = 1.0


class LlamaForCausalLM(ModelDeclaration):
    architecture = "LlamaForCausalLM"
    model_name = "Llama"
    example_models = ("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.1-8B-Instruct")
    layer_kinds = frozenset({LayerKind.ATTENTION})
    capabilities = capabilities(ON_ENGINE, chunked_prefill=supported(), prefix_caching=supported(),
                                tensor_parallel=supported(),
                                pipeline_parallel=supported(), lora=supported())
    implementation = "runtime.models.llama.model:LlamaForCausalLM"
    quantizations = ("int8", "int4", "compressed-tensors", "gguf")
    defaults = {"num_attention_heads": 32, "num_hidden_layers": 32, "hidden_size": 4096}

    @classmethod
    def layout(cls, cfg: HFConfig) -> tuple[LayerKind, ...]:
        return (LayerKind.ATTENTION,) * cfg.positive_int("num_hidden_layers")

    @classmethod
    def attention_shape(cls, cfg: HFConfig, tp: int) -> AttentionShape:
        dims = cls.dims(cfg)
        return kv_shape(cls.architecture, dims.num_attention_heads, dims.num_key_value_heads, dims.head_dim, tp)

    @classmethod
    def dims(cls, cfg: HFConfig) -> LlamaDims:
        return read_dims(LlamaDims, cfg, **attention_fields(cfg, {}), **cls.dims_overrides(cfg))

    @classmethod
    def dims_overrides(cls, cfg: HFConfig) -> dict:
        return {}
