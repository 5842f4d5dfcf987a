from __future__ import annotations

from runtime.layers.gated_deltanet import GatedDeltaNet
from runtime.models.qwen3_next.model import Qwen3NextDecoderLayer, Qwen3NextForCausalLM


class Qwen3_5DecoderLayer(Qwen3NextDecoderLayer):
    linear_attention = GatedDeltaNet  # unfused projections: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3-Next's model with Qwen3.5's Gated DeltaNet projections; dense or MoE as the dims say."""

    decoder_layer = Qwen3_5DecoderLayer

    def checkpoint_name(self, name: str) -> str | None:
        # A checkpoint of the multimodal model may carry the vision tower, which the text model skips (as HF does).
        if name.startswith("model.visual."):
            return None
        return super().checkpoint_name(name)
