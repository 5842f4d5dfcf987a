"""Our rope initialisation equals transformers' for the rope types our configs use (transformers is the oracle)."""

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from runtime.hf_config import HFConfig
from runtime.layers.rotary import inverse_frequencies
from runtime.models.dims import read_rope

LLAMA_3_2 = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
             "original_max_position_embeddings": 8192, "rope_type": "llama3"}


@pytest.mark.parametrize("legacy,rope", [
    ({"rope_theta": 500000.0, "rope_scaling": LLAMA_3_2}, None),  # Llama 3.2's published spelling
    ({"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 4.0}}, None),
    ({"rope_theta": 1e11}, None),  # Falcon-H1's
    ({}, {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA_3_2}),  # transformers 5's spelling
])
def test_inverse_frequencies_match_transformers(legacy, rope):
    keys = dict(hidden_size=2048, num_attention_heads=32, max_position_embeddings=131072, **legacy)
    if rope is not None:
        keys["rope_parameters"] = rope
    hf = transformers.LlamaConfig(**keys)
    rope_type = hf.rope_parameters.get("rope_type", "default")
    expected, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu") if rope_type != "default" else (None, 1.0)
    ours = inverse_frequencies(read_rope(HFConfig("LlamaForCausalLM", keys), head_dim=64))
    if expected is None:
        theta = hf.rope_parameters["rope_theta"]
        expected = 1.0 / (theta ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))
    assert scaling == 1.0
    torch.testing.assert_close(ours, expected)


def test_an_unsupported_rope_type_is_a_config_error():
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        read_rope(HFConfig("LlamaForCausalLM", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}), 64)
