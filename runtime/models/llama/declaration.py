from __future__ import annotations

from runtime.hf_config import HFConfig
from runtime.models.common import ON_ENGINE, capabilities
from runtime.models.interface import AttentionShape, LayerKind, ModelDeclaration, supported
from runtime.models.shapes import attention_shape


class LlamaForCausalLM(ModelDeclaration):
    architecture = "LlamaForCausalLM"
    model_name = "Llama"
    example_models = ("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.1-8B-Instruct")
    layer_kinds = frozenset({LayerKind.ATTENTION})
    capabilities = capabilities(ON_ENGINE, chunked_prefill=supported(), prefix_caching=supported())
    implementation = "runtime.models.llama.model:LlamaForCausalLM"
    defaults = {"num_attention_heads": 32, "num_hidden_layers": 32, "hidden_size": 4096}

    @classmethod
    def layout(cls, cfg: HFConfig) -> tuple[LayerKind, ...]:
        return (LayerKind.ATTENTION,) * cfg.positive_int("num_hidden_layers")

    @classmethod
    def attention_shape(cls, cfg: HFConfig, tp: int) -> AttentionShape:
        return attention_shape(cfg, tp)
