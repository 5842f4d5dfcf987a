"""Pipeline parallelism: each stage of ranks holds a contiguous run of decoder layers and passes its
hidden states on to the next (torch.distributed send/recv, over the group tensor parallelism uses).

Global rank r is stage r // tp, tensor-parallel rank r % tp; a stage's ranks all-reduce among
themselves (runtime.distributed.state's tensor group) and each sends its (identical) output to the
rank of the same tensor-parallel index in the next stage. The last stage's first rank sends the
logits to rank 0, which samples. Every rank runs the model's own forward: a layer of another stage
is a pass-through, the embedding of a later stage gives zeros, and hooks on the stage's first and last
layers take in and hand out the hidden states, so no model needs code of its own for its stages.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from runtime.cache.layout import CacheLayout, cdiv
from runtime.cache.pool import attention_views, huge_page_zeros, state_views
from runtime.cache.protocol import KVCacheLayer, StateCacheLayer
from runtime.config import EngineConfig
from runtime.context import forward_context
from runtime.distributed import state
from runtime.distributed.stages import LayerCost, Stage, plan_stages
from runtime.dtypes import DTYPES


# Planning -----------------------------------------------------------------------------------------

def model_class(config: EngineConfig) -> type:
    module_name, _, class_name = config.declaration.implementation.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def decoder_layers(model: nn.Module, num_layers: int) -> tuple[str, nn.ModuleList]:
    """The model's list of decoder layers: the outermost ModuleList with one entry per declared layer."""
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == num_layers]
    if not found:
        raise AssertionError(f"{type(model).__name__} has no list of {num_layers} decoder layers")
    return min(found, key=lambda item: item[0].count("."))


def _bytes(params: Any, seen: set[int]) -> int:
    total = 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def layer_costs(config: EngineConfig, model: nn.Module) -> tuple[list[LayerCost], int, int]:
    """Each decoder layer's cost, and the bytes of the embedding (first stage) and of the rest (last stage)."""
    layout, length = config.cache, config.derived_max_model_len
    _, layers = decoder_layers(model, len(layout.layers))
    seen: set[int] = set()
    head = _bytes(model.input_embeddings().parameters(), seen)
    if getattr(config.dims, "tie_word_embeddings", False):
        seen.discard(id(model.input_embeddings().weight))  # the last stage holds it too, as its LM head
    costs = []
    for kind, layer in zip(layout.layers, layers):
        blocks = cdiv(length, layout.block_size) if kind.has_attention else 0
        costs.append(LayerCost(kind.value, _bytes(layer.parameters(), seen), blocks, int(kind.has_state)))
    tail = _bytes(model.parameters(), seen)
    return costs, head, tail


def meta_model(config: EngineConfig, tp_rank: int = 0) -> nn.Module:
    """The model on the meta device (no memory), cut to tensor-parallel rank `tp_rank`'s shard."""
    from runtime.distributed.sharding import shard_model
    from runtime.loader import default_dtype

    with default_dtype(DTYPES[config.model_dtype]), torch.device("meta"):
        model = model_class(config)(config.dims)
    if config.tensor_parallel_size > 1:
        shard_model(model, tp_rank, config.tensor_parallel_size)
    return model


def stage_plan(config: EngineConfig, model: nn.Module | None = None) -> list[Stage]:
    """The stages of `config.pipeline_parallel_size`, balanced by one rank's weight bytes and pages."""
    costs, head, tail = layer_costs(config, model if model is not None else meta_model(config))
    return plan_stages(costs, config.pipeline_parallel_size, head, tail, config.declaration.architecture)


# This process's place -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Place:
    pp: int
    tp: int
    rank: int  # global

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def previous(self) -> int:
        return self.rank - self.tp

    @property
    def next(self) -> int:
        return self.rank + self.tp

    @property
    def logits_rank(self) -> int:
        """The rank that sends the logits to rank 0: the last stage's first."""
        return (self.pp - 1) * self.tp


_stage_groups: dict[tuple[int, int], list[Any]] = {}
_place: Place | None = None


def enter(config: EngineConfig) -> Place | None:
    """Set this process's tensor group for `config` (every rank calls it, in the same order: creating a
    group is collective); its place in the pipeline, or None without one."""
    global _place
    pp, tp = config.pipeline_parallel_size, config.tensor_parallel_size
    if pp == 1:
        _place = None
        state.set_tensor_group(None)
        return None
    if (pp, tp) not in _stage_groups:
        _stage_groups[(pp, tp)] = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
    _place = Place(pp, tp, dist.get_rank())
    state.set_tensor_group(_stage_groups[(pp, tp)][_place.stage])
    return _place


def forget_groups() -> None:
    """The process group ended: its stage groups with it."""
    global _place
    _stage_groups.clear()
    _place = None
    state.set_tensor_group(None)


def cut_model(model: nn.Module, config: EngineConfig) -> StageModel:
    """Cut `model` (on the meta device, before sharding) to this process's stage."""
    if _place is None or (_place.pp, _place.tp) != (config.pipeline_parallel_size, config.tensor_parallel_size):
        raise AssertionError("a pipeline stage is built inside its group (runtime.distributed.pipeline.enter)")
    stage = stage_plan(config)[_place.stage]
    return StageModel(model, config, _place, stage)


# The stage's model ---------------------------------------------------------------------------------

MAX_SENDS_PENDING = 16  # a stage's hidden states (or logits) sent but not yet taken, at most

class PassLayer(nn.Module):
    """Another stage's decoder layer: the hidden states go through untouched (and unused)."""

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden


class ZeroEmbedding(nn.Module):
    """A later stage's embedding: zeros of the right shape, replaced at its first layer by what it receives."""

    def __init__(self, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.hidden_size, self.dtype = hidden_size, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], self.hidden_size, dtype=self.dtype, device=input_ids.device)


def _parameter_keys(model: nn.Module) -> dict[tuple[int, str], str]:
    """(module, attribute) -> the parameter's name in `model`."""
    keys = {}
    for name, _ in model.named_parameters():
        owner, _, attribute = name.rpartition(".")
        keys[(id(model.get_submodule(owner)), attribute)] = name
    return keys


def _replace(model: nn.Module, target: nn.Module, replacement: nn.Module) -> None:
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child is target:
                setattr(module, child_name, replacement)


class StageModel:
    """What one stage keeps of the model, and the hooks that feed and drain its layers."""

    def __init__(self, model: nn.Module, config: EngineConfig, place: Place, stage: Stage):
        self.place, self.stage = place, stage
        self.full_names = _parameter_keys(model)  # before anything is cut: the checkpoint's names
        self.inbox: torch.Tensor | None = None
        self.outbox: torch.Tensor | None = None
        self.sending: list[tuple[Any, torch.Tensor]] = []  # (work, tensor) of sends not yet taken
        _, layers = decoder_layers(model, len(config.cache.layers))
        dtype = DTYPES[config.model_dtype]
        embedding = model.input_embeddings()
        tied = getattr(config.dims, "tie_word_embeddings", False)
        # Zamba2's shared blocks read the embeddings at every application: a stage computes its own.
        keep_embedding = place.first or (place.last and tied) or getattr(model, "embeds_every_stage", False)
        kept = {id(m) for i in stage.layers for m in layers[i].modules()}
        self.boundary_dtype = torch.float32 if any(getattr(m, "residual_in_fp32", False) for m in model.modules()) \
            else dtype
        for i in range(len(layers)):
            if i not in stage.layers:
                layers[i] = PassLayer()
        if not place.first and not keep_embedding:
            _replace(model, embedding, ZeroEmbedding(embedding.embedding_dim, dtype))
        kept |= {id(m) for m in model.input_embeddings().modules()}
        if not place.last:
            self._drop_head(model, layers, kept)
        if not place.first:
            layers[stage.first].register_forward_pre_hook(self._take_input)
        if not place.last:
            layers[stage.last].register_forward_hook(self._keep_output)
        self.hidden_size = config.dims.hidden_size

    @staticmethod
    def _drop_head(model: nn.Module, layers: nn.ModuleList, kept: set[int]) -> None:
        """The final norm, the LM head and anything else with weights outside the layers and the embedding
        belong to the last stage: here they become identities."""
        inside = {id(m) for m in layers.modules()} | kept
        dropped: list[str] = []
        for name, module in list(model.named_modules()):
            if not name or any(name.startswith(d + ".") for d in dropped):
                continue
            if any(True for _ in module.parameters()) and not any(id(m) in inside for m in module.modules()):
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, nn.Identity())
                dropped.append(name)

    def send_later(self, tensor: torch.Tensor, dst: int) -> None:
        """Send `tensor` to global rank `dst` and go on; it is kept until taken. Every rank runs the steps in the
        order rank 0 sent them, so each send is taken in turn; a sender more than a few steps ahead waits."""
        self.sending = [(w, t) for w, t in self.sending if not w.is_completed()]
        while len(self.sending) >= MAX_SENDS_PENDING:
            self.sending.pop(0)[0].wait()
        self.sending.append((state.isend(tensor, dst), tensor))

    def _take_input(self, module: nn.Module, args: tuple) -> tuple:
        return (self.inbox, *args[1:])

    def _keep_output(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.outbox = output

    def checkpoint_names(self, model: nn.Module) -> dict[str, str]:
        """This stage's parameter names -> the names they had in the whole model (the checkpoint's)."""
        names = {name: self.full_names[key] for key, name in _parameter_keys(model).items()}
        # What the stage loads, by the checkpoint's names, and the bytes: CPU linears are packed afterwards
        # into oneDNN's layout, which is no parameter any more.
        self.holds = {names[n]: p.numel() * p.element_size() for n, p in model.named_parameters()}
        return names

    def elsewhere(self, model: nn.Module) -> set[str]:
        """The whole model's parameters that other stages hold."""
        return set(self.full_names.values()) - set(self.checkpoint_names(model).values())


# The stage's cache ---------------------------------------------------------------------------------

def stage_slabs(layout: CacheLayout, layers: range) -> list[int]:
    """The slabs (layer positions within a group) the stage's layers use: a page id holds only those here."""
    used = {j % layout.group_size for j, i in enumerate(layout.attention_layers) if i in layers}
    used |= {j % layout.group_size for j, i in enumerate(layout.state_layers) if i in layers}
    return sorted(used)


def allocate_stage_pool(model: nn.Module, layout: CacheLayout, layers: range, num_pages: int,
                        device: torch.device) -> torch.Tensor:
    """The stage's pool, (num_pages, its slabs, page bytes), bound to its cache-bearing layers: page ids are
    rank 0's, the same on every stage, but a stage holds only its own layers' pages of each."""
    slabs = stage_slabs(layout, layers)
    shape = (num_pages, len(slabs), layout.page_size_bytes)
    pool = huge_page_zeros(shape) if device.type == "cpu" else torch.zeros(shape, dtype=torch.uint8, device=device)
    attention = {i: j for j, i in enumerate(layout.attention_layers)}
    states = {i: j for j, i in enumerate(layout.state_layers)}
    for module in model.modules():
        if isinstance(module, KVCacheLayer) and module.layer_idx in layers:
            group, slab = divmod(attention[module.layer_idx], layout.group_size)
            module.bind(group, *attention_views(pool, slabs.index(slab), layout.attention))
        elif isinstance(module, StateCacheLayer) and module.layer_idx in layers:
            group, slab = divmod(states[module.layer_idx], layout.group_size)
            module.bind(group, *state_views(pool, slabs.index(slab), layout.mamba))
    return pool


def stage_bytes_per_page_id(layout: CacheLayout, layers: range) -> int:
    return len(stage_slabs(layout, layers)) * layout.page_size_bytes


# A step -------------------------------------------------------------------------------------------

def run_stage(runner: Any, plan: Any) -> torch.Tensor | None:
    """One step on this rank's stage; the logits on rank 0 (received) and on the last stage, else None."""
    logits = start_stage(runner, plan)
    if runner.stage_model.place.rank == 0 and not runner.stage_model.place.last:
        return receive_logits(runner, plan)
    return logits


def start_stage(runner: Any, plan: Any) -> torch.Tensor | None:
    """This rank's part of a step: receive the previous stage's hidden states, run its layers and pass them on
    (or, on the last stage, compute the logits and send them to rank 0) without waiting for the next rank to
    take them, so that a stage can start on the next micro-batch meanwhile. The logits on the last stage."""
    stage, place = runner.stage_model, runner.stage_model.place
    step = runner.inputs(plan, [])
    if not place.first:
        stage.inbox = torch.empty(len(plan.input_ids), stage.hidden_size, dtype=stage.boundary_dtype,
                                  device=runner.device)
        state.recv(stage.inbox, place.previous)
    with forward_context(step.context):
        hidden = runner.model(step.input_ids, step.positions)
    stage.inbox = None
    if not place.last:
        output, stage.outbox = stage.outbox, None
        stage.send_later(output.to(stage.boundary_dtype).contiguous(), place.next)
        return None
    rows = [step.logits_indices] + [torch.arange(row, row + n, device=runner.device) for _, row, n in plan.prompt_rows]
    logits = runner.model.compute_logits(hidden[torch.cat(rows)])
    if place.rank == place.logits_rank:
        stage.send_later(greedy_ids(logits) if plan.greedy_ids else logits.contiguous(), 0)
        if runner.keeps_hidden:  # every row's final hidden state, for rank 0's MTP head (runtime/spec_decode/mtp.py)
            stage.send_later(hidden.to(stage.boundary_dtype).contiguous(), 0)
    return logits


def receive_logits(runner: Any, plan: Any) -> torch.Tensor:
    """Rank 0: the step's logits from the last stage (or the greedy ids it picked, as logits that give them), and
    with an MTP head every row's final hidden state (`runner.last_hidden`)."""
    place = runner.stage_model.place
    num_rows = len(plan.logits_indices) + sum(n for *_, n in plan.prompt_rows)
    vocab_size = runner.model.config.vocab_size
    if plan.greedy_ids:
        ids = torch.empty(num_rows, dtype=torch.long, device=runner.device)
        state.recv(ids, place.logits_rank)
        logits = greedy_logits(ids, vocab_size)
    else:
        logits = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=runner.device)
        state.recv(logits, place.logits_rank)
    if runner.keeps_hidden:
        stage = runner.stage_model
        hidden = torch.empty(len(plan.input_ids), stage.hidden_size, dtype=stage.boundary_dtype, device=runner.device)
        state.recv(hidden, place.logits_rank)
        order = plan.sequence_major_rows()  # each sequence's rows together, as the MTP head reads them
        hidden = hidden if order is None else hidden[torch.tensor(order, device=runner.device)]
        runner.last_hidden = hidden.to(DTYPES[runner.config.model_dtype])
    return logits


# Sampling on the last stage ------------------------------------------------------------------------

def greedy_ids_suffice(plan: Any, seqs: list[Any]) -> bool:
    """Whether the step's tokens are the logits' first maxima, untouched by anything that reads their values
    (runtime.sampler: grammars' bitmasks, logits processors, bans, penalties, temperature, logprobs): then
    the last stage sends 8 bytes a sequence instead of the vocabulary's 4 bytes a token."""
    if plan.prompt_rows or len(plan.logits_indices) != len(seqs):  # prompt logprobs; drafts to verify
        return False
    return all(_plain_greedy(seq) for seq in seqs)


def _plain_greedy(seq: Any) -> bool:
    p = seq.params
    # min_tokens bans the stop tokens (the engine's _banned) until that many were generated.
    return (p.greedy and p.logprobs is None and seq.grammar is None and not p.has_penalties
            and p.allowed_token_ids is None and not p.logit_bias and len(seq.output_token_ids) >= p.min_tokens)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """The sampler's greedy pick (the same float32 max, so the same first maximum); -1 where no token is left."""
    best = logits.to(torch.float32).max(dim=-1)
    return best.indices.masked_fill(~(best.values > float("-inf")), -1).contiguous()


def greedy_logits(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits whose greedy pick is `ids` (all -inf where -1, so the sampler raises its own error): what rank 0's
    sampler reads for a step that `greedy_ids_suffice` allowed, nothing else reading them."""
    logits = torch.zeros(len(ids), vocab_size, dtype=torch.float32, device=ids.device)
    found = ids >= 0
    logits[found, ids[found]] = 1.0
    logits[~found] = float("-inf")
    return logits


def describe(runner: Any) -> dict[str, Any]:
    """What this rank holds: its stage, its layers, its parameters (by the checkpoint's names) and its pool."""
    stage = runner.stage_model
    holds = stage.holds if stage is not None else {n: p.numel() * p.element_size()
                                                   for n, p in runner.model.named_parameters()}
    cached = [m for m in runner.model.modules() if isinstance(m, (KVCacheLayer, StateCacheLayer))]
    return {
        "rank": dist.get_rank() if dist.is_initialized() else 0,
        "stage": stage.place.stage if stage is not None else 0,
        "layers": list(stage.stage.layers) if stage is not None else list(range(len(runner.layout.layers))),
        "parameters": sorted(holds),
        "weight_bytes": sum(holds.values()),
        "pool_shape": tuple(runner.pool.shape),
        "attention_layers": sorted(m.layer_idx for m in cached if isinstance(m, KVCacheLayer)),
        "state_layers": sorted(m.layer_idx for m in cached if isinstance(m, StateCacheLayer)),
    }
