"""Qwen3-Next's and Qwen3.5's multi-token-prediction head (the checkpoint's `mtp.*`), as vLLM runs it
(vllm/model_executor/models/qwen3_next_mtp.py, qwen3_5_mtp.py), for speculative decoding.

At position p the head takes the target's final (post-norm) hidden state h_p and the embedding of the
token at p + 1, normalises each (`pre_fc_norm_embedding`, `pre_fc_norm_hidden`), projects
concat([embedding, hidden]) with `fc` back to the hidden size, runs one full-attention decoder layer of
the model (`layers.0`: gated attention and the model's MLP or experts) and `norm`; the target's LM head
then predicts the token at p + 2. For more drafts the head runs again on its own output.

Its attention has a cache of its own (HeadKV: one contiguous K and V per sequence, outside the page pool),
filled with the positions the head has run on; runtime/spec_decode/mtp.py owns it.

A quantized checkpoint's head is read as the model is (runtime/quant/loading.py): each linear whose `mtp.*`
tensors carry a scale is a QuantLinear in the checkpoint's format (Qwen's FP8 releases ship the head beside the
model, its experts in FP8 blocks in some), the rest in the model's dtype.

With more than one process the head runs unsharded in rank 0's process alone, on the final hidden states rank
0 holds whole: after the all-reduce under tensor parallelism, sent by the last stage under pipeline parallelism.
The model's embedding and LM head there are vocabulary shards whose forward passes are collectives the other
ranks do not join, or (the first pipeline stage) there is no LM head, so the head reads whole copies of both
from the checkpoint (WholeVocabulary).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from runtime.layers.gated_attention import ZeroCenteredRMSNorm
from runtime.loader import checkpoint_files, read_tensors
from runtime.models.interface import LayerKind
from runtime.options import spell
from runtime.quant.config import CheckpointQuant
from runtime.quant import loading as quant_loading
from runtime.quant.convert import QuantTensorError
from runtime.quant.loading import MARKERS

PREFIX = "mtp."
DEDICATED_EMBEDDING = "mtp.embed_tokens.weight"  # Qwen3.5's mtp_use_dedicated_embeddings


class HeadKV:
    """One sequence's K and V for the head's attention layer, grown by doubling; rolled back by truncation."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None  # (capacity, num_kv_heads, head_dim)
        self.v: torch.Tensor | None = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        end = self.length + k.shape[0]
        if self.k is None or end > self.k.shape[0]:
            capacity = max(16, 2 * end)
            grown_k, grown_v = k.new_empty((capacity, *k.shape[1:])), v.new_empty((capacity, *v.shape[1:]))
            if self.k is not None:
                grown_k[: self.length], grown_v[: self.length] = self.k[: self.length], self.v[: self.length]
            self.k, self.v = grown_k, grown_v
        self.k[self.length : end], self.v[self.length : end] = k, v
        self.length = end

    def truncate(self, length: int) -> None:
        assert length <= self.length
        self.length = length


class WholeVocabulary:
    """The model's embedding and LM head, unsharded (a tensor-parallel rank holds its rows of each)."""

    def __init__(self, embedding: torch.Tensor, lm_head: torch.Tensor):
        self.embedding, self.lm_head = embedding, lm_head

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.embedding)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # CausalLM.compute_logits with the whole LM head: Qwen3-Next's and Qwen3.5's logits are not scaled.
        return F.linear(hidden.to(self.lm_head.dtype), self.lm_head).float()


class HeadAttention(nn.Module):
    """Stands in for GatedAttention's PagedAttention: attends over `self.kv` (bound before each call) and
    the call's own rows, causally."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.scale = num_heads, num_kv_heads, head_dim**-0.5
        self.kv: HeadKV | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (T, heads, head_dim); k, v: (T, kv_heads, head_dim) -> (T, heads * head_dim)."""
        kv, num_new = self.kv, q.shape[0]
        past = kv.length
        kv.append(k, v)
        keys, values = kv.k[: kv.length], kv.v[: kv.length]
        repeat = self.num_heads // self.num_kv_heads
        keys, values = keys.repeat_interleave(repeat, dim=1), values.repeat_interleave(repeat, dim=1)
        # Row i sees every earlier entry and the new rows up to itself.
        rows, columns = torch.arange(num_new, device=q.device), torch.arange(kv.length, device=q.device)
        allowed = columns[None, :] <= past + rows[:, None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                             attn_mask=allowed, scale=self.scale)
        return out.transpose(0, 1).flatten(1)


class Qwen3NextMTP(nn.Module):
    """The checkpoint's `mtp.*`, named as it names them."""

    def __init__(self, dims, decoder_layer: type[nn.Module], num_layers: int, dedicated_embedding: bool):
        super().__init__()
        hidden = dims.hidden_size
        # vLLM builds `layers.N` as a full-attention layer of index N: experts where the model's rule puts
        # them at that index (the MoE models: every layer's rule gives index 0 experts).
        moe = bool(dims.moe_layers) and dims.moe_layers[0]
        layer_dims = dataclasses.replace(dims, layers=(LayerKind.ATTENTION,),
                                         moe_layers=(moe,) if dims.moe_layers else ())
        self.layers = nn.ModuleList(decoder_layer(layer_dims, 0) for _ in range(num_layers))
        for layer in self.layers:
            layer.self_attn.attn = HeadAttention(dims.num_heads, dims.num_kv_heads, dims.head_dim)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(hidden, dims.rms_norm_eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(hidden, dims.rms_norm_eps)
        self.norm = ZeroCenteredRMSNorm(hidden, dims.rms_norm_eps)
        self.embed_tokens = nn.Embedding(dims.vocab_size, hidden) if dedicated_embedding else None
        self.vocabulary: WholeVocabulary | None = None  # under tensor parallelism (load_mtp_head)

    def forward(self, embeddings: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: HeadKV, step: int = 0) -> torch.Tensor:
        """embeddings: (T, hidden) of the tokens at p + 1; hidden: (T, hidden) at p (the target's, or the
        head's own output) -> the head's output at p (T, hidden), normed; appends p's K and V to `kv`."""
        x = torch.cat([self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)], dim=-1)
        layer = self.layers[step % len(self.layers)]
        layer.self_attn.attn.kv = kv
        try:
            out = layer(self.fc(x), cos, sin)
        finally:
            layer.self_attn.attn.kv = None
        return self.norm(out)


def _mtp_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    # Read while its file is open: the head is one layer's worth of tensors.
    return {name: load() for path in checkpoint_files(model_dir) for name, load, _ in read_tensors(path)
            if name.startswith(PREFIX)}


def require_mtp_tensors(model_dir: Path) -> None:
    """ValueError unless the checkpoint holds `mtp.*` tensors (reads names only)."""
    if not any(name.startswith(PREFIX) for path in checkpoint_files(model_dir) for name, _, _ in read_tensors(path)):
        raise ValueError(f'{spell("speculative_config")}: method "mtp" needs the checkpoint\'s multi-token-prediction '
                         f"heads (mtp.* tensors), and {model_dir} has none; use a checkpoint that has them, or "
                         '{"method": "ngram", ...}')


def load_mtp_head(model: nn.Module, model_dir: Path, configured_layers: int | None,
                  quant: CheckpointQuant | None = None) -> Qwen3NextMTP:
    """The head of the checkpoint in `model_dir`, on the target model's device and dtype, its quantized linears
    in `quant`'s formats. A checkpoint without `mtp.*` tensors, or with other ones than the head has, raises
    ValueError."""
    require_mtp_tensors(model_dir)
    tensors = _mtp_tensors(model_dir)
    indices = {int(m.group(1)) for name in tensors if (m := re.match(r"mtp\.layers\.(\d+)\.", name))}
    num_layers = configured_layers or (max(indices) + 1 if indices else 0)
    if num_layers < 1:
        raise ValueError(f"{model_dir}: the checkpoint's mtp.* tensors hold no decoder layer (mtp.layers.0.*)")
    weight = model.input_embeddings().weight
    with torch.device(weight.device):
        head = Qwen3NextMTP(model.config, type(model).decoder_layer, num_layers, DEDICATED_EMBEDDING in tensors)
    head.to(weight.dtype)
    _load_quantized_linears(head, tensors, quant, weight.device)
    params = dict(head.named_parameters())
    unexpected = sorted(name for name in tensors if name[len(PREFIX):] not in params)
    missing = sorted(name for name in params if PREFIX + name not in tensors)
    if unexpected or missing:
        problem = f"unexpected {unexpected[0]}" if unexpected else f"missing mtp.{missing[0]}"
        raise ValueError(f"{model_dir}: the multi-token-prediction head does not match the model ({problem}, "
                         f"{len(unexpected)} unexpected and {len(missing)} missing tensors in all)")
    with torch.no_grad():
        for name, param in params.items():
            tensor = tensors[PREFIX + name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"{model_dir}: {PREFIX + name} has shape {tuple(tensor.shape)} but the model "
                                 f"expects {tuple(param.shape)}")
            param.copy_(tensor)
    sharded = model.input_embeddings().num_embeddings < model.config.vocab_size  # this rank's rows of it
    if sharded or not isinstance(model.lm_head, nn.Linear):  # the first pipeline stage has no LM head
        head.vocabulary = _whole_vocabulary(model, model_dir, weight.dtype, weight.device)
    return head.eval()


def _load_quantized_linears(head: Qwen3NextMTP, tensors: dict[str, torch.Tensor], quant: CheckpointQuant | None,
                            device: torch.device) -> None:
    """Swap each of the head's linears that the checkpoint holds quantized for a QuantLinear, as the model's
    loader does (runtime/quant/loading.py: placeholders, then all converted before any is swapped in), taking
    their tensors out of `tensors`."""
    chosen = {}
    for name, module in head.named_modules():
        prefix = PREFIX + name
        if not isinstance(module, nn.Linear) or not any(f"{prefix}.{marker}" in tensors for marker in MARKERS):
            continue
        fmt = None if quant is None else quant.fp8 or quant.format_for(prefix, module)
        if fmt is None:
            raise QuantTensorError(f"{prefix}: the checkpoint holds it quantized, but config.json's "
                                   f"quantization_config does not quantize it; does config.json match the weights?")
        chosen[name] = fmt
    if not chosen:
        return
    pending = quant_loading.install(head, chosen)
    for name in [n for n in tensors if n.startswith(PREFIX)]:
        if quant_loading.route(pending, name[len(PREFIX):], name, lambda t=tensors[name]: t):
            del tensors[name]
    quant_loading.finish(head, pending, device)


def _whole_vocabulary(model: nn.Module, model_dir: Path, dtype: torch.dtype, device: torch.device) -> WholeVocabulary:
    """The embedding and LM head of the checkpoint, whole (the LM head is the embedding where they are tied)."""
    embedding = next(name for name, param in model.named_parameters() if param is model.input_embeddings().weight)
    lm_head = embedding if getattr(model.config, "tie_word_embeddings", False) else "lm_head.weight"
    wanted = {embedding, lm_head}
    found = {}
    for path in checkpoint_files(model_dir):
        for name, load, _ in read_tensors(path):
            target = model.checkpoint_name(name)
            if target in wanted:
                found[target] = load().to(device=device, dtype=dtype)
    assert wanted <= set(found), f"the model loaded from {model_dir}, yet it lacks {sorted(wanted - set(found))}"
    return WholeVocabulary(found[embedding], found[lm_head])
