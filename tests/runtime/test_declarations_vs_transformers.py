"""HF transformers is the oracle: our layouts and state shapes equal the caches its models allocate.

Each tiny config is built with transformers' own config class and saved with
`save_pretrained`, so our reader also sees the keys (and legacy spellings) that
transformers writes. HF keeps K conv columns where we (like vLLM) keep K-1.
"""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402
from transformers.cache_utils import DynamicLayer, LinearAttentionAndFullAttentionLayer, LinearAttentionLayer  # noqa: E402

from runtime.config import EngineConfig  # noqa: E402
from runtime.models.interface import LayerKind  # noqa: E402

COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128, intermediate_size=64)
MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=16)
TINY = {
    "LlamaForCausalLM": ("LlamaConfig", dict(COMMON, num_hidden_layers=2)),
    "GraniteForCausalLM": ("GraniteConfig", dict(COMMON, num_hidden_layers=2, embedding_multiplier=2.0)),
    "BambaForCausalLM": ("BambaConfig", dict(COMMON, **MAMBA, num_hidden_layers=3, attn_layer_indices=[1])),
    "GraniteMoeHybridForCausalLM": (
        "GraniteMoeHybridConfig",
        dict(COMMON, **MAMBA, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"], num_local_experts=4),
    ),
    "FalconH1ForCausalLM": ("FalconH1Config", dict(COMMON, **MAMBA, num_hidden_layers=2, mamba_d_ssm=128)),
    "NemotronHForCausalLM": (
        "NemotronHConfig",
        dict(COMMON, hybrid_override_pattern="M-*E", mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
             ssm_state_size=16, head_dim=16, n_routed_experts=4, moe_intermediate_size=32,
             moe_shared_expert_intermediate_size=32),
    ),
    "Zamba2ForCausalLM": (
        "Zamba2Config",
        dict(COMMON, num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
             n_mamba_heads=8, mamba_d_state=16, mamba_ngroups=2, num_key_value_heads=4),
    ),
    "JambaForCausalLM": (
        "JambaConfig",
        dict(COMMON, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, num_experts=4, mamba_d_state=8),
    ),
    "MambaForCausalLM": ("MambaConfig", dict(hidden_size=64, num_hidden_layers=2, state_size=8, vocab_size=128)),
    "Mamba2ForCausalLM": (
        "Mamba2Config",
        dict(hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, n_groups=2, state_size=16, vocab_size=128),
    ),
    "Lfm2ForCausalLM": ("Lfm2Config", dict(COMMON, num_hidden_layers=4, full_attn_idxs=[1, 3])),
    "Qwen3NextForCausalLM": (
        "Qwen3NextConfig",
        dict(COMMON, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=16, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=32),
    ),
}


def hf_cache(tmp_path, architecture):
    config_class, kwargs = TINY[architecture]
    config = getattr(transformers, config_class)(**kwargs)
    config.architectures = [architecture]
    config.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.arange(5)[None] % 100 + 1, cache=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("architecture", sorted(TINY))
def test_layout_and_shapes_match_transformers(tmp_path, architecture):
    cache = hf_cache(tmp_path, architecture)
    layout = EngineConfig(str(tmp_path), dtype="float32").cache
    assert len(layout.layers) == len(cache.layers)
    for kind, layer in zip(layout.layers, cache.layers):
        has_kv = isinstance(layer, (DynamicLayer, LinearAttentionAndFullAttentionLayer))
        has_state = isinstance(layer, (LinearAttentionLayer, LinearAttentionAndFullAttentionLayer))
        assert (kind.has_attention, kind.has_state) == (has_kv, has_state), (kind, type(layer).__name__)
        if has_kv:
            keys = layer.keys  # (batch, kv heads, tokens, head dim)
            assert (layout.attention.num_kv_heads, layout.attention.head_size) == (keys.shape[1], keys.shape[3])
        if has_state:
            conv = layer.conv_states[0]  # (batch, channels, K): HF keeps K columns, we keep K-1
            assert layout.mamba.shapes[0] == (conv.shape[2] - 1, conv.shape[1])
            if kind is not LayerKind.SHORT_CONV:
                assert layout.mamba.shapes[1] == tuple(layer.recurrent_states[0].shape[1:])
