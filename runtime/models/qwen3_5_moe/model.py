from __future__ import annotations

from runtime.models.qwen3_5.model import Qwen3_5ForCausalLM


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5 with experts in every layer: the declaration's dims make every layer sparse."""
