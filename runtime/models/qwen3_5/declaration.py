from __future__ import annotations

from runtime.models.common import capabilities
from runtime.models.interface import planned
from runtime.models.qwen3_next.declaration import Qwen3NextForCausalLM

# transformers' Qwen3_5TextConfig defaults for the fields the declaration reads.
QWEN3_5_DEFAULTS = {
    "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
    "head_dim": 256, "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
}


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3-Next's layer layout and states (Gated DeltaNet with gated full attention), with a dense MLP."""

    architecture = "Qwen3_5ForCausalLM"
    model_name = "Qwen3.5"
    example_models = ("Qwen/Qwen3.5-27B",)
    implementation = None  # no forward pass yet (see the note)
    capabilities = capabilities(planned(
        "Missing: the Gated DeltaNet kernels (chunked prefill over varlen batches, decode update) and the forward "
        "pass (Qwen3-Next's gated attention with partial rotary, and a dense MLP)."
    ))
    defaults = QWEN3_5_DEFAULTS
