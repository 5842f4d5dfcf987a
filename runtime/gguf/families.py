"""The recurrent and hybrid GGUF architectures beyond llama and granitehybrid: mamba, mamba2, nemotron_h (and its
MoE variant nemotron_h_moe), falcon-h1, lfm2, qwen3next and jamba: the HF config.json each file's metadata stands for
(their tensors' layout: runtime/gguf/layouts.py).

What the converter (llama.cpp's convert_hf_to_gguf.py) did that the config must say:
- falcon-h1: every muP multiplier multiplied into the weights, so the file is a Falcon-H1 whose multipliers are
  all 1; llama.cpp applies the grouped norm after the gate, hence mamba_norm_before_gate off;
- lfm2: the MLP width written after LFM2's auto-adjustment, hence block_auto_adjust_ff_dim off;
- qwen3next: multi-token-prediction blocks (nextn_predict_layers) appended after the decoder's, which Tandem
  skips as transformers does;
- mamba with ssm.dt_b_c_rms (Falcon-Mamba) is refused: llama.cpp runs its B/C/dt norms with the layers' epsilon,
  which the file cannot tell from Falcon-Mamba's own mixer_rms_eps.
Layer kinds come from the tensors a block holds, as llama.cpp itself goes by.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from runtime.gguf.config import common_config, field, required, tensor_names, tensor_shape
from runtime.hf_config import ConfigError

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
    return {**common_config(path, "mamba2"), "architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2",
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
        **common_config(path, arch), "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
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
        **common_config(path, arch), "architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1",
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
        **common_config(path, arch), "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "layer_types": kinds,
        "num_attention_heads": required(path, f"{arch}.attention.head_count"),
        "num_key_value_heads": _kv_heads(path, arch, kinds, "full_attention"),
        "intermediate_size": required(path, f"{arch}.feed_forward_length"), "block_auto_adjust_ff_dim": False,
        "conv_L_cache": required(path, f"{arch}.shortconv.l_cache"),
        "conv_bias": any(n.endswith("shortconv.in_proj.bias") for n in names),
        "norm_eps": field(path, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
    }


def _mamba(path: Path) -> dict[str, Any]:
    arch, names = "mamba", tensor_names(path)
    if field(path, f"{arch}.ssm.dt_b_c_rms", False):
        raise ConfigError(f"{path.name}: {arch}.ssm.dt_b_c_rms is set (Falcon-Mamba), which Tandem does not load from "
                          "GGUF: llama.cpp runs those norms with the layers' epsilon, not the model's own; run the "
                          "original checkpoint's directory instead")
    hidden, inner = required(path, f"{arch}.embedding_length"), required(path, f"{arch}.ssm.inner_size")
    return {**common_config(path, arch), "architectures": ["MambaForCausalLM"], "model_type": "mamba",
            "intermediate_size": inner, "expand": inner // hidden,
            "state_size": required(path, f"{arch}.ssm.state_size"),
            "conv_kernel": required(path, f"{arch}.ssm.conv_kernel"),
            "time_step_rank": required(path, f"{arch}.ssm.time_step_rank"),
            "use_conv_bias": "blk.0.ssm_conv1d.bias" in names, "use_bias": "blk.0.ssm_in.bias" in names,
            "layer_norm_epsilon": field(path, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5), "hidden_act": "silu"}


def _qwen3next(path: Path) -> dict[str, Any]:
    arch, names = "qwen3next", tensor_names(path)
    get = _get(path, arch)
    # The multi-token-prediction blocks come after the decoder's; the engine predicts one token, as HF does.
    layers = required(path, f"{arch}.block_count") - (get("nextn_predict_layers", 0) or 0)
    hidden, heads = required(path, f"{arch}.embedding_length"), required(path, f"{arch}.attention.head_count")
    head_dim = get("attention.key_length") or hidden // heads
    value_heads = required(path, f"{arch}.ssm.time_step_rank")
    kinds = ["linear_attention" if f"blk.{i}.ssm_a" in names else "full_attention" for i in range(layers)]
    if any(f"blk.{i}.ffn_up.weight" in names for i in range(layers)):
        raise ConfigError(f"{path.name}: qwen3next blocks with a dense MLP (mlp_only_layers) are not supported "
                          "for GGUF")
    return {
        **common_config(path, arch), "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "num_hidden_layers": layers, "layer_types": kinds, "num_attention_heads": heads,
        "num_key_value_heads": _kv_heads(path, arch, kinds, "full_attention"), "head_dim": head_dim,
        "partial_rotary_factor": (get("rope.dimension_count") or head_dim // 4) / head_dim,
        "intermediate_size": get("feed_forward_length", 1), "num_experts": required(path, f"{arch}.expert_count"),
        "num_experts_per_tok": required(path, f"{arch}.expert_used_count"),
        "moe_intermediate_size": required(path, f"{arch}.expert_feed_forward_length"),
        "shared_expert_intermediate_size": required(path, f"{arch}.expert_shared_feed_forward_length"),
        "linear_conv_kernel_dim": required(path, f"{arch}.ssm.conv_kernel"),
        "linear_key_head_dim": required(path, f"{arch}.ssm.state_size"),
        "linear_num_key_heads": required(path, f"{arch}.ssm.group_count"), "linear_num_value_heads": value_heads,
        "linear_value_head_dim": required(path, f"{arch}.ssm.inner_size") // value_heads,
        "mlp_only_layers": [], "decoder_sparse_step": 1, "norm_topk_prob": True, "hidden_act": "silu",
    }


def _period(path: Path, layers: int, marked: list[int], what: str) -> tuple[int, int]:
    """(period, offset) with `marked` == [i for i in range(layers) if i % period == offset], as JambaConfig places
    its attention and expert layers; a file whose layers follow no such rule is refused."""
    if not marked:
        return layers + 1, layers
    period = marked[1] - marked[0] if len(marked) > 1 else layers
    offset = marked[0] % period
    if [i for i in range(layers) if i % period == offset] != marked:
        raise ConfigError(f"{path.name}: the {what} layers {marked} are not every n-th layer from an offset, "
                          "which is how Jamba places them")
    return period, offset


def _jamba(path: Path) -> dict[str, Any]:
    arch, names = "jamba", tensor_names(path)
    layers, hidden = required(path, f"{arch}.block_count"), required(path, f"{arch}.embedding_length")
    attention = [i for i in range(layers) if f"blk.{i}.attn_q.weight" in names]
    experts = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in names]
    attn_period, attn_offset = _period(path, layers, attention, "attention")
    expert_period, expert_offset = _period(path, layers, experts, "expert")
    mamba = next((i for i in range(layers) if i not in attention), 0)
    inner = required(path, f"{arch}.ssm.inner_size")
    return {
        **common_config(path, arch), "architectures": ["JambaForCausalLM"], "model_type": "jamba",
        "attn_layer_period": attn_period, "attn_layer_offset": attn_offset,
        "expert_layer_period": expert_period, "expert_layer_offset": expert_offset,
        "num_attention_heads": required(path, f"{arch}.attention.head_count"),
        "num_key_value_heads": _kv_heads(path, arch, ["attention" if i in attention else "mamba"
                                                      for i in range(layers)], "attention"),
        "intermediate_size": required(path, f"{arch}.feed_forward_length"),
        "num_experts": field(path, f"{arch}.expert_count", 1) or 1,
        "num_experts_per_tok": field(path, f"{arch}.expert_used_count", 1) or 1,
        "mamba_d_state": required(path, f"{arch}.ssm.state_size"),
        "mamba_d_conv": required(path, f"{arch}.ssm.conv_kernel"),
        "mamba_expand": inner // hidden, "mamba_dt_rank": required(path, f"{arch}.ssm.time_step_rank"),
        "mamba_conv_bias": f"blk.{mamba}.ssm_conv1d.bias" in names,
        "mamba_proj_bias": f"blk.{mamba}.ssm_in.bias" in names,
        "hidden_act": "silu",
    }


CONFIGS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "mamba": _mamba, "mamba2": _mamba2, "nemotron_h": _nemotron_h, "nemotron_h_moe": _nemotron_h,
    "falcon-h1": _falcon_h1, "lfm2": _lfm2, "qwen3next": _qwen3next, "jamba": _jamba}
