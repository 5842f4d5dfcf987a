"""The `{arch}.*` metadata llama.cpp's convert_hf_to_gguf.py writes for the families of gguf_family_files.py (its
set_gguf_parameters, key by key, for the configs the tiny checkpoints have)."""

from __future__ import annotations

import gguf


def mamba2_sizes(c: dict) -> tuple[int, int]:
    """(groups, inner size) of the Mamba-2 mixer."""
    if c["model_type"] == "falcon_h1":
        return c["mamba_n_groups"], c["mamba_d_ssm"]
    if c["model_type"] == "nemotron_h":
        return c["n_groups"], c["mamba_num_heads"] * c["mamba_head_dim"]
    return c["n_groups"], c["num_heads"] * c["head_dim"]


def metadata(w: gguf.GGUFWriter, arch: str, c: dict, tensors: list) -> None:
    w.add_block_count(c.get("num_hidden_layers") or len(c["layers_block_type"]))
    w.add_embedding_length(c["hidden_size"])
    if arch not in ("mamba2", "mamba", "qwen3next", "jamba"):
        w.add_vocab_size(c["vocab_size"])
    if arch in ("mamba2", "nemotron_h", "nemotron_h_moe", "falcon-h1"):
        groups, inner = mamba2_sizes(c)
        heads = {"mamba2": "num_heads", "falcon-h1": "mamba_n_heads"}.get(arch, "mamba_num_heads")
        w.add_ssm_conv_kernel(c.get("conv_kernel") or c.get("mamba_d_conv"))
        w.add_ssm_inner_size(inner)
        w.add_ssm_state_size(c.get("state_size") or c.get("ssm_state_size") or c.get("mamba_d_state"))
        w.add_ssm_time_step_rank(c[heads])
        w.add_ssm_group_count(groups)
    {"mamba2": _mamba2, "mamba": _mamba, "nemotron_h": _nemotron_h, "nemotron_h_moe": _nemotron_h,
     "falcon-h1": _falcon_h1, "lfm2": _lfm2, "qwen3next": _qwen3next, "jamba": _jamba}[arch](w, c, tensors)


def _mamba2(w: gguf.GGUFWriter, c: dict, tensors: list) -> None:
    w.add_context_length(2 ** 20)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_layer_norm_rms_eps(c["layer_norm_epsilon"])


def _mamba(w: gguf.GGUFWriter, c: dict, tensors: list) -> None:
    _mamba2(w, c, tensors)
    w.add_ssm_conv_kernel(c["conv_kernel"])
    w.add_ssm_inner_size(c["intermediate_size"])
    w.add_ssm_state_size(c["state_size"])
    w.add_ssm_time_step_rank(c["time_step_rank"])
    w.add_ssm_dt_b_c_rms(c["model_type"] == "falcon_mamba")


def _falcon_h1(w: gguf.GGUFWriter, c: dict, tensors: list) -> None:
    w.add_context_length(c["max_position_embeddings"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c["rope_parameters"]["rope_theta"])


def _lfm2(w: gguf.GGUFWriter, c: dict, tensors: list) -> None:
    w.add_context_length(c["max_position_embeddings"])
    # The MLP width after LFM2's auto-adjustment, which the converter computes from the config.
    w.add_feed_forward_length(next(t.shape[0] for name, t in tensors if name == "blk.0.ffn_up.weight"))
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv([c["num_key_value_heads"] if t != "conv" else 0 for t in c["layer_types"]])
    w.add_rope_freq_base(c["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(c["norm_eps"])
    w.add_shortconv_l_cache(c["conv_L_cache"])


def _nemotron_h(w: gguf.GGUFWriter, c: dict, tensors: list) -> None:
    kinds, moe = c["layers_block_type"], "num_experts_per_tok" in c
    attention = [i for i, k in enumerate(kinds) if k in ("attention", "full_attention")]
    mlp_kind = "moe" if moe else "mlp"
    width = c["moe_intermediate_size"] if moe else c["intermediate_size"]
    w.add_context_length(2 ** 20)
    w.add_feed_forward_length([width if k == mlp_kind else 0 for k in kinds])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv([c["num_key_value_heads"] if i in attention else 0 for i in range(len(kinds))])
    w.add_layer_norm_eps(c["layer_norm_epsilon"])
    w.add_rope_dimension_count(c["head_dim"])
    w.add_rope_scaling_finetuned(False)
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    if moe:
        w.add_expert_count(c["n_routed_experts"])
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_expert_group_count(c["n_group"])
        w.add_expert_group_used_count(c["topk_group"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(c["moe_shared_expert_intermediate_size"])
        w.add_expert_shared_count(c["n_shared_experts"])
        w.add_expert_weights_norm(c["norm_topk_prob"])
        w.add_expert_weights_scale(c["routed_scaling_factor"])


def _qwen3next(w: gguf.GGUFWriter, c: dict, tensors: list) -> None:
    """Qwen2MoeModel's keys, then Qwen3NextModel's (the MTP layers left out, as --no-mtp does)."""
    w.add_context_length(c["max_position_embeddings"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(c["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_count(c["num_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
    w.add_ssm_state_size(c["linear_key_head_dim"])
    w.add_ssm_group_count(c["linear_num_key_heads"])
    w.add_ssm_time_step_rank(c["linear_num_value_heads"])
    w.add_ssm_inner_size(c["linear_value_head_dim"] * c["linear_num_value_heads"])
    # gguf 0.19 has no add_recurrent_layers (the converter's newer gguf-py does): its key, written directly.
    w.add_array("qwen3next.attention.recurrent_layers", [t == "linear_attention" for t in c["layer_types"]])
    w.add_full_attention_interval(c.get("full_attention_interval", 4))
    partial = c["rope_parameters"].get("partial_rotary_factor", 0.25)
    w.add_rope_dimension_count(int(c["head_dim"] * partial))


def _jamba(w: gguf.GGUFWriter, c: dict, tensors: list) -> None:
    offset, period = c["attn_layer_offset"], c["attn_layer_period"]
    layers = c["num_hidden_layers"]
    w.add_context_length(c["max_position_embeddings"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv([0] * offset + [c["num_key_value_heads"] if (i - offset) % period == 0 else 0
                                        for i in range(offset, layers)])
    w.add_ssm_conv_kernel(c["mamba_d_conv"])
    w.add_ssm_inner_size(c["mamba_expand"] * c["hidden_size"])
    w.add_ssm_state_size(c["mamba_d_state"])
    w.add_ssm_time_step_rank(c["mamba_dt_rank"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_count(c["num_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
