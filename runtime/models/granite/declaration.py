from __future__ import annotations

from runtime.hf_config import HFConfig
from runtime.models.common import ON_ENGINE, capabilities
from runtime.models.interface import supported
from runtime.models.llama.declaration import LlamaForCausalLM


class GraniteForCausalLM(LlamaForCausalLM):
    """Llama's layout with Granite's embedding, residual, attention and logits multipliers."""

    architecture = "GraniteForCausalLM"
    model_name = "Granite"
    example_models = ("ibm-granite/granite-3.3-2b-instruct", "ibm-granite/granite-3.3-8b-instruct")
    capabilities = capabilities(ON_ENGINE, chunked_prefill=supported(), prefix_caching=supported(),
                                tensor_parallel=supported(),
                                pipeline_parallel=supported(), lora=supported())
    implementation = "runtime.models.llama.model:GraniteForCausalLM"
    quantizations = ("compressed-tensors",)  # on-the-fly int8/int4 are untested on Granite

    @classmethod
    def dims_overrides(cls, cfg: HFConfig) -> dict:
        # GraniteConfig's defaults: the attention scale is 1, not 1/sqrt(head_dim), unless given.
        return {"attention_multiplier": cfg.first("attention_multiplier", default=1.0)}
