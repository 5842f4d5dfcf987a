from __future__ import annotations

from runtime.models.common import ON_ENGINE, capabilities
from runtime.models.interface import supported
from runtime.models.llama.declaration import LlamaForCausalLM


class GraniteForCausalLM(LlamaForCausalLM):
    """Llama's layout with Granite's embedding, residual, attention and logits multipliers."""

    architecture = "GraniteForCausalLM"
    model_name = "Granite"
    example_models = ("ibm-granite/granite-3.3-2b-instruct", "ibm-granite/granite-3.3-8b-instruct")
    capabilities = capabilities(ON_ENGINE, chunked_prefill=supported(), prefix_caching=supported())
    implementation = "runtime.models.llama.model:GraniteForCausalLM"
