"""The recurrent and hybrid GGUF architectures beyond llama and granitehybrid: mamba2, nemotron_h (and its MoE
variant nemotron_h_moe), falcon-h1 and lfm2. Each gives the HF config.json its metadata stands for, and the
layout of its tensors (HF names, what the converter changed).

What llama.cpp's convert_hf_to_gguf.py does to these (its conversion/mamba.py, nemotron.py, falcon_h1.py, lfm2.py):
- every Mamba-2 mixer: A = -exp(A_log), D as (heads, 1), the conv squeezed, the gated norm grouped: undone in
  weights._transform;
- nemotron_h: q/k rows permuted like Llama's (through GraniteHybridModel), experts stacked into 3-D tensors;
- falcon-h1: every muP multiplier multiplied into the weights, so the file is a Falcon-H1 whose multipliers are
  all 1 (the config says so); llama.cpp applies its grouped norm after the gate, hence mamba_norm_before_gate off;
- lfm2: the short conv squeezed; the final norm is `token_embd_norm` (HF's misnamed `embedding_norm`).
Layer kinds come from the tensors a block holds, as llama.cpp itself goes by.
"""

from __future__ import annotations

from dataclasses import dataclass, field as dc_field
from pathlib import Path
from typing import Any, Callable

from runtime.gguf.config import _common, field, required, tensor_names, tensor_shape
from runtime.hf_config import ConfigError

MAMBA2_MIXER = {"ssm_in.weight": "in_proj.weight", "ssm_out.weight": "out_proj.weight",
                "ssm_conv1d.weight": "conv1d.weight", "ssm_conv1d.bias": "conv1d.bias", "ssm_dt.bias": "dt_bias",
                "ssm_a": "A_log", "ssm_d": "D", "ssm_norm.weight": "norm.weight"}
QKV = {"attn_q.weight": "q_proj.weight", "attn_k.weight": "k_proj.weight", "attn_v.weight": "v_proj.weight"}


def _under(prefix: str, table: dict[str, str]) -> dict[str, str]:
    return {k: prefix + v for k, v in table.items()}


def _with_biases(table: dict[str, str]) -> dict[str, str]:
    """Each linear's optional bias beside its weight (bias-carrying variants of the same family)."""
    biases = {k.removesuffix(".weight") + ".bias": v.removesuffix(".weight") + ".bias"
              for k, v in table.items() if k.endswith(".weight") and "norm" not in k}
    return {**biases, **table}


@dataclass(frozen=True)
class Layout:
    """Where a family's GGUF tensors go: `top` for the global ones, `layer` (a format string taking the block
    index) followed by `table[suffix]` for the blocks' ones; `experts` names the per-expert HF tensor ({e}) that
    each slice of a stacked GGUF expert tensor becomes; `permuted`: q/k rows permuted by the converter."""
    top: dict[str, str]
    layer: str
    table: dict[str, str]
    experts: dict[str, str] = dc_field(default_factory=dict)
    permuted: bool = False


BACKBONE = {"token_embd.weight": "backbone.embeddings.weight", "output_norm.weight": "backbone.norm_f.weight",
            "output.weight": "lm_head.weight"}
NEMOTRON_H = {
    "attn_norm.weight": "norm.weight", **_under("mixer.", MAMBA2_MIXER), **_under("mixer.", QKV),
    "attn_output.weight": "mixer.o_proj.weight", "ffn_up.weight": "mixer.up_proj.weight",
    "ffn_down.weight": "mixer.down_proj.weight", "ffn_gate_inp.weight": "mixer.gate.weight",
    "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
    "ffn_up_shexp.weight": "mixer.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mixer.shared_experts.down_proj.weight"}
FALCON_H1 = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm": "pre_ff_layernorm.weight",
    "ffn_norm.weight": "pre_ff_layernorm.weight", **_under("mamba.", MAMBA2_MIXER), **_under("self_attn.", QKV),
    "attn_output.weight": "self_attn.o_proj.weight", "ffn_gate.weight": "feed_forward.gate_proj.weight",
    "ffn_up.weight": "feed_forward.up_proj.weight", "ffn_down.weight": "feed_forward.down_proj.weight"}
LFM2 = {
    "attn_norm.weight": "operator_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "shortconv.conv.weight": "conv.conv.weight", "shortconv.in_proj.weight": "conv.in_proj.weight",
    "shortconv.out_proj.weight": "conv.out_proj.weight", **_under("self_attn.", QKV),
    "attn_output.weight": "self_attn.out_proj.weight", "attn_q_norm.weight": "self_attn.q_layernorm.weight",
    "attn_k_norm.weight": "self_attn.k_layernorm.weight", "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_up.weight": "feed_forward.w3.weight", "ffn_down.weight": "feed_forward.w2.weight"}
LAYOUTS = {
    "mamba2": Layout(BACKBONE, "backbone.layers.{}.", _with_biases(
        {"attn_norm.weight": "norm.weight", **_under("mixer.", MAMBA2_MIXER)})),
    "nemotron_h": Layout(BACKBONE, "backbone.layers.{}.", _with_biases(NEMOTRON_H), permuted=True, experts={
        "ffn_up_exps.weight": "mixer.experts.{e}.up_proj.weight",
        "ffn_down_exps.weight": "mixer.experts.{e}.down_proj.weight"}),
    "falcon_h1": Layout({"token_embd.weight": "model.embed_tokens.weight",
                         "output_norm.weight": "model.final_layernorm.weight", "output.weight": "lm_head.weight"},
                        "model.layers.{}.", _with_biases(FALCON_H1)),
    "lfm2": Layout({"token_embd.weight": "model.embed_tokens.weight",
                    "token_embd_norm.weight": "model.embedding_norm.weight", "output.weight": "lm_head.weight"},
                   "model.layers.{}.", _with_biases(LFM2)),
}


def _get(path: Path, arch: str) -> Callable[..., Any]:
    return lambda key, default=None: field(path, f"{arch}.{key}", default)


def _mamba2_mixer(path: Path, arch: str, names: set[str]) -> dict[str, Any]:
    """The Mamba-2 mixer's sizes, under the names Mamba2Config gives them."""
    heads, inner = required(path, f"{arch}.ssm.time_step_rank"), required(path, f"{arch}.ssm.inner_size")
    mixer = next((int(n.split(".")[1]) for n in names if n.endswith("ssm_in.weight")), None)
    return {"heads": heads, "head_dim": inner // heads, "inner": inner,
            "groups": required(path, f"{arch}.ssm.group_count"), "state": required(path, f"{arch}.ssm.state_size"),
            "conv": required(path, f"{arch}.ssm.conv_kernel"),
            "conv_bias": mixer is not None and f"blk.{mixer}.ssm_conv1d.bias" in names,
            "proj_bias": mixer is not None and f"blk.{mixer}.ssm_in.bias" in names}


def _mamba2(path: Path) -> dict[str, Any]:
    names, hidden = tensor_names(path), required(path, "mamba2.embedding_length")
    m = _mamba2_mixer(path, "mamba2", names)
    expand = m["inner"] / hidden
    return {**_common(path, "mamba2"), "architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2",
            "num_heads": m["heads"], "head_dim": m["head_dim"], "n_groups": m["groups"], "state_size": m["state"],
            "conv_kernel": m["conv"], "expand": int(expand) if expand.is_integer() else expand,
            "use_conv_bias": m["conv_bias"], "use_bias": m["proj_bias"],
            "layer_norm_epsilon": field(path, "mamba2.attention.layer_norm_rms_epsilon", 1e-5), "hidden_act": "silu"}


def _block_kinds(path: Path, arch: str) -> list[str]:
    names, layers = tensor_names(path), required(path, f"{arch}.block_count")
    kinds = []
    for i in range(layers):
        has = lambda suffix: f"blk.{i}.{suffix}" in names  # noqa: E731
        kinds.append("mamba" if has("ssm_in.weight") else "attention" if has("attn_q.weight")
                     else "moe" if has("ffn_up_exps.weight") else "mlp" if has("ffn_up.weight") else "?")
        if kinds[-1] == "?":
            raise ConfigError(f"{path.name}: block {i} holds none of ssm_in, attn_q, ffn_up or ffn_up_exps; "
                              f"it is no {arch} layer Tandem knows")
    return kinds


def _kv_heads(path: Path, arch: str, kinds: list[str], attention: str) -> int:
    """The KV heads of the attention layers (head_count_kv is per layer, 0 on the others)."""
    value = required(path, f"{arch}.attention.head_count_kv")
    counts = {value[i] for i, kind in enumerate(kinds) if kind == attention} if isinstance(value, list) else {value}
    if len(counts) > 1:
        raise ConfigError(f"{path.name}: attention layers with different KV head counts {sorted(counts)} are not "
                          "supported")
    return counts.pop() if counts else required(path, f"{arch}.attention.head_count")


def _nemotron_h(path: Path) -> dict[str, Any]:
    arch = field(path, "general.architecture")
    names, get = tensor_names(path), _get(path, arch)
    kinds = _block_kinds(path, arch)
    if get("moe_latent_size"):
        raise ConfigError(f"{path.name}: {arch}.moe_latent_size (latent MoE projections) is not supported for GGUF")
    m = _mamba2_mixer(path, arch, names)
    mlp = next((i for i, kind in enumerate(kinds) if kind == "mlp"), None)
    block_type = {"mamba": "mamba", "attention": "attention", "mlp": "mlp", "moe": "moe"}
    config = {
        **_common(path, arch), "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "layers_block_type": [block_type[k] for k in kinds], "num_hidden_layers": len(kinds),
        "num_attention_heads": required(path, f"{arch}.attention.head_count"),
        "num_key_value_heads": _kv_heads(path, arch, kinds, "attention"),
        "head_dim": get("attention.key_length") or required(path, f"{arch}.embedding_length") // required(
            path, f"{arch}.attention.head_count"),
        "intermediate_size": tensor_shape(path, f"blk.{mlp}.ffn_up.weight")[0] if mlp is not None else 1,
        "mamba_num_heads": m["heads"], "mamba_head_dim": m["head_dim"], "n_groups": m["groups"],
        "ssm_state_size": m["state"], "conv_kernel": m["conv"], "use_conv_bias": m["conv_bias"],
        "use_bias": m["proj_bias"], "mlp_hidden_act": "relu2",
        "layer_norm_epsilon": get("attention.layer_norm_epsilon") or get("attention.layer_norm_rms_epsilon", 1e-5),
    }
    if "moe" in kinds:
        config.update({
            "n_routed_experts": required(path, f"{arch}.expert_count"),
            "num_experts_per_tok": required(path, f"{arch}.expert_used_count"),
            "moe_intermediate_size": required(path, f"{arch}.expert_feed_forward_length"),
            "moe_shared_expert_intermediate_size": required(path, f"{arch}.expert_shared_feed_forward_length"),
            "n_shared_experts": get("expert_shared_count", 1), "n_group": get("expert_group_count", 1),
            "topk_group": get("expert_group_used_count", 1), "norm_topk_prob": get("expert_weights_norm", True),
            "routed_scaling_factor": get("expert_weights_scale", 1.0)})
    return config


def _falcon_h1(path: Path) -> dict[str, Any]:
    arch, names = "falcon-h1", tensor_names(path)
    get, m = _get(path, arch), _mamba2_mixer(path, arch, names)
    hidden, heads = required(path, f"{arch}.embedding_length"), required(path, f"{arch}.attention.head_count")
    return {
        **_common(path, arch), "architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1",
        "num_attention_heads": heads, "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length") or hidden // heads,
        "intermediate_size": required(path, f"{arch}.feed_forward_length"),
        "mamba_d_ssm": m["inner"], "mamba_n_heads": m["heads"], "mamba_d_head": m["head_dim"],
        "mamba_n_groups": m["groups"], "mamba_d_state": m["state"], "mamba_d_conv": m["conv"],
        "mamba_expand": max(1, m["inner"] // hidden), "mamba_conv_bias": m["conv_bias"],
        "mamba_proj_bias": m["proj_bias"], "projectors_bias": "blk.0.attn_q.bias" in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mamba_rms_norm": "blk.0.ssm_norm.weight" in names, "mamba_norm_before_gate": False,
        # The converter multiplied every muP multiplier into the weights.
        "embedding_multiplier": 1.0, "lm_head_multiplier": 1.0, "key_multiplier": 1.0,
        "attention_in_multiplier": 1.0, "attention_out_multiplier": 1.0, "mlp_multipliers": [1.0, 1.0],
        "ssm_multipliers": [1.0] * 5, "ssm_in_multiplier": 1.0, "ssm_out_multiplier": 1.0, "hidden_act": "silu",
    }


def _lfm2(path: Path) -> dict[str, Any]:
    arch, names = "lfm2", tensor_names(path)
    kinds = ["conv" if f"blk.{i}.shortconv.in_proj.weight" in names else "full_attention"
             for i in range(required(path, f"{arch}.block_count"))]
    return {
        **_common(path, arch), "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "layer_types": kinds,
        "num_attention_heads": required(path, f"{arch}.attention.head_count"),
        "num_key_value_heads": _kv_heads(path, arch, kinds, "full_attention"),
        "intermediate_size": required(path, f"{arch}.feed_forward_length"), "block_auto_adjust_ff_dim": False,
        "conv_L_cache": required(path, f"{arch}.shortconv.l_cache"),
        "conv_bias": any(n.endswith("shortconv.in_proj.bias") for n in names),
        "norm_eps": field(path, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
    }


CONFIGS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "mamba2": _mamba2, "nemotron_h": _nemotron_h, "nemotron_h_moe": _nemotron_h, "falcon-h1": _falcon_h1,
    "lfm2": _lfm2}
