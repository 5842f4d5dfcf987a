"""Issue 17's declarations against the caches HF transformers allocates (as test_declarations_vs_transformers.py
does for the older ones): layer layout, KV heads and head size, conv and recurrent state shapes.

Each tiny config is built with transformers' own config class and saved with `save_pretrained`.
HF keeps K conv columns where we keep K-1.
"""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer  # noqa: E402

from runtime.config import EngineConfig  # noqa: E402
from runtime.models.interface import LayerKind  # noqa: E402

COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128, intermediate_size=64,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
DELTANET = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8)
TINY = {
    "Lfm2MoeForCausalLM": ("Lfm2MoeConfig", dict(
        COMMON, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], conv_L_cache=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32)),
    "FalconMambaForCausalLM": ("FalconMambaConfig", dict(hidden_size=64, num_hidden_layers=2, state_size=8,
                                                         vocab_size=128)),
    "Qwen3_5ForCausalLM": ("Qwen3_5TextConfig", dict(COMMON, **DELTANET, num_hidden_layers=4, head_dim=16)),
    "Qwen3_5MoeForCausalLM": ("Qwen3_5MoeTextConfig", dict(
        COMMON, **DELTANET, num_hidden_layers=4, head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    "OlmoHybridForCausalLM": ("OlmoHybridConfig", dict(COMMON, **DELTANET, num_hidden_layers=5)),
    # Every linear-attention size left to OlmoHybridConfig's derivation, and two layers (the last one attends).
    "OlmoHybridForCausalLM-derived": ("OlmoHybridConfig", dict(COMMON, num_hidden_layers=2, num_key_value_heads=None)),
}


def hf_cache(tmp_path, name):
    config_class, kwargs = TINY[name]
    config = getattr(transformers, config_class)(**kwargs)
    config.architectures = [name.partition("-")[0]]
    config.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.arange(5)[None] % 100 + 1, cache=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("name", sorted(TINY))
def test_layout_and_shapes_match_transformers(tmp_path, name):
    cache = hf_cache(tmp_path, name)
    layout = EngineConfig(str(tmp_path), dtype="float32").cache
    assert len(layout.layers) == len(cache.layers)
    for kind, layer in zip(layout.layers, cache.layers):
        assert (kind.has_attention, kind.has_state) == (isinstance(layer, DynamicLayer),
                                                        isinstance(layer, LinearAttentionLayer))
        if kind.has_attention:
            keys = layer.keys  # (batch, kv heads, tokens, head dim)
            assert (layout.attention.num_kv_heads, layout.attention.head_size) == (keys.shape[1], keys.shape[3])
        else:
            conv = layer.conv_states[0]  # (batch, channels, K)
            assert layout.mamba.shapes[0] == (conv.shape[2] - 1, conv.shape[1])
            if kind is LayerKind.SHORT_CONV:
                assert len(layout.mamba.shapes) == 1
            else:
                assert layout.mamba.shapes[1] == tuple(layer.recurrent_states[0].shape[1:])


def test_minimax_layout_and_shapes_match_transformers(tmp_path):
    """MiniMax keeps its own cache class: softmax layers' K/V, and a (heads, head_dim, head_dim) lightning state."""
    config = transformers.MiniMaxConfig(**dict(COMMON, num_hidden_layers=4, head_dim=16, num_local_experts=4,
                                               block_size=8, layer_types=["linear_attention", "full_attention",
                                                                           "linear_attention", "linear_attention"]))
    config.architectures = ["MiniMaxForCausalLM"]
    config.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        cache = model(torch.arange(5)[None] % 100 + 1, use_cache=True).cache
    layout = EngineConfig(str(tmp_path), dtype="float32").cache
    assert layout.layers == (LayerKind.LIGHTNING, LayerKind.ATTENTION, LayerKind.LIGHTNING, LayerKind.LIGHTNING)
    keys = cache.layers[1].keys
    assert (layout.attention.num_kv_heads, layout.attention.head_size) == (keys.shape[1], keys.shape[3])
    for i in (0, 2, 3):
        assert layout.mamba.shapes == (tuple(cache.linear_cache[i].shape[1:]),)


def test_kimi_linear_kda_shapes_match_transformers_and_its_mla_cache_is_refused(tmp_path):
    """Kimi-Linear is planned: its KDA layers' conv and recurrent states are declared and match HF's cache; its MLA
    layers cache a latent and a rope key of other widths (HF's keys and values), which no AttentionShape expresses,
    so the cache layout stops there with a ConfigError that names both sizes rather than sizing the pool wrong."""
    from runtime.hf_config import ConfigError, load_raw_config
    from runtime.models import resolve

    config = transformers.KimiLinearConfig(**dict(
        COMMON, num_key_value_heads=4, num_hidden_layers=5, kv_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        linear_attn_config=dict(num_heads=4, head_dim=8, short_conv_kernel_size=3, full_attn_layers=[2, 5],
                                kda_layers=[1, 3, 4])))
    config.architectures = ["KimiLinearForCausalLM"]
    config.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.arange(5)[None] % 100 + 1, cache=cache, use_cache=True)
    decl = resolve("KimiLinearForCausalLM")
    cfg = decl.read_config(load_raw_config(tmp_path))
    layout = decl.layout(cfg)
    assert layout == (LayerKind.GATED_DELTANET, LayerKind.ATTENTION, LayerKind.GATED_DELTANET,
                      LayerKind.GATED_DELTANET, LayerKind.ATTENTION)
    conv_shape, recurrent_shape = decl.mamba_state_shape(cfg, 1)
    for kind, layer in zip(layout, cache.layers):
        if kind is LayerKind.ATTENTION:
            assert isinstance(layer, DynamicLayer)
            assert (layer.keys.shape[-1], layer.values.shape[-1]) == (24, 8)  # latent, rope key: not K and V heads
        else:
            conv = layer.conv_states[0]
            assert conv_shape == (conv.shape[2] - 1, conv.shape[1])
            assert recurrent_shape == tuple(layer.recurrent_states[0].shape[1:])
    with pytest.raises(ConfigError, match="kv_lora_rank=24 and a rope key of qk_rope_head_dim=8"):
        EngineConfig(str(tmp_path), dtype="float32")
