"""Megatron/vLLM sharding of a built model, module by module, for one tensor-parallel rank.

`shard_model` walks the model once. A module whose class (or a base class) has a handler here is
sharded by it, children included, and not descended into; every other module is walked through.
Column-parallel: QKV, gate/up, Mamba in_proj (per segment: z, x, B, C, dt), conv channels, Mamba
heads; row-parallel, with an all-reduce of the module's output: o_proj, down, out_proj; experts
split along their inner dimension (routers replicated); vocabulary-parallel embedding and LM head.
Mamba-2 groups are split when the ranks divide them and replicated when there is one, as vLLM
does. The handlers only narrow parameters and set the per-rank sizes the forward passes read, so
the modules, their names and the checkpoint's names stay as they were.

Every size a handler divides goes through `Sharder.require`, which raises a ValueError naming the
size and the tensor-parallel sizes that would divide it; run on a model built on the meta device,
this is the check that refuses an impossible sharding before any process starts.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from runtime.distributed import state
from runtime.layers.parallel import (
    ParallelFalconGatedRMSNorm,
    ParallelGatedRMSNorm,
    ParallelRMSNorm,
    Part,
    ReducingLinear,
    Shard,
    VocabParallelEmbedding,
    reduce_output,
)
from runtime.models.shapes import divisors


class Sharder:
    def __init__(self, model: nn.Module, rank: int, tp: int):
        self.model, self.rank, self.tp = model, rank, tp
        self.architecture = type(model).__name__
        self.shards: dict[str, Shard] = {}
        self.prefix = ""
        self.names = {id(module): prefix for prefix, module in model.named_modules()}

    def require(self, value: int, what: str) -> None:
        if value % self.tp:
            raise ValueError(
                f"{self.architecture}: {what}={value} is not divisible by tensor_parallel_size={self.tp}; "
                f"tensor-parallel sizes that divide it: {divisors(value)}"
            )

    def split(self, size: int, what: str) -> Part:
        self.require(size, what)
        return Part(size, self.tp)

    def groups(self, n_groups: int, size: int, what: str) -> Part:
        """A part made of `n_groups` groups: split over the ranks, or kept whole on each when there is one."""
        if n_groups == 1:
            return Part(size, 1)
        self.require(n_groups, what)
        return Part(size, self.tp)

    def heads(self, num_heads: int, size: int, what: str) -> Part:
        """KV heads: split, or, when there are fewer than ranks, one head shared by tp / num_heads ranks."""
        if num_heads >= self.tp:
            self.require(num_heads, what)
            return Part(size, self.tp)
        if self.tp % num_heads:
            raise ValueError(
                f"{self.architecture}: {what}={num_heads} cannot be spread over tensor_parallel_size={self.tp}; "
                f"sizes that work: the divisors of {num_heads} ({divisors(num_heads)}) or its multiples"
            )
        return Part(size, num_heads)

    # Parameters ---------------------------------------------------------------------------------

    def param(self, module: nn.Module, name: str, dim: int, parts: list[Part] | None = None,
              rank0_only: bool = False) -> None:
        """Narrow `module.<name>` to this rank's parts along `dim` (rank0_only: whole on rank 0, zeros elsewhere)."""
        if hasattr(module, "cut"):  # a quantized linear still being read (runtime.quant.loading.PendingQuant)
            module.cut(self.names[id(module)], name, dim, tuple(parts or ()), rank0_only, self.rank, self.tp)
            return
        full = getattr(module, name)
        if full is None:
            return
        parts = parts or [Part(full.shape[dim], 1)]
        assert sum(p.size for p in parts) == full.shape[dim], (self.prefix, name, full.shape, parts)
        shard = Shard(tuple(full.shape), dim, tuple(parts), rank0_only)
        local = full if rank0_only else torch.empty(shard.local_shape(self.tp), dtype=full.dtype, device=full.device)
        where = self._name(module, name)
        if isinstance(full, nn.Parameter):
            setattr(module, name, nn.Parameter(local, requires_grad=False))
            self.shards[where] = shard
            if isinstance(module, nn.Linear) and name == "weight":  # PackedLinear reads these
                module.out_features, module.in_features = local.shape
        else:  # a buffer computed at construction (Falcon-H1's muP vector): cut it now
            module.register_buffer(name, shard.take(full, self.rank, self.tp), persistent=False)

    def _name(self, module: nn.Module, name: str) -> str:
        prefix = self.names[id(module)]
        return f"{prefix}.{name}" if prefix else name

    def column(self, linear: nn.Module, parts: list[Part]) -> None:
        self.param(linear, "weight", 0, parts)
        if getattr(linear, "bias", None) is not None:
            self.param(linear, "bias", 0, parts)

    def row(self, linear: nn.Module, size: int, what: str) -> None:
        self.param(linear, "weight", 1, [self.split(size, what)])
        if getattr(linear, "bias", None) is not None:
            self.param(linear, "bias", 0, rank0_only=True)


Handler = Callable[[Sharder, nn.Module], None]
HANDLERS: dict[str, Handler] = {}  # by class name, so that this module imports no model


def handles(*class_names: str) -> Callable[[Handler], Handler]:
    def register(handler: Handler) -> Handler:
        for name in class_names:
            HANDLERS[name] = handler
        return handler

    return register


def handler_of(module: nn.Module) -> Handler | None:
    for cls in type(module).__mro__:
        if cls.__name__ in HANDLERS:
            return HANDLERS[cls.__name__]
    return None


def shard_model(model: nn.Module, rank: int, tp: int) -> dict[str, Shard]:
    """Shard `model` in place for `rank` of `tp`; returns how each narrowed parameter is cut from the checkpoint."""
    sharder = Sharder(model, rank, tp)
    done: list[str] = []
    for prefix, module in list(model.named_modules()):
        if any(prefix.startswith(d + ".") for d in done):
            continue
        handler = handler_of(module)
        if handler is not None:
            sharder.prefix = prefix
            handler(sharder, module)
            done.append(prefix)
    _shard_vocabulary(sharder, model)
    return sharder.shards


def check_sharding(model: nn.Module, tp: int) -> dict[str, Shard]:
    """Raise the ValueError `shard_model` would, on a model built on the meta device (no weights, no memory)."""
    return shard_model(model, 0, tp)


# Vocabulary --------------------------------------------------------------------------------------

def _shard_vocabulary(s: Sharder, model: nn.Module) -> None:
    # A pipeline stage may hold neither the embedding nor the LM head (runtime.distributed.pipeline).
    embedding, vocab = model.input_embeddings(), model.config.vocab_size
    part = s.split(vocab, "vocab_size")
    if isinstance(embedding, nn.Embedding):
        s.param(embedding, "weight", 0, [part])
        embedding.__class__ = VocabParallelEmbedding
        embedding.num_embeddings = vocab // s.tp
        embedding.vocab_start = s.rank * (vocab // s.tp)
    if not isinstance(model.lm_head, nn.Linear):
        return
    if getattr(model.config, "tie_word_embeddings", False):
        model.lm_head.out_features = vocab // s.tp  # tie_weights gives it the embedding's rows
    else:
        s.param(model.lm_head, "weight", 0, [part])
    # The LM head's rows are this rank's vocabulary: gather the logits (every compute_logits scales
    # elementwise, so gathering its result is the same as gathering the head's).
    local_logits = model.compute_logits

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        logits = local_logits(hidden)
        if logits.shape[0] == 0:
            return logits.new_empty(0, vocab)
        return state.all_gather_last(logits)

    model.compute_logits = compute_logits


# Attention ---------------------------------------------------------------------------------------

def _paged_attention(s: Sharder, attn: nn.Module) -> None:
    attn.num_heads //= s.tp
    attn.num_kv_heads = max(1, attn.num_kv_heads // s.tp)


@handles("PagedAttention")
def paged_attention(s: Sharder, attn: nn.Module) -> None:
    """An application's KV cache held apart from the projections (Zamba2's hybrid layers)."""
    _paged_attention(s, attn)


@handles("SelfAttention", "Lfm2Attention", "NemotronAttention", "Zamba2Attention")
def attention(s: Sharder, module: nn.Module) -> None:
    heads, kv_heads, head_dim = module.num_heads, module.num_kv_heads, module.head_dim
    s.require(heads, "num_attention_heads")
    q = Part(heads * head_dim, s.tp)
    kv = s.heads(kv_heads, kv_heads * head_dim, "num_key_value_heads")
    s.column(module.q_proj, [q])
    s.column(module.k_proj, [kv])
    s.column(module.v_proj, [kv])
    out = module.o_proj if hasattr(module, "o_proj") else module.out_proj
    s.row(out, heads * head_dim, "num_attention_heads x head_dim")
    for name, part in (("linear_q_adapter_list", q), ("linear_k_adapter_list", kv), ("linear_v_adapter_list", kv)):
        for adapter in getattr(module, name, ()):
            if isinstance(adapter, nn.Sequential):  # low rank: the down projection is replicated
                s.column(adapter[1], [part])
    module.num_heads, module.num_kv_heads = heads // s.tp, max(1, kv_heads // s.tp)
    if hasattr(module, "attn"):
        _paged_attention(s, module.attn)
    module.register_forward_hook(reduce_output)


# Feed-forward ------------------------------------------------------------------------------------

def _mlp(s: Sharder, module: nn.Module, column: tuple[str, ...], row: str, packed: tuple[str, ...] = ()) -> None:
    """Column-parallel `column` projections (`packed`: gate and up stacked in one), row-parallel `row`."""
    size = getattr(module, row).in_features
    part = s.split(size, "intermediate_size")
    for name in column:
        s.column(getattr(module, name), [part])
    for name in packed:
        s.column(getattr(module, name), [part, part])
        for adapter in getattr(module, f"{name}_adapter_list", ()):
            if isinstance(adapter, nn.Sequential):
                s.column(adapter[1], [part, part])
    s.row(getattr(module, row), size, "intermediate_size")


MLPS = {
    "GatedMLP": (("gate_proj", "up_proj"), "down_proj", ()),
    "FalconH1MLP": (("gate_proj", "up_proj"), "down_proj", ()),
    "UpDownMLP": (("up_proj",), "down_proj", ()),
    "Lfm2MLP": (("w1", "w3"), "w2", ()),
    "SharedMLP": ((), "output_linear", ("input_linear",)),
    "Zamba2MLP": ((), "down_proj", ("gate_up_proj",)),
}


def _inner_mlp(s: Sharder, module: nn.Module) -> None:
    """An MLP whose partial output is summed later (an expert: its MoE block reduces once)."""
    column, row, packed = MLPS[type(module).__name__]
    _mlp(s, module, column, row, packed)


@handles(*MLPS)
def mlp(s: Sharder, module: nn.Module) -> None:
    _inner_mlp(s, module)
    module.register_forward_hook(reduce_output)


@handles("PerExpertMoE", "Lfm2MoeBlock")
def per_expert_moe(s: Sharder, module: nn.Module) -> None:
    for expert in module.experts:
        _inner_mlp(s, expert)
    module.register_forward_hook(reduce_output)


@handles("PackedMoE")
def packed_moe(s: Sharder, module: nn.Module) -> None:
    size = module.output_linear.weight.shape[2]
    part = s.split(size, "intermediate_size")
    s.param(module.input_linear, "weight", 1, [part, part])
    s.param(module.output_linear, "weight", 2, [part])
    module.register_forward_hook(reduce_output)


@handles("NemotronMoE")
def nemotron_moe(s: Sharder, module: nn.Module) -> None:
    for expert in module.experts:
        _inner_mlp(s, expert)
    _inner_mlp(s, module.shared_experts)
    latent = module.fc2_latent_proj  # an nn.Linear, or a quantized one still being read (PendingQuant)
    if isinstance(latent, nn.Linear):
        # It projects the experts' partial sums: row-parallel, each rank keeping every input column, its bias on
        # rank 0 alone; recorded as such so that a LoRA slot's bias is cut the same way (runtime/lora/layer.py).
        s.param(latent, "weight", 1)
        s.param(latent, "bias", 0, rank0_only=True)
    elif getattr(latent, "has_bias", False):
        s.param(latent, "bias", 0, rank0_only=True)
    module.register_forward_hook(reduce_output)


# State-space mixers ------------------------------------------------------------------------------

@handles("Mamba2Mixer")
def mamba2(s: Sharder, m: nn.Module) -> None:
    tp, groups_state = s.tp, m.n_groups * m.d_state
    inner = s.split(m.d_inner, "mamba d_inner")
    heads = s.split(m.num_heads, "mamba heads")
    group = s.groups(m.n_groups, groups_state, "mamba n_groups")
    s.column(m.in_proj, [inner, inner, group, group, heads])
    if m.in_proj_multipliers is not None:
        s.param(m, "in_proj_multipliers", 0, [inner, inner, group, group, heads])
    s.column(m.conv1d, [inner, group, group])
    for name in ("dt_bias", "A_log", "D"):
        s.param(m, name, 0, [heads])
    _mamba2_norm(s, m.norm, m.d_inner, m.n_groups)
    s.row(m.out_proj, m.d_inner, "mamba d_inner")
    m.d_inner, m.num_heads = m.d_inner // tp, m.num_heads // tp
    m.n_groups = m.n_groups // tp if m.n_groups % tp == 0 else 1
    m.conv_dim = m.d_inner + 2 * m.n_groups * m.d_state
    m.register_forward_hook(reduce_output)


def _mamba2_norm(s: Sharder, norm: nn.Module, d_inner: int, n_groups: int) -> None:
    """The gated norm's weight follows the channels; one group spanning the ranks all-reduces its RMS."""
    if getattr(norm, "weight", None) is None:
        return  # Falcon-H1's plain silu gate
    s.param(norm, "weight", 0, [Part(d_inner, s.tp)])
    if n_groups % s.tp == 0:
        if hasattr(norm, "n_groups"):
            norm.n_groups //= s.tp
        return
    norm.full_size = d_inner
    norm.__class__ = ParallelFalconGatedRMSNorm if hasattr(norm, "norm_before_gate") else ParallelGatedRMSNorm


@handles("Mamba1Mixer")
def mamba1(s: Sharder, m: nn.Module) -> None:
    inner = s.split(m.d_inner, "mamba d_inner")
    s.column(m.in_proj, [inner, inner])
    s.column(m.conv1d, [inner])
    s.param(m.x_proj, "weight", 1, [inner])
    m.x_proj.__class__ = ReducingLinear  # dt, B and C are needed whole on every rank
    s.column(m.dt_proj, [inner])
    s.param(m, "A_log", 0, [inner])
    s.param(m, "D", 0, [inner])
    s.row(m.out_proj, m.d_inner, "mamba d_inner")
    m.d_inner //= s.tp
    m.register_forward_hook(reduce_output)


@handles("ShortConv")
def short_conv(s: Sharder, m: nn.Module) -> None:
    channels = s.split(m.hidden_size, "hidden_size")
    s.column(m.in_proj, [channels, channels, channels])
    s.column(m.conv, [channels])
    s.row(m.out_proj, m.hidden_size, "hidden_size")
    m.hidden_size //= s.tp
    m.register_forward_hook(reduce_output)


# Gated DeltaNet families (Qwen3-Next, Qwen3.5, OLMo-Hybrid) ---------------------------------------

@handles("GatedAttention")
def gated_attention(s: Sharder, module: nn.Module) -> None:
    """Qwen3-Next's gated attention: each head's query and gate are adjacent in q_proj, so its rows split by heads."""
    heads, kv_heads, head_dim = module.num_heads, module.num_kv_heads, module.head_dim
    s.require(heads, "num_attention_heads")
    kv = s.heads(kv_heads, kv_heads * head_dim, "num_key_value_heads")
    s.column(module.q_proj, [Part(2 * heads * head_dim, s.tp)])
    s.column(module.k_proj, [kv])
    s.column(module.v_proj, [kv])
    s.row(module.o_proj, heads * head_dim, "num_attention_heads x head_dim")
    module.num_heads, module.num_kv_heads = heads // s.tp, max(1, kv_heads // s.tp)
    _paged_attention(s, module.attn)
    module.register_forward_hook(reduce_output)


@handles("OlmoHybridAttention")
def olmo_hybrid_attention(s: Sharder, module: nn.Module) -> None:
    """Plain attention whose q and k norms span the whole projection: their RMS is all-reduced."""
    heads, kv_heads, head_dim = module.num_heads, module.num_kv_heads, module.head_dim
    attention(s, module)
    q = Part(heads * head_dim, s.tp)
    kv = s.heads(kv_heads, kv_heads * head_dim, "num_key_value_heads")
    for norm, part in ((module.q_norm, q), (module.k_norm, kv)):
        s.param(norm, "weight", 0, [part])
        norm.full_size = norm.weight.shape[0] * s.tp
        norm.__class__ = ParallelRMSNorm


@handles("Qwen3NextSparseMoeBlock")
def qwen3_next_moe(s: Sharder, module: nn.Module) -> None:
    """Experts and the shared expert split along their inner dimension; the router and the shared expert's
    gate (a scalar per token, which scales the partial sums alike) replicated; one all-reduce for the block."""
    for expert in module.experts:
        _inner_mlp(s, expert)
    _inner_mlp(s, module.shared_expert)
    module.register_forward_hook(reduce_output)


@handles("GatedDeltaNet")
def gated_deltanet(s: Sharder, m: nn.Module) -> None:
    """Key and value heads split per rank (a rank's value heads are those of its key heads, as the delta rule
    pairs them); the conv channels, A_log and dt_bias follow; the per-head gated norm is replicated; the
    output projection is row-parallel."""
    s.require(m.num_k_heads, "linear_num_key_heads")
    s.require(m.num_v_heads, "linear_num_value_heads")
    key, value, heads = Part(m.key_dim, s.tp), Part(m.value_dim, s.tp), Part(m.num_v_heads, s.tp)
    if hasattr(m, "in_proj_qkvz"):
        # Qwen3-Next: [q, k, v..., z...] and [b..., a...] per key head, so a contiguous split by key heads.
        s.column(m.in_proj_qkvz, [Part(2 * m.key_dim + 2 * m.value_dim, s.tp)])
        s.column(m.in_proj_ba, [Part(2 * m.num_v_heads, s.tp)])
    elif hasattr(m, "in_proj_qkv"):  # Qwen3.5
        s.column(m.in_proj_qkv, [key, key, value])
        s.column(m.in_proj_z, [value])
        s.column(m.in_proj_b, [heads])
        s.column(m.in_proj_a, [heads])
    else:  # OLMo-Hybrid
        for name, part in (("q_proj", key), ("k_proj", key), ("v_proj", value), ("g_proj", value),
                           ("a_proj", heads), ("b_proj", heads)):
            s.column(getattr(m, name), [part])
    if hasattr(m, "conv1d"):
        s.column(m.conv1d, [key, key, value])
        out = m.out_proj
    else:
        for name, part in (("q_conv1d", key), ("k_conv1d", key), ("v_conv1d", value)):
            s.column(getattr(m, name), [part])
        out = m.o_proj
    s.param(m, "dt_bias", 0, [heads])
    s.param(m, "A_log", 0, [heads])
    s.row(out, m.value_dim, "linear_num_value_heads x linear_value_head_dim")
    m.num_k_heads, m.num_v_heads = m.num_k_heads // s.tp, m.num_v_heads // s.tp
    m.key_dim, m.value_dim = m.key_dim // s.tp, m.value_dim // s.tp
    m.conv_dim = 2 * m.key_dim + m.value_dim
    m.register_forward_hook(reduce_output)
