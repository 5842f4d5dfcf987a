"""A GGUF file's tensors into our modules: names and layouts back to the HF checkpoint's (undoing what
llama.cpp's convert_hf_to_gguf.py changed), the decoder layers' linears kept quantized (QuantLinear.loaded), and
every other tensor (embeddings, LM head, norms, SSM parameters) dequantized to the model dtype.

Every tensor is read and checked before the model is touched, so a bad file leaves nothing half-loaded.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from runtime.gguf import config as gguf_config
from runtime.gguf.blocks import QUANT_TYPES, SUPPORTED, Quantized, concat_rows, decode, take_rows
from runtime.gguf.layouts import LAYOUTS, Layout
from runtime.hf_config import ConfigError
from runtime.kernels.quant_linear import dequantize as dequantize_ours
from runtime.layers.quantized import QuantLinear, quantizes

Tensor = torch.Tensor | Quantized
GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}
ATTENTION = {"attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
             "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight"}
LLAMA = {**ATTENTION, "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
         "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
         "ffn_down.weight": "mlp.down_proj.weight"}
GRANITE_HYBRID = {
    **ATTENTION, "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "ssm_in.weight": "mamba.in_proj.weight", "ssm_out.weight": "mamba.out_proj.weight",
    "ssm_conv1d.weight": "mamba.conv1d.weight", "ssm_conv1d.bias": "mamba.conv1d.bias",
    "ssm_dt.bias": "mamba.dt_bias", "ssm_a": "mamba.A_log", "ssm_d": "mamba.D", "ssm_norm.weight": "mamba.norm.weight",
    "ffn_down.weight": "shared_mlp.output_linear.weight", "ffn_down_shexp.weight": "shared_mlp.output_linear.weight",
    "ffn_gate_inp.weight": "block_sparse_moe.router.layer.weight",
    "ffn_down_exps.weight": "block_sparse_moe.output_linear.weight",
}
BAMBA = {**{k: v for k, v in GRANITE_HYBRID.items() if not k.startswith(("ffn_", "ssm_norm"))},
         "ssm_norm.weight": "mamba.norm.weight", "ffn_norm.weight": "pre_ff_layernorm.weight",
         "ffn_gate.weight": "feed_forward.gate_proj.weight", "ffn_up.weight": "feed_forward.up_proj.weight",
         "ffn_down.weight": "feed_forward.down_proj.weight"}
# GGUF tensors that the converter split from one HF tensor: (parts in row order) -> the HF name.
GRANITE_HYBRID_FUSED = {
    ("ffn_gate.weight", "ffn_up.weight"): "shared_mlp.input_linear.weight",
    ("ffn_gate_shexp.weight", "ffn_up_shexp.weight"): "shared_mlp.input_linear.weight",
    ("ffn_gate_exps.weight", "ffn_up_exps.weight"): "block_sparse_moe.input_linear.weight",
}
BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def _read(tensor) -> Tensor:
    """A GGUF tensor in torch's shape: floats as float32, quantized 2-D weights decoded, other quantized ones
    (3-D experts) dequantized by gguf."""
    qtype = T(tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape))
    if qtype in QUANT_TYPES and len(shape) == 2:
        return decode(np.asarray(tensor.data).reshape(shape[0], -1), qtype)
    data = dequantize(np.asarray(tensor.data), qtype) if qtype not in (T.F32,) else np.asarray(tensor.data)
    return torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape)


def _float(value: Tensor) -> torch.Tensor:
    if isinstance(value, Quantized):
        return dequantize_ours(value.qweight, value.scales, value.group_size, value.in_features, value.offsets)
    return value


def _unpermute(value: Tensor, heads: int) -> Tensor:
    """Undo convert_hf_to_gguf.py's LlamaModel.permute of q/k rows (rotary halves interleaved for llama.cpp)."""
    rows = value.rows if isinstance(value, Quantized) else value.shape[0]
    index = torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
    return take_rows(value, index) if isinstance(value, Quantized) else value[index]


def _check_types(path: Path) -> None:
    for tensor in gguf_config.reader(path).tensors:
        qtype = T(tensor.tensor_type)
        if qtype not in SUPPORTED:
            raise ConfigError(f"{path.name}: tensor {tensor.name} is {qtype.name}, which Tandem cannot run; "
                              f"supported GGUF tensor types: {', '.join(t.name for t in SUPPORTED)}")


def _expert(tensor, index: int) -> Tensor:
    """Expert `index` of a stacked (experts, rows, in) GGUF tensor, quantized ones decoded like 2-D weights."""
    qtype = T(tensor.tensor_type)
    experts, rows = (int(n) for n in reversed(tensor.shape[1:]))
    if qtype in QUANT_TYPES:
        return decode(np.asarray(tensor.data).reshape(experts, rows, -1)[index], qtype)
    data = np.asarray(tensor.data).reshape(experts, rows, -1)[index]
    data = data if qtype == T.F32 else dequantize(np.ascontiguousarray(data), qtype)
    return torch.from_numpy(np.array(data, dtype=np.float32))


def _qkvz_rows(hf: dict) -> torch.Tensor:
    """For each row of Qwen3-Next's in_proj_qkvz, its row in attn_qkv + attn_gate: the converter regrouped each
    key head's [q, k, v, z] blocks into [all q, all k, all v] and [all z]."""
    dk, dv = hf["linear_key_head_dim"], hf["linear_value_head_dim"]
    nk, nv = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
    widths = [dk, dk, nv // nk * dv, nv // nk * dv]
    starts = np.cumsum([0] + [nk * w for w in widths])
    rows = [starts[part] + head * widths[part] + torch.arange(widths[part])
            for head in range(nk) for part in range(4)]
    return torch.cat(rows)


def _joined_qkvz(qkv: Tensor, gate: Tensor, hf: dict) -> Tensor:
    joined = concat_rows([qkv, gate]) if isinstance(qkv, Quantized) and isinstance(gate, Quantized) else None
    if joined is not None:
        return take_rows(joined, _qkvz_rows(hf))
    return torch.cat([_float(qkv), _float(gate)])[_qkvz_rows(hf)]


def _family_tensors(path: Path, hf: dict, layout: Layout) -> tuple[dict[str, Tensor], dict[str, str]]:
    """hf_tensors for the families runtime/gguf/layouts.py lays out."""
    arch = gguf_config.architecture(path)
    nextn = gguf_config.field(path, f"{arch}.nextn_predict_layers", 0) or 0
    out, sources, qkvz = {}, {}, {}
    for name, tensor in ((t.name, t) for t in gguf_config.reader(path).tensors):
        match = BLOCK.fullmatch(name)
        suffix = match.group(2) if match else None
        if match and nextn and int(match.group(1)) >= hf["num_hidden_layers"]:
            continue  # a multi-token-prediction block, which the engine does not run
        if match and suffix in layout.experts:
            for e in range(int(tensor.shape[-1])):
                hf_name = layout.layer.format(match.group(1)) + layout.experts[suffix].format(e=e)
                out[hf_name], sources[hf_name] = _expert(tensor, e), f"{name}[{e}]"
            continue
        if match and layout.qkvz and suffix in ("attn_qkv.weight", "attn_gate.weight"):
            qkvz.setdefault(match.group(1), {})[suffix] = _read(tensor)
            continue
        hf_name = layout.top.get(name) if match is None else (
            layout.layer.format(match.group(1)) + layout.table[suffix] if suffix in layout.table else None)
        if hf_name is None:
            raise ConfigError(f"{path.name}: unexpected tensor {name} for GGUF architecture {arch!r}")
        try:
            value = _transform(suffix, _read(tensor), hf, path, name, layout.permuted)
        except (RuntimeError, ValueError) as err:  # a reshape the metadata's sizes do not allow
            raise ConfigError(f"{path.name}: tensor {name} of shape {gguf_config.tensor_shape(path, name)} does not "
                              f"fit the metadata ({err})") from None
        if layout.norm_offset and name.endswith("norm.weight") and suffix != "ssm_norm.weight":
            value = _float(value) - layout.norm_offset  # stored as offset + w
        out[hf_name], sources[hf_name] = value, name
    for layer, parts in qkvz.items():
        if set(parts) != {"attn_qkv.weight", "attn_gate.weight"}:
            raise ConfigError(f"{path.name}: block {layer} holds {', '.join(parts)} without its other half "
                              "(attn_qkv and attn_gate make the Gated DeltaNet's input projection together)")
        hf_name = layout.layer.format(layer) + layout.qkvz
        try:
            out[hf_name] = _joined_qkvz(parts["attn_qkv.weight"], parts["attn_gate.weight"], hf)
        except (IndexError, RuntimeError) as err:
            raise ConfigError(f"{path.name}: blk.{layer}.attn_qkv/attn_gate do not fit the metadata's Gated "
                              f"DeltaNet sizes ({err})") from None
        sources[hf_name] = f"blk.{layer}.attn_qkv.weight + blk.{layer}.attn_gate.weight"
    return out, sources


def hf_tensors(path: Path, hf: dict) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The file's tensors under their HF checkpoint names, in the HF layout, and the GGUF tensor(s) each came from."""
    arch = gguf_config.architecture(path)
    if hf["model_type"] in LAYOUTS:
        _check_types(path)
        return _family_tensors(path, hf, LAYOUTS[hf["model_type"]])
    table, fused = {"llama": (LLAMA, {}), "bamba": (BAMBA, {}),
                    "granitemoehybrid": (GRANITE_HYBRID, GRANITE_HYBRID_FUSED)}[hf["model_type"]]
    top = {**GLOBAL, "output_norm.weight": "model.final_layernorm.weight"} if hf["model_type"] == "bamba" else GLOBAL
    _check_types(path)
    raw = {t.name: t for t in gguf_config.reader(path).tensors}
    out, used, sources = {}, set(), {}
    for parts, hf_name in fused.items():
        for layer in range(hf["num_hidden_layers"]):
            names = [f"blk.{layer}.{part}" for part in parts]
            if all(name in raw for name in names):
                values = [_read(raw[name]) for name in names]
                joined = concat_rows(values) if all(isinstance(v, Quantized) for v in values) else None
                out[f"model.layers.{layer}.{hf_name}"] = joined or torch.cat([_float(v) for v in values], dim=-2)
                sources[f"model.layers.{layer}.{hf_name}"] = " + ".join(names)
                used.update(names)
    for name, tensor in raw.items():
        if name in used:
            continue
        match = BLOCK.fullmatch(name)
        suffix = match.group(2) if match else None
        hf_name = top.get(name) if match is None else (
            f"model.layers.{match.group(1)}.{table[suffix]}" if suffix in table else None)
        if hf_name is None:
            raise ConfigError(f"{path.name}: unexpected tensor {name} for GGUF architecture {arch!r}")
        try:
            out[hf_name], sources[hf_name] = _transform(suffix, _read(tensor), hf, path, name), name
        except (RuntimeError, ValueError) as err:  # a reshape the metadata's sizes do not allow
            raise ConfigError(f"{path.name}: tensor {name} of shape {gguf_config.tensor_shape(path, name)} does not "
                              f"fit the metadata ({err})") from None
    return out, sources


def _transform(suffix: str | None, value: Tensor, hf: dict, path: Path, name: str, permuted: bool = True) -> Tensor:
    """The HF layout of one tensor the converter reshaped or rewrote."""
    heads, kv_heads = hf.get("num_attention_heads"), hf.get("num_key_value_heads")
    if suffix == "attn_q.weight" and permuted:
        return _unpermute(value, heads)
    if suffix == "attn_k.weight" and permuted:
        return _unpermute(value, kv_heads)
    if suffix in ("ssm_a", "ssm_d", "ssm_conv1d.weight", "ssm_norm.weight", "shortconv.conv.weight"):
        value = _float(value)
    if suffix == "shortconv.conv.weight":  # squeezed from (channels, 1, kernel)
        return value.unsqueeze(1)
    if suffix == "ssm_a":  # stored as A = -exp(A_log); Mamba-2's as (heads, 1), Mamba's (inner, state) as it is
        a_log = torch.log(-value.double()).float()
        return a_log.reshape(-1) if a_log.dim() == 2 and a_log.shape[1] == 1 else a_log
    if suffix == "ssm_d":
        return value.reshape(-1)
    if suffix == "ssm_conv1d.weight":  # squeezed from (channels, 1, kernel)
        return value.unsqueeze(1)
    if suffix == "ssm_norm.weight":  # reshaped to (groups, inner / groups)
        return value.reshape(-1)
    return value


def _shape(value: Tensor) -> tuple[int, ...]:
    return (value.rows, value.in_features) if isinstance(value, Quantized) else tuple(value.shape)


def load_gguf_weights(model: torch.nn.Module, path: Path, hf: dict, dtype: torch.dtype, device: torch.device,
                      allocate: Callable[[torch.nn.Module], None]) -> int:
    """Fill `model`, built with its parameters on the meta device, from the GGUF file: the quantized linears are
    swapped in first, so that their float weights are never allocated; `allocate` gives the other parameters
    memory (and ties the embeddings). Returns how many linears stay quantized."""
    tensors, sources = hf_tensors(path, hf)
    params = dict(model.named_parameters())
    plan: dict[str, Tensor] = {}
    for hf_name, value in tensors.items():
        target = model.checkpoint_name(hf_name)
        if target is None:
            continue
        if target not in params:
            raise ConfigError(f"{path.name}: tensor {sources[hf_name]} has no place in the model; "
                              "does the metadata match the tensors?")
        if _shape(value) != tuple(params[target].shape):
            raise ConfigError(f"{path.name}: tensor {sources[hf_name]} has shape {_shape(value)} (as {hf_name}) but "
                              f"the metadata makes it {tuple(params[target].shape)}; the file is inconsistent")
        plan[target] = value
    count = _swap_quantized(model, plan, dtype, device)
    allocate(model)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(plan))
    if missing:
        raise ConfigError(f"{path.name}: tensors missing from the GGUF file for {', '.join(missing[:5])}")
    with torch.no_grad():
        for target, param in params.items():
            param.copy_(_float(plan[target]))
    return count


def _swap_quantized(model: torch.nn.Module, plan: dict[str, Tensor], dtype: torch.dtype, device: torch.device) -> int:
    """Replace each decoder nn.Linear whose weight the file holds quantized by a QuantLinear (its plan entries,
    weight and bias, are consumed)."""
    swapped = [name.removesuffix(".weight") for name, value in plan.items() if isinstance(value, Quantized)]
    count = 0
    for module_name in swapped:
        module = model.get_submodule(module_name)
        if not isinstance(module, torch.nn.Linear) or not quantizes(module_name):
            continue
        value = plan.pop(f"{module_name}.weight")
        bias = plan.pop(f"{module_name}.bias", None)
        parent_name, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, QuantLinear.loaded(
            value.in_features, f"gguf-{value.kind.lower()}", dtype, *_to(device, value.qweight, value.scales),
            value.group_size, *_to(device, value.offsets, None if bias is None else _float(bias))))
        count += 1
    return count


def _to(device, *tensors):
    return [None if t is None else t.to(device) for t in tensors]
