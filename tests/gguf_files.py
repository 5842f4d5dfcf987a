"""Tiny GGUF files written from tiny HF checkpoints as llama.cpp's convert_hf_to_gguf.py lays them out (its
vendored copy in the llama-cpp-python 0.3.36 sdist: conversion/llama.py, granite.py, mamba.py), and the HF state
dict the file stands for (its tensors dequantized by gguf.quants.dequantize, the converter's changes undone), to
run transformers on as the oracle.

gguf.quants quantizes Q8_0 and Q4_0 but not the K-quants: encode_q4_k / encode_q6_k write their blocks here
(round to nearest with per-group scales; any valid blocks do, since the oracle dequantizes what was written).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file

F16 = np.float16


def _scale_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(F16).view(np.uint8).reshape(x.shape[0], 2)


def encode_q4_k(w: np.ndarray) -> np.ndarray:
    """(N, K) float32 -> Q4_K blocks, uint8 (N, K / 256 * 144)."""
    blocks = w.reshape(-1, 8, 32).astype(np.float32)
    low = np.minimum(blocks.min(axis=2), 0)
    scale, minimum = (blocks.max(axis=2) - low) / 15, -low
    # An all-zero row (the padding token's embedding) still needs a nonzero float16 scale.
    d = np.maximum(scale.max(axis=1) / 63, 1e-6)
    dmin = np.maximum(minimum.max(axis=1) / 63, 1e-6)
    d, dmin = d.astype(F16).astype(np.float32), dmin.astype(F16).astype(np.float32)
    sc = np.clip(np.round(scale / d[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.round(minimum / dmin[:, None]), 0, 63).astype(np.uint8)
    step, offset = (d[:, None] * sc)[:, :, None], (dmin[:, None] * m)[:, :, None]
    u = np.clip(np.round((blocks + offset) / step), 0, 15).astype(np.uint8)
    packed_scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                                    (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)], axis=1)
    u = u.reshape(-1, 4, 2, 32)  # sub-block 2j in the low nibbles of bytes 32j.., 2j + 1 in the high ones
    qs = (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(-1, 128)
    out = np.concatenate([_scale_bytes(d), _scale_bytes(dmin), packed_scales, qs], axis=1)
    return out.reshape(w.shape[0], -1)


def encode_q6_k(w: np.ndarray) -> np.ndarray:
    """(N, K) float32 -> Q6_K blocks, uint8 (N, K / 256 * 210)."""
    blocks = w.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(blocks).max(axis=2) / 31
    d = np.maximum(scale.max(axis=1) / 127, 1e-6).astype(F16).astype(np.float32)
    sc = np.clip(np.round(scale / d[:, None]), 1, 127).astype(np.int8)
    q = np.clip(np.round(blocks / (d[:, None] * sc)[:, :, None]), -32, 31).astype(np.int16)
    u = (q + 32).astype(np.uint8).reshape(-1, 2, 128)  # two halves of 128 values
    ql = (u[:, :, :64] & 0x0F) | ((u[:, :, 64:] & 0x0F) << 4)  # (blocks, 2, 64)
    high = (u >> 4).reshape(-1, 2, 4, 32)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    out = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _scale_bytes(d)], axis=1)
    return out.reshape(w.shape[0], -1)


def quantize(w: np.ndarray, qtype: T) -> np.ndarray:
    if qtype == T.F32:
        return w.astype(np.float32)
    if qtype == T.Q4_K:
        return encode_q4_k(w)
    if qtype == T.Q6_K:
        return encode_q6_k(w)
    return gguf.quants.quantize(w.astype(np.float32), qtype)


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute (q and k rows, for llama.cpp's rotary layout)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer(writer: gguf.GGUFWriter, directory: Path, config: dict) -> None:
    """The converter's _set_vocab_gpt2: tokens by id, control tokens for the added ones, merges, special ids."""
    data = json.loads((directory / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    added = {t["id"] for t in data["added_tokens"]}
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if vocab[t] in added else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])


def _llama_metadata(w: gguf.GGUFWriter, c: dict) -> None:
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(c.get("rope_theta") or c.get("rope_parameters", {}).get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(c["vocab_size"])
    w.add_rope_dimension_count(head_dim)


def _bamba_metadata(w: gguf.GGUFWriter, c: dict) -> None:
    """GraniteHybridModel's metadata for a Bamba checkpoint: RoPE (over attn_rotary_emb dimensions), no scales."""
    attention = c["attn_layer_indices"]
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv([c["num_key_value_heads"] if i in attention else 0 for i in range(c["num_hidden_layers"])])
    w.add_rope_freq_base(c.get("rope_theta") or c.get("rope_parameters", {}).get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_vocab_size(c["vocab_size"])
    w.add_rope_dimension_count(c.get("attn_rotary_emb") or c["hidden_size"] // c["num_attention_heads"])
    w.add_ssm_conv_kernel(c["mamba_d_conv"])
    w.add_ssm_state_size(c["mamba_d_state"])
    w.add_ssm_group_count(c["mamba_n_groups"])
    w.add_ssm_inner_size(c["mamba_n_heads"] * c["mamba_d_head"])
    w.add_ssm_time_step_rank(c["mamba_n_heads"])
    w.add_rope_scaling_finetuned(True)


def _granitehybrid_metadata(w: gguf.GGUFWriter, c: dict) -> None:
    attention = [i for i, t in enumerate(c["layer_types"]) if t in ("attention", "full_attention")]
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(2 ** 20)  # Granite 4.0 has no position embedding
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv([c["num_key_value_heads"] if i in attention else 0 for i in range(c["num_hidden_layers"])])
    w.add_rope_freq_base(c.get("rope_theta") or c.get("rope_parameters", {}).get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_count(c["num_local_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_vocab_size(c["vocab_size"])
    w.add_rope_dimension_count(c["hidden_size"] // c["num_attention_heads"])
    w.add_attention_scale(c["attention_multiplier"])
    w.add_embedding_scale(c["embedding_multiplier"])
    w.add_residual_scale(c["residual_multiplier"])
    w.add_logit_scale(c["logits_scaling"])
    w.add_expert_shared_feed_forward_length(c["shared_intermediate_size"])
    w.add_ssm_conv_kernel(c["mamba_d_conv"])
    w.add_ssm_state_size(c["mamba_d_state"])
    w.add_ssm_group_count(c["mamba_n_groups"])
    w.add_ssm_inner_size(c["mamba_n_heads"] * c["mamba_d_head"])
    w.add_ssm_time_step_rank(c["mamba_n_heads"])
    w.add_rope_scaling_finetuned(c.get("position_embedding_type") == "rope")


LLAMA = {"self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
         "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
         "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight"}
GRANITE_HYBRID = {**LLAMA, "mamba.in_proj.weight": "ssm_in.weight", "mamba.out_proj.weight": "ssm_out.weight",
                  "mamba.conv1d.weight": "ssm_conv1d.weight", "mamba.conv1d.bias": "ssm_conv1d.bias",
                  "mamba.dt_bias": "ssm_dt.bias", "mamba.A_log": "ssm_a", "mamba.D": "ssm_d",
                  "mamba.norm.weight": "ssm_norm.weight", "shared_mlp.output_linear.weight": "ffn_down.weight"}
BAMBA = {**{k: v for k, v in GRANITE_HYBRID.items() if not v.startswith("ffn_")},
         "pre_ff_layernorm.weight": "ffn_norm.weight", "feed_forward.gate_proj.weight": "ffn_gate.weight",
         "feed_forward.up_proj.weight": "ffn_up.weight", "feed_forward.down_proj.weight": "ffn_down.weight"}
TABLES = {"llama": LLAMA, "granitemoehybrid": GRANITE_HYBRID, "bamba": BAMBA}
ARCHS = {"llama": "llama", "granitemoehybrid": "granitehybrid", "bamba": "granitehybrid"}
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}


def _globals(c: dict) -> dict[str, str]:
    return {**GLOBAL, "model.final_layernorm.weight": "output_norm.weight"} if c["model_type"] == "bamba" else GLOBAL


def _converted(name: str, w: torch.Tensor, c: dict) -> list[tuple[str, torch.Tensor]]:
    """The GGUF tensors (name, float data) the converter writes for one HF tensor."""
    if name in _globals(c):
        return [(_globals(c)[name], w)]
    _, _, layer, rest = name.split(".", 3)
    table = TABLES[c["model_type"]]
    if rest == "shared_mlp.input_linear.weight":
        gate, up = w.split(c["shared_intermediate_size"], dim=-2)
        return [(f"blk.{layer}.ffn_gate.weight", gate), (f"blk.{layer}.ffn_up.weight", up)]
    out = f"blk.{layer}.{table[rest]}"
    if rest == "self_attn.q_proj.weight":
        w = permute(w, c["num_attention_heads"])
    elif rest == "self_attn.k_proj.weight":
        w = permute(w, c["num_key_value_heads"])
    elif rest == "mamba.conv1d.weight":
        w = w.squeeze()
    elif rest in ("mamba.A_log", "mamba.D"):
        w = w.reshape(-1, 1)
        if rest == "mamba.A_log":
            w = -torch.exp(w)
    elif rest == "mamba.norm.weight":
        w = w.reshape(c["mamba_n_groups"], -1)
    return [(out, w)]


def _restored(gguf_name: str, w: torch.Tensor, c: dict) -> torch.Tensor:
    """_converted's inverse for one GGUF tensor (the oracle's reading)."""
    if gguf_name.endswith("attn_q.weight"):
        return unpermute(w, c["num_attention_heads"])
    if gguf_name.endswith("attn_k.weight"):
        return unpermute(w, c["num_key_value_heads"])
    if gguf_name.endswith("ssm_conv1d.weight"):
        return w.unsqueeze(1)
    if gguf_name.endswith("ssm_a"):
        return torch.log(-w.reshape(-1))
    if gguf_name.endswith(("ssm_d", "ssm_norm.weight")):
        return w.reshape(-1)
    return w


def default_types(qtype: T) -> Callable[[str, tuple[int, ...]], T]:
    """llama.cpp's choice for a whole-file type: 2-D weights (not norms, not the conv) in `qtype` where their rows
    are whole blocks, everything else F32."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]

    def pick(name: str, shape: tuple[int, ...]) -> T:
        if len(shape) != 2 or "norm" in name or "conv1d" in name or shape[-1] % block:
            return T.F32
        return qtype
    return pick


def q4_k_m(name: str, shape: tuple[int, ...]) -> T:
    """A Q4_K_M file's mix (llama-quantize): Q6_K for the LM head, attn_v and ffn_down, Q4_K for the rest."""
    if len(shape) != 2 or "norm" in name or "conv1d" in name or shape[-1] % 256:
        return T.F32
    return T.Q6_K if name == "output.weight" or name.endswith(("attn_v.weight", "ffn_down.weight")) else T.Q4_K


def write_gguf(directory: Path, out: Path, types: Callable[[str, tuple[int, ...]], T],
               file_type: gguf.LlamaFileType | None = None) -> dict[str, torch.Tensor]:
    """Write `directory`'s checkpoint as a GGUF file at `out`; returns the HF state dict it stands for."""
    c = json.loads((directory / "config.json").read_text())
    state = load_file(directory / "model.safetensors")
    writer = gguf.GGUFWriter(out, ARCHS[c["model_type"]])
    writer.add_name(directory.name)
    {"llama": _llama_metadata, "granitemoehybrid": _granitehybrid_metadata, "bamba": _bamba_metadata}[
        c["model_type"]](writer, c)
    if file_type is not None:
        writer.add_file_type(file_type)
    _tokenizer(writer, directory, c)
    for name, w in state.items():
        for gguf_name, data in _converted(name, w.float(), c):
            qtype = types(gguf_name, tuple(data.shape))
            writer.add_tensor(gguf_name, quantize(data.numpy(), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return read_back(out, c)


def read_back(path: Path, c: dict) -> dict[str, torch.Tensor]:
    """The HF state dict a GGUF file stands for: every tensor dequantized by gguf.quants.dequantize, renamed and
    restored to the HF layout, the split gate/up projections joined (`c`: the HF config.json)."""
    table = TABLES[c["model_type"]]
    names = {v: k for k, v in _globals(c).items()}
    pieces: dict[str, list[torch.Tensor]] = {}
    for tensor in gguf.GGUFReader(path).tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))
        data = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        w = _restored(tensor.name, torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape), c)
        if tensor.name in names:
            pieces[names[tensor.name]] = [w]
            continue
        _, layer, suffix = tensor.name.split(".", 2)
        granite = c["model_type"] == "granitemoehybrid"
        if granite and suffix in ("ffn_gate.weight", "ffn_up.weight"):
            pieces.setdefault(f"model.layers.{layer}.shared_mlp.input_linear.weight", [None, None])[
                suffix == "ffn_up.weight"] = w
            continue
        hf = {v: k for k, v in table.items()}[suffix]
        if granite and suffix == "ffn_down.weight":
            hf = "shared_mlp.output_linear.weight"
        pieces[f"model.layers.{layer}.{hf}"] = [w]
    return {name: torch.cat(parts, dim=-2) if len(parts) > 1 else parts[0] for name, parts in pieces.items()}
