"""GGUF files of the recurrent and hybrid families (mamba2, nemotron_h / nemotron_h_moe, falcon-h1, lfm2) written from
tiny HF checkpoints as llama.cpp's convert_hf_to_gguf.py writes them (its vendored copy in the llama-cpp-python
0.3.36 sdist: conversion/mamba.py, nemotron.py, falcon_h1.py, lfm2.py), and the HF checkpoint the file stands for.

Tensor names come from gguf's TensorNameMap, as the converter's map_tensor_name takes them. What the converter
changes, and read_back undoes for the oracle:
- Mamba-2 mixers (all four but lfm2): A = -exp(A_log) and D as (heads, 1), the conv squeezed to (channels, kernel),
  the gated norm as (groups, inner / groups), dt_bias renamed to the ssm_dt bias;
- nemotron_h: q/k rows permuted (LlamaModel.permute, through GraniteHybridModel), the experts stacked into 3-D
  tensors; a config.json with num_experts_per_tok converts as nemotron_h_moe;
- falcon-h1: every muP multiplier multiplied into the weights (the file is a Falcon-H1 with multipliers of 1);
- lfm2: the short conv squeezed to (channels, kernel).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf_files import _tokenizer, permute, quantize, unpermute
from safetensors.torch import load_file, save_file

FALCON_MULTIPLIERS = ("embedding_multiplier", "lm_head_multiplier", "key_multiplier", "attention_in_multiplier",
                      "attention_out_multiplier", "ssm_in_multiplier", "ssm_out_multiplier")
EXPERT = "backbone.layers.{layer}.mixer.experts.{expert}.{proj}.weight"


def arch_of(c: dict) -> str:
    if c["model_type"] == "nemotron_h":
        return "nemotron_h_moe" if "num_experts_per_tok" in c else "nemotron_h"
    return {"mamba2": "mamba2", "falcon_h1": "falcon-h1", "lfm2": "lfm2"}[c["model_type"]]


def _name_map(c: dict):
    arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch_of(c)]
    return gguf.get_tensor_name_map(arch, _layers(c))


def _layers(c: dict) -> int:
    return c.get("num_hidden_layers") or len(c["layers_block_type"])


def _gguf_name(name: str, c: dict) -> str:
    """The converter's filter_tensors renames, then map_tensor_name."""
    if name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    if name.endswith("e_score_correction_bias"):
        name = name.removesuffix("_bias") + ".bias"
    mapped = _name_map(c).get_name(name, try_suffixes=(".weight", ".bias"))
    assert mapped is not None, name
    return mapped


def _mamba_heads(c: dict) -> tuple[int, int]:
    """(groups, inner size) of the Mamba-2 mixer."""
    if c["model_type"] == "falcon_h1":
        return c["mamba_n_groups"], c["mamba_d_ssm"]
    if c["model_type"] == "nemotron_h":
        return c["n_groups"], c["mamba_num_heads"] * c["mamba_head_dim"]
    return c["n_groups"], c["num_heads"] * c["head_dim"]


def _falcon_scale(name: str, w: torch.Tensor, c: dict) -> torch.Tensor:
    """FalconH1Model.modify_tensors: the multipliers into the weights."""
    mlp, ssm = c["mlp_multipliers"], c["ssm_multipliers"]
    if "down_proj" in name:
        return w * mlp[1]
    if "gate_proj" in name:
        return w * mlp[0]
    if "k_proj" in name:
        return w * c["key_multiplier"] * c["attention_in_multiplier"]
    if "q_proj" in name or "v_proj" in name:
        return w * c["attention_in_multiplier"]
    if "o_proj" in name:
        return w * c["attention_out_multiplier"]
    if "out_proj" in name:
        return w * c["ssm_out_multiplier"]
    if "in_proj" in name:
        inner, gs = c["mamba_d_ssm"], c["mamba_n_groups"] * c["mamba_d_state"]
        bounds = [0, inner, 2 * inner, 2 * inner + gs, 2 * inner + 2 * gs, w.shape[0]]
        w = w * c["ssm_in_multiplier"]
        for k in range(5):
            w[bounds[k]:bounds[k + 1]] *= ssm[k]
        return w
    if "lm_head" in name:
        return w * c["lm_head_multiplier"]
    if "embed_tokens" in name:
        return w * c["embedding_multiplier"]
    return w


def _converted(name: str, w: torch.Tensor, c: dict) -> torch.Tensor:
    """The GGUF data of one HF tensor (its name is _gguf_name's)."""
    if c["model_type"] == "falcon_h1":
        w = _falcon_scale(name, w, c)
    if c["model_type"] == "lfm2":
        return w.squeeze(1) if "conv.conv" in name else w
    if c["model_type"] == "nemotron_h" and name.endswith("q_proj.weight"):
        return permute(w, c["num_attention_heads"])
    if c["model_type"] == "nemotron_h" and name.endswith("k_proj.weight"):
        return permute(w, c["num_key_value_heads"])
    if name.endswith("conv1d.weight"):
        return w.squeeze()
    if name.endswith(".A_log"):
        return -torch.exp(w.reshape(-1, 1))
    if name.endswith(".D"):
        return w.reshape(-1, 1)
    if name.endswith(("mixer.norm.weight", "mamba.norm.weight")):
        groups, inner = _mamba_heads(c)
        return w.reshape(groups, inner // groups)
    return w


def converted_tensors(directory: Path) -> list[tuple[str, torch.Tensor]]:
    """(GGUF name, float data) of every tensor the converter writes, the experts stacked."""
    c = json.loads((directory / "config.json").read_text())
    state = load_file(directory / "model.safetensors")
    out, experts = [], {}
    for name, w in state.items():
        if ".mixer.experts." in name:
            _, _, layer, _, _, expert, proj, _ = name.split(".")
            experts.setdefault((int(layer), proj), {})[int(expert)] = w.float()
            continue
        out.append((_gguf_name(name, c), _converted(name, w.float(), c)))
    for (layer, proj), parts in sorted(experts.items()):
        stacked = torch.stack([parts[e] for e in range(len(parts))])
        out.append((_gguf_name(f"model.layers.{layer}.mlp.experts.{proj}.weight", c), stacked))
    return out


def _metadata(w: gguf.GGUFWriter, c: dict, tensors: list) -> None:
    arch, layers = arch_of(c), _layers(c)
    w.add_block_count(layers)
    w.add_embedding_length(c["hidden_size"])
    if arch != "mamba2":
        w.add_vocab_size(c["vocab_size"])
    if arch in ("mamba2", "nemotron_h", "nemotron_h_moe", "falcon-h1"):
        groups, inner = _mamba_heads(c)
        heads = {"mamba2": "num_heads", "falcon-h1": "mamba_n_heads"}.get(arch, "mamba_num_heads")
        w.add_ssm_conv_kernel(c.get("conv_kernel") or c.get("mamba_d_conv"))
        w.add_ssm_inner_size(inner)
        w.add_ssm_state_size(c.get("state_size") or c.get("ssm_state_size") or c.get("mamba_d_state"))
        w.add_ssm_time_step_rank(c[heads])
        w.add_ssm_group_count(groups)
    if arch == "mamba2":
        w.add_context_length(2 ** 20)
        w.add_feed_forward_length(0)
        w.add_head_count(0)
        w.add_layer_norm_rms_eps(c["layer_norm_epsilon"])
    elif arch.startswith("nemotron_h"):
        _nemotron_metadata(w, c)
    elif arch == "falcon-h1":
        w.add_context_length(c["max_position_embeddings"])
        w.add_feed_forward_length(c["intermediate_size"])
        w.add_head_count(c["num_attention_heads"])
        w.add_head_count_kv(c["num_key_value_heads"])
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_layer_norm_rms_eps(c["rms_norm_eps"])
        w.add_rope_freq_base(c["rope_parameters"]["rope_theta"])
    else:  # lfm2
        w.add_context_length(c["max_position_embeddings"])
        w.add_feed_forward_length(_lfm2_width(tensors))
        w.add_head_count(c["num_attention_heads"])
        w.add_head_count_kv([c["num_key_value_heads"] if t != "conv" else 0 for t in c["layer_types"]])
        w.add_rope_freq_base(c["rope_parameters"]["rope_theta"])
        w.add_layer_norm_rms_eps(c["norm_eps"])
        w.add_shortconv_l_cache(c["conv_L_cache"])


def _lfm2_width(tensors: list) -> int:
    """The MLP width after LFM2's auto-adjustment, which the converter computes from the config."""
    return next(t.shape[0] for name, t in tensors if name == "blk.0.ffn_up.weight")


def _nemotron_metadata(w: gguf.GGUFWriter, c: dict) -> None:
    kinds, moe = c["layers_block_type"], arch_of(c) == "nemotron_h_moe"
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


def write_family_gguf(directory: Path, out: Path, types: Callable[[str, tuple[int, ...]], T],
                      file_type: gguf.LlamaFileType | None = None) -> None:
    c = json.loads((directory / "config.json").read_text())
    tensors = converted_tensors(directory)
    if c.get("tie_word_embeddings"):
        tensors = [(n, t) for n, t in tensors if n != "output.weight"]
    writer = gguf.GGUFWriter(out, arch_of(c))
    writer.add_name(directory.name)
    _metadata(writer, c, tensors)
    if file_type is not None:
        writer.add_file_type(file_type)
    _tokenizer(writer, directory, c)
    for name, data in tensors:
        qtype = types(name, tuple(data.shape))
        writer.add_tensor(name, quantize(data.numpy(), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def oracle_checkpoint(path: Path, directory: Path, out: Path) -> Path:
    """The HF checkpoint (`directory`'s config and names) the GGUF file at `path` stands for, written to `out`:
    every tensor dequantized by gguf.quants.dequantize and the converter's changes undone; for falcon-h1 the
    config's multipliers are 1, since the file holds them in its weights."""
    c = json.loads((directory / "config.json").read_text())
    hf_names = _hf_names(directory, c)
    state = {}
    for tensor in gguf.GGUFReader(path).tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))
        data = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        w = torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape)
        for hf_name, value in _restored(hf_names[tensor.name], w, c):
            state[hf_name] = value.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, out / "model.safetensors")
    if c["model_type"] == "falcon_h1":
        c = {**c, **dict.fromkeys(FALCON_MULTIPLIERS, 1.0), "mlp_multipliers": [1.0, 1.0],
             "ssm_multipliers": [1.0] * 5}
    (out / "config.json").write_text(json.dumps(c))
    return out


def _hf_names(directory: Path, c: dict) -> dict[str, str | tuple]:
    """GGUF name -> the HF name it came from (stacked experts: (layer, proj, experts))."""
    state = load_file(directory / "model.safetensors")
    out = {}
    for name in state:
        if ".mixer.experts." in name:
            _, _, layer, _, _, expert, proj, _ = name.split(".")
            key = _gguf_name(f"model.layers.{layer}.mlp.experts.{proj}.weight", c)
            out[key] = ("experts", int(layer), proj)
        else:
            out[_gguf_name(name, c)] = name
    return out


def _restored(hf_name, w: torch.Tensor, c: dict) -> list[tuple[str, torch.Tensor]]:
    if isinstance(hf_name, tuple):
        _, layer, proj = hf_name
        return [(EXPERT.format(layer=layer, expert=e, proj=proj), w[e]) for e in range(w.shape[0])]
    if c["model_type"] == "nemotron_h" and hf_name.endswith("q_proj.weight"):
        return [(hf_name, unpermute(w, c["num_attention_heads"]))]
    if c["model_type"] == "nemotron_h" and hf_name.endswith("k_proj.weight"):
        return [(hf_name, unpermute(w, c["num_key_value_heads"]))]
    if hf_name.endswith(("conv1d.weight", "conv.conv.weight")):
        return [(hf_name, w.unsqueeze(1))]
    if hf_name.endswith(".A_log"):
        return [(hf_name, torch.log(-w.reshape(-1)))]
    if hf_name.endswith((".D", "mixer.norm.weight", "mamba.norm.weight")):
        return [(hf_name, w.reshape(-1))]
    return [(hf_name, w)]
