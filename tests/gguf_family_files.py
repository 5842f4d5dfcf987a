"""GGUF files of the recurrent and hybrid families (mamba, mamba2, nemotron_h / nemotron_h_moe, falcon-h1, lfm2,
qwen3next, jamba) written from tiny HF checkpoints as llama.cpp's convert_hf_to_gguf.py writes them (its vendored
copy in the llama-cpp-python 0.3.36 sdist: conversion/mamba.py, nemotron.py, falcon_h1.py, lfm2.py, qwen.py,
jamba.py), and the HF checkpoint the file stands for.

Tensor names come from gguf's TensorNameMap, as the converter's map_tensor_name takes them. What the converter
changes, and read_back undoes for the oracle:
- Mamba-2 mixers (all four but lfm2): A = -exp(A_log) and D as (heads, 1), the conv squeezed to (channels, kernel),
  the gated norm as (groups, inner / groups), dt_bias renamed to the ssm_dt bias;
- nemotron_h: q/k rows permuted (LlamaModel.permute, through GraniteHybridModel), the experts stacked into 3-D
  tensors; a config.json with num_experts_per_tok converts as nemotron_h_moe;
- falcon-h1: every muP multiplier multiplied into the weights (the file is a Falcon-H1 with multipliers of 1);
- lfm2: the short conv squeezed to (channels, kernel);
- mamba and jamba: A = -exp(A_log) (inner, state), the conv squeezed; jamba's experts stacked;
- qwen3next (as with --no-mtp): norms stored as 1 + w (all but the Gated DeltaNet's), A = -exp(A_log), the conv
  squeezed, in_proj_qkvz's per-key-head [q, k, v, z] blocks regrouped into attn_qkv ([all q, all k, all v]) and
  attn_gate (all z), the experts stacked.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf_family_metadata import mamba2_sizes, metadata
from gguf_files import _tokenizer, permute, quantize, unpermute
from safetensors.torch import load_file, save_file

FALCON_MULTIPLIERS = ("embedding_multiplier", "lm_head_multiplier", "key_multiplier", "attention_in_multiplier",
                      "attention_out_multiplier", "ssm_in_multiplier", "ssm_out_multiplier")
EXPERT = re.compile(r"(.+)\.layers\.(\d+)\.(mixer|mlp|feed_forward)\.experts\.(\d+)\.(\w+)\.weight")


def arch_of(c: dict) -> str:
    if c["model_type"] == "nemotron_h":
        return "nemotron_h_moe" if "num_experts_per_tok" in c else "nemotron_h"
    return {"mamba2": "mamba2", "mamba": "mamba", "falcon_mamba": "mamba", "falcon_h1": "falcon-h1", "lfm2": "lfm2",
            "qwen3_next": "qwen3next", "jamba": "jamba"}[c["model_type"]]


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
    if c["model_type"] in ("mamba", "falcon_mamba", "jamba"):
        return -torch.exp(w) if name.endswith(".A_log") else w.squeeze() if name.endswith("conv1d.weight") else w
    if c["model_type"] == "qwen3_next":
        return _qwen3next(name, w)
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
        groups, inner = mamba2_sizes(c)
        return w.reshape(groups, inner // groups)
    return w


def _qwen3next(name: str, w: torch.Tensor) -> torch.Tensor:
    if name.endswith(".A_log"):
        return -torch.exp(w)
    if "conv1d" in name:
        return w.squeeze()
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return w + 1
    return w


def _split_qkvz(w: torch.Tensor, c: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3NextModel.modify_tensors' regrouping of in_proj_qkvz into (attn_qkv, attn_gate)."""
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    nk, nv, hidden = c["linear_num_key_heads"], c["linear_num_value_heads"], c["hidden_size"]
    split = [dk, dk, nv // nk * dv, nv // nk * dv]
    q, k, v, z = torch.split(w.permute(1, 0).contiguous().view(-1, nk, sum(split)), split, dim=-1)
    q, k, v, z = (t.contiguous().view(hidden, -1) for t in (q, k, v, z))
    return torch.cat([q, k, v], dim=-1).permute(1, 0).contiguous(), z.permute(1, 0).contiguous()


def _join_qkvz(qkv: torch.Tensor, z: torch.Tensor, c: dict) -> torch.Tensor:
    """_split_qkvz's inverse: each key head's [q, k, v, z] rows back together."""
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    q, k, v = torch.split(qkv, [nk * dk, nk * dk, nv * dv])
    heads = [t.reshape(nk, -1, t.shape[-1]) for t in (q, k, v, z)]
    return torch.cat(heads, dim=1).reshape(-1, qkv.shape[-1])


def converted_tensors(directory: Path) -> list[tuple[str, torch.Tensor]]:
    """(GGUF name, float data) of every tensor the converter writes, the experts stacked."""
    c = json.loads((directory / "config.json").read_text())
    state = load_file(directory / "model.safetensors")
    out, experts = [], {}
    for name, w in state.items():
        if (match := EXPERT.fullmatch(name)) is not None:
            experts.setdefault((int(match.group(2)), match.group(5)), {})[int(match.group(4))] = w.float()
            continue
        if name.endswith("in_proj_qkvz.weight"):
            layer = name.split(".")[2]
            qkv, z = _split_qkvz(w.float(), c)
            out += [(f"blk.{layer}.attn_qkv.weight", qkv), (f"blk.{layer}.attn_gate.weight", z)]
            continue
        out.append((_gguf_name(name, c), _converted(name, w.float(), c)))
    for (layer, proj), parts in sorted(experts.items()):
        stacked = torch.stack([parts[e] for e in range(len(parts))])
        out.append((_gguf_name(f"model.layers.{layer}.mlp.experts.{proj}.weight", c), stacked))
    return out


def write_family_gguf(directory: Path, out: Path, types: Callable[[str, tuple[int, ...]], T],
                      file_type: gguf.LlamaFileType | None = None) -> None:
    c = json.loads((directory / "config.json").read_text())
    tensors = converted_tensors(directory)
    if c.get("tie_word_embeddings"):
        tensors = [(n, t) for n, t in tensors if n != "output.weight"]
    writer = gguf.GGUFWriter(out, arch_of(c))
    writer.add_name(directory.name)
    metadata(writer, arch_of(c), c, tensors)
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
    state, qkvz = {}, {}
    for tensor in gguf.GGUFReader(path).tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))
        data = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        w = torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape)
        if tensor.name.endswith(("attn_qkv.weight", "attn_gate.weight")):
            qkvz.setdefault(tensor.name.split(".")[1], {})[tensor.name.split(".")[2]] = w
            continue
        for hf_name, value in _restored(hf_names[tensor.name], w, c):
            state[hf_name] = value.contiguous()
    for layer, parts in qkvz.items():
        name = f"model.layers.{layer}.linear_attn.in_proj_qkvz.weight"
        state[name] = _join_qkvz(parts["attn_qkv"], parts["attn_gate"], c).contiguous()
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
        if (match := EXPERT.fullmatch(name)) is not None:
            prefix, layer, block, _, proj = match.groups()
            key = _gguf_name(f"model.layers.{layer}.mlp.experts.{proj}.weight", c)
            out[key] = (f"{prefix}.layers.{layer}.{block}.experts.{{e}}.{proj}.weight",)
        elif not name.endswith("in_proj_qkvz.weight"):
            out[_gguf_name(name, c)] = name
    return out


def _restored(hf_name, w: torch.Tensor, c: dict) -> list[tuple[str, torch.Tensor]]:
    if isinstance(hf_name, tuple):
        return [(hf_name[0].format(e=e), w[e]) for e in range(w.shape[0])]
    if c["model_type"] == "qwen3_next" and hf_name.endswith("norm.weight") and "linear_attn" not in hf_name:
        return [(hf_name, w - 1)]
    if c["model_type"] == "nemotron_h" and hf_name.endswith("q_proj.weight"):
        return [(hf_name, unpermute(w, c["num_attention_heads"]))]
    if c["model_type"] == "nemotron_h" and hf_name.endswith("k_proj.weight"):
        return [(hf_name, unpermute(w, c["num_key_value_heads"]))]
    if hf_name.endswith(("conv1d.weight", "conv.conv.weight")):
        return [(hf_name, w.unsqueeze(1))]
    if hf_name.endswith(".A_log"):
        return [(hf_name, torch.log(-w if c["model_type"] in ("mamba", "jamba") else -w.reshape(-1)))]
    if hf_name.endswith((".D", "mixer.norm.weight", "mamba.norm.weight")):
        return [(hf_name, w.reshape(-1))]
    return [(hf_name, w)]
