"""The model runner: a scheduled batch becomes packed inputs, one ForwardContext, a forward pass and logits."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from runtime import kernels
from runtime.cache.layout import CacheLayout
from runtime.cache.pool import allocate_pool, bind_pool, default_cache_bytes
from runtime.config import EngineConfig
from runtime.context import ForwardContext, GeneratedSplit, forward_context
from runtime.decode_graph import DecodeGraphs
from runtime.distributed.pipeline import allocate_stage_pool, run_stage, stage_bytes_per_page_id
from runtime.dtypes import DTYPES
from runtime.heap import keep_freed_memory, release_freed_memory
from runtime.kernels import cpu_native
from runtime.kernels.metadata import build_attention_metadata, build_mamba_prefill_metadata
from runtime.kernels.quant_linear import SCHEMES
from runtime.layers.linear import pack_linears
from runtime.layers.quantized import quantize_linears, weight_bytes
from runtime.loader import build_model
from runtime.lora.manager import LoRAManager
from runtime.options import plural, spell
from runtime.scheduler import Batch
from runtime.sequence import Sequence
from runtime.waves import decode_waves, row_sequences, wave_rows

logger = logging.getLogger("tandem")

MAMBA1_CHUNK = 256
# Compiling the CPU kernels takes seconds; it pays back only when each state update moves this much.
COMPILE_MIN_STATE_BYTES = 256 * 1024


def checkpoint_pages(config: EngineConfig) -> int:
    """Page ids a sequence's verify step borrows to keep its states after each draft: one per state group per
    draft (runtime/waves.py)."""
    if config.speculative is None:
        return 0
    return config.cache.num_state_groups * config.speculative.num_speculative_tokens


def compile_pays(layout: CacheLayout) -> bool:
    return layout.mamba is not None and layout.mamba.unpadded_page_size_bytes >= COMPILE_MIN_STATE_BYTES


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # Checked before anything global (the kernel binding) changes, so a failed engine leaves others intact.
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: no CUDA device is available here; use {spell('device', 'cpu')} "
                         "(or auto)")
    return torch.device(name)


def make_lora_manager(model: torch.nn.Module, config: EngineConfig) -> LoRAManager | None:
    if not config.enable_lora:
        return None
    return LoRAManager(model, config.max_loras, config.max_lora_rank, config.max_cpu_loras or config.max_loras,
                       DTYPES[config.model_dtype])


@dataclass
class PromptLogits:
    """Logits at a prompt chunk's positions start, start + 1, ...: each predicts the prompt token after it."""

    seq: Sequence
    start: int
    logits: torch.Tensor


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    context: ForwardContext
    logits_indices: torch.Tensor
    sample_seqs: list[Sequence]  # sequences whose next token this step produces, in logits order


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.layout: CacheLayout = config.cache
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()
        if config.derived_threads is not None:  # process-wide, as torch's thread pool is
            torch.set_num_threads(config.derived_threads)
        # Once per engine, before any kernel runs: no kernel call checks its device.
        backend = kernels.resolve_backend(config.kernel_backend, self.device)
        self.kernel_backend = kernels.bind(backend, self.device, compile_cpu=compile_pays(self.layout))
        logger.info("kernel backend: %s on %s", self.kernel_backend, self.device)
        self.model = build_model(config, self.device)
        # A pipeline stage's layers, and the hooks that pass hidden states between stages; None on one stage.
        self.stage_model = getattr(self.model, "stage_model", None)
        if config.quantization in SCHEMES:  # before packing: the quantized linears are packed no more
            count = quantize_linears(self.model, config.quantization)
            logger.info("quantized %d linears to %s: weights %.1f MiB", count, config.quantization,
                        weight_bytes(self.model) / 2**20)
        if self.device.type == "cpu":
            release_freed_memory()  # the float weights that quantizing replaced, before packing adds its copies
        if self.device.type == "cpu" and self.kernel_backend == "torch":
            # An MTP head loads the embedding's own weight by name (runtime/models/qwen3_next/mtp.py): kept.
            mtp = config.speculative is not None and config.speculative.method == "mtp"
            pack_linears(self.model, embedding_from_head=not mtp)
        if self.device.type == "cpu":
            release_freed_memory()  # and those that packing replaced
        self.lora = make_lora_manager(self.model, config)  # after packing: the slots wrap the packed linears
        self.num_pages = self._num_pages()
        self._check_checkpoint_room()
        self.pool = self._allocate_pool(self.num_pages)
        # Mamba-1 has no chunked scan; its prefill metadata still wants a chunk length.
        self.chunk_size = config.declaration.mamba_chunk_size(config.hf_config) or MAMBA1_CHUNK
        # The MTP head reads every row's final hidden state, which a captured decode step does not keep.
        self.keeps_hidden = config.speculative is not None and config.speculative.method == "mtp"
        self.last_hidden: torch.Tensor | None = None
        self.graphs = DecodeGraphs(self) if self._captures_decodes() and not self.keeps_hidden else None
        logger.info("page pool: %d pages of %d B x %d layers (%.1f MiB)", self.num_pages,
                    self.layout.page_size_bytes, self.layout.group_size, self.pool.numel() / 2**20)

    def _captures_decodes(self) -> bool:
        """Decode steps are captured where every kernel is a native one (a CPU with the library built) and
        the model lives in this process alone."""
        cpu_native_kernels = self.device.type == "cpu" and self.kernel_backend == "torch" and cpu_native.available()
        return cpu_native_kernels and not self.config.enforce_eager and self.config.world_size == 1

    def _num_pages(self) -> int:
        if self.config.num_pages is not None:
            return self.config.num_pages
        budget = self.config.kv_cache_memory or default_cache_bytes(self.device)
        # No point holding more pages than every sequence at full length could use, or, with prefix
        # caching, as many again for cached blocks and snapshots.
        useful = self.config.max_num_seqs * self.layout.pages_per_sequence(self.config.derived_max_model_len)
        if self.config.enable_prefix_caching:
            useful *= 2
        useful += self.config.max_num_seqs * checkpoint_pages(self.config)
        per_page = self.layout.bytes_per_page_id
        if self.stage_model is not None:  # a stage holds its own layers' part of each page id
            per_page = stage_bytes_per_page_id(self.layout, self.stage_model.stage.layers)
        by_memory = budget // per_page if per_page else useful
        return max(1, min(by_memory, useful))

    def _check_checkpoint_room(self) -> None:
        """Refuse, at start-up, a pool that cannot hold a sequence and the state its verify keeps after one draft
        (a verify drafts as many tokens as the free pages keep states for: Speculator.checkpoint)."""
        groups, needed = self.layout.num_state_groups, self.layout.pages_per_sequence(1)
        if self.config.speculative is None or not groups or self.num_pages >= needed + groups:
            return
        k = self.config.speculative.num_speculative_tokens
        raise ValueError(
            f"the page pool ({plural(self.num_pages, 'page')}) cannot hold a sequence ({plural(needed, 'page')} "
            f"at least) and the state speculative decoding keeps after a draft while it verifies "
            f"({plural(groups, 'page')}, one per state group; {k} drafts keep {k * groups}): raise "
            f"{spell('kv_cache_memory')} or {spell('num_pages')}")

    def _allocate_pool(self, num_pages: int) -> torch.Tensor:
        if self.stage_model is not None:
            return allocate_stage_pool(self.model, self.layout, self.stage_model.stage.layers, num_pages, self.device)
        pool = allocate_pool(self.layout, num_pages, self.device)
        bind_pool(self.model, pool, self.layout)
        return pool

    def resize_pool(self, num_pages: int) -> None:
        """A pool of `num_pages` page ids instead (the fewest any rank of a group can hold)."""
        self.num_pages = num_pages
        self.pool = self._allocate_pool(num_pages)

    def execute(self, batch: Batch) -> tuple[list[Sequence], torch.Tensor]:
        """Run one step; return the sequences that get a new token and their logits (float32)."""
        seqs, logits, _ = self.run(batch)
        return seqs, logits

    def run(self, batch: Batch) -> tuple[list[Sequence], torch.Tensor, list[PromptLogits]]:
        """`execute`, and the logits of the prompt positions whose requests want prompt logprobs."""
        plan, sample_seqs, prompt_seqs = plan_step(batch, self.layout.num_attention_groups,
                                                   self.layout.num_state_groups)
        return split_logits(self.execute_plan(plan), plan, sample_seqs, prompt_seqs)

    def shutdown(self) -> None:
        """Nothing to release on one device (a tensor-parallel runner frees the other ranks' shards)."""

    @torch.inference_mode()
    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole page ids (every slab of the group), in order: a later copy may read an earlier one's target."""
        for source, destination in copies:
            self.pool[destination].copy_(self.pool[source])

    def prepare(self, batch: Batch) -> StepInputs:
        plan, sample_seqs, _ = plan_step(batch, self.layout.num_attention_groups, self.layout.num_state_groups)
        return self.inputs(plan, sample_seqs)

    def inputs(self, plan: StepPlan, sample_seqs: list[Sequence]) -> StepInputs:
        """The step's tensors, from its plan (every tensor-parallel rank builds them from the same plan)."""
        as_long = dict(dtype=torch.long, device=self.device)
        return StepInputs(torch.tensor(plan.input_ids, **as_long), torch.tensor(plan.positions, **as_long),
                          self._context(plan), torch.tensor(plan.logits_indices, **as_long), sample_seqs)

    @torch.inference_mode()
    def execute_plan(self, plan: StepPlan) -> torch.Tensor:
        """Logits of the sampled rows, then of each prompt chunk in `plan.prompt_rows` (a pipeline stage's
        rank: None where it neither samples nor computes them)."""
        if self.stage_model is not None:
            return run_stage(self, plan)
        if self.graphs is not None:
            logits = self.graphs.run(plan)
            if logits is not None:
                return logits
        step = self.inputs(plan, [])
        with forward_context(step.context):
            hidden = self.model(step.input_ids, step.positions)
        if self.keeps_hidden:  # every row's final hidden state, for the MTP head (runtime/spec_decode/mtp.py)
            self.last_hidden = in_sequence_order(hidden, plan)
        rows = [step.logits_indices] + [torch.arange(row, row + n, device=self.device)
                                        for _, row, n in plan.prompt_rows]
        return self.model.compute_logits(hidden[torch.cat(rows)])

    def _context(self, plan: StepPlan) -> ForwardContext:
        layout, device = self.layout, self.device
        counts, starts, num_decodes = plan.counts, plan.starts, plan.num_decodes
        decode_counts = counts[:num_decodes]
        decode_rows = sum(decode_counts)
        # Attention sees each decode row (a verify's positions included) as a sequence of its own.
        row_seqs = plan.row_sequences()
        attention_seqs = row_seqs[:decode_rows] + list(range(num_decodes, len(counts)))
        attention, block_tables, slot_mappings = None, (), ()
        if layout.block_size:
            query_lens = [1] * decode_rows + counts[num_decodes:]
            seq_lens = ([p + 1 for p in plan.positions[:decode_rows]]
                        + [start + n for start, n in zip(starts[num_decodes:], counts[num_decodes:])])
            attention = build_attention_metadata(query_lens, seq_lens, device)
            block_tables = tuple(self._block_table([tables[s] for s in attention_seqs]) for tables in plan.block_tables)
            slot_mappings = tuple(self._slot_mapping([tables[s] for s in row_seqs], plan.positions)
                                  for tables in plan.block_tables)
        mamba_prefill, decode_idx, prefill_idx = None, (), ()
        if layout.mamba is not None:
            if num_decodes < len(counts):
                mamba_prefill = build_mamba_prefill_metadata(counts[num_decodes:], starts[num_decodes:],
                                                             self.chunk_size, device)
            pages = [torch.tensor(group, dtype=torch.long, device=device) for group in plan.state_pages]
            decode_idx = tuple(p[:num_decodes] for p in pages)
            prefill_idx = tuple(p[num_decodes:] for p in pages)
        split = self._generated_split(plan) if mamba_prefill is not None and plan.num_generated else None
        lora_indices = None
        if self.lora is not None and plan.loras:
            lora_indices = self.lora.indices([plan.loras[s] for s in row_seqs], [1] * len(row_seqs), device)
        waves = tuple(decode_waves(decode_counts)) if decode_rows > num_decodes else ()
        chains = tuple(torch.tensor(group, dtype=torch.long, device=device) for group in plan.wave_state_pages)
        return ForwardContext(decode_rows, len(plan.input_ids) - decode_rows, attention, block_tables,
                              slot_mappings, mamba_prefill, decode_idx, prefill_idx, generated_split=split,
                              lora_indices=lora_indices, decode_waves=waves, wave_state_pages=chains)

    def _generated_split(self, plan: StepPlan) -> GeneratedSplit:
        counts, starts, first = plan.counts, plan.starts, len(plan.counts) - plan.num_generated
        prompt = None
        if first > plan.num_decodes:
            prompt = build_mamba_prefill_metadata(counts[plan.num_decodes:first], starts[plan.num_decodes:first],
                                                  self.chunk_size, self.device)
        generated = build_mamba_prefill_metadata(counts[first:], starts[first:], self.chunk_size, self.device)
        return GeneratedSplit(first - plan.num_decodes, sum(counts[plan.num_decodes:first]), prompt, generated)

    def _block_table(self, tables: list[list[int]]) -> torch.Tensor:
        width = max(len(table) for table in tables)
        rows = [table + [0] * (width - len(table)) for table in tables]
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    def _slot_mapping(self, tables: list[list[int]], positions: list[int]) -> torch.Tensor:
        """Each row's slot: `tables` holds the block table of each row's sequence."""
        size = self.layout.block_size
        slots = [table[p // size] * size + p % size for table, p in zip(tables, positions)]
        return torch.tensor(slots, dtype=torch.long, device=self.device)


@dataclass
class StepPlan:
    """One step as plain Python: all a rank needs to run it (picklable, so rank 0 can send it to the others)."""

    input_ids: list[int]
    positions: list[int]
    logits_indices: list[int]
    counts: list[int]  # new tokens per sequence: decodes first (verifies among them, the longest first)
    starts: list[int]  # tokens already computed per sequence
    num_decodes: int  # the decode section's sequences; their rows, in waves (runtime/waves.py), come first
    block_tables: list[list[list[int]]]  # per attention group, per sequence: page ids
    state_pages: list[list[int]]  # per state group, per sequence: the state page id
    # (first position, first row in input_ids, count) of the prompt positions whose logits
    # SamplingParams.prompt_logprobs asks for.
    prompt_rows: list[tuple[int, int, int]]
    num_generated: int = 0  # the last prefill sequences, whose chunks hold generated tokens only
    loras: list = field(default_factory=list)  # per sequence: its LoRARequest or None (empty: no adapter at all)
    # In a verify step, per state group: the page each decode sequence's state lies in before the first wave
    # and after each (runtime/waves.py), (waves + 1, decode sequences); empty without drafts.
    wave_state_pages: list[list[list[int]]] = field(default_factory=list)
    # Pipeline parallelism: the last stage picks the greedy tokens and sends their ids, not the logits
    # (set by rank 0 only where that is exact: runtime.distributed.pipeline.greedy_ids_suffice).
    greedy_ids: bool = False

    def row_sequences(self) -> list[int]:
        """The sequence (index into counts) of every row: the decode section's in waves, then each chunk's."""
        prefill = [s for s, n in enumerate(self.counts[self.num_decodes:], self.num_decodes) for _ in range(n)]
        return row_sequences(self.counts[:self.num_decodes]) + prefill

    def sequence_major_rows(self) -> list[int] | None:
        """The rows in sequence order (each sequence's positions in order), or None where that is row order."""
        decode_counts = self.counts[:self.num_decodes]
        if sum(decode_counts) == self.num_decodes:
            return None
        decode = [r for rows in wave_rows(decode_counts) for r in rows]
        return decode + list(range(len(decode), len(self.input_ids)))


def plan_order(batch: Batch) -> list[int]:
    """The indices of `batch.seqs` in the order a step's plan packs their rows (before the step changes them):
    decodes first, the longest verify first (runtime/waves.py), then prompt chunks, then generated ones."""
    def key(i: int) -> tuple[int, int]:
        seq, n = batch.seqs[i], batch.num_new_tokens[i]
        kind = _kind(seq, n)
        return kind, -n if kind == DECODE else 0

    return sorted(range(len(batch.seqs)), key=key)


def plan_step(batch: Batch, num_attention_groups: int,
              num_state_groups: int) -> tuple[StepPlan, list[Sequence], list[Sequence]]:
    """The step's plan, the sequences whose next token it produces (in logits order), and the sequence
    of each of the plan's prompt rows."""
    order = plan_order(batch)
    seqs = [batch.seqs[i] for i in order]
    counts = [batch.num_new_tokens[i] for i in order]
    starts = [seq.num_computed_tokens for seq in seqs]
    num_decodes = sum(_is_decode(seq, n) for seq, n in zip(seqs, counts))
    num_generated = sum(_kind(seq, n) == GENERATED for seq, n in zip(seqs, counts))
    input_ids, positions, logits_indices, sample_seqs, prompt_rows, prompt_seqs = [], [], [], [], [], []
    # The decode section, wave by wave; each sequence's rows (its last token, then its drafts) sampled in order.
    for i, n in enumerate(decode_waves(counts[:num_decodes])):
        input_ids.extend(_token_at(seq, start + i) for seq, start in zip(seqs[:n], starts[:n]))
        positions.extend(start + i for start in starts[:n])
    for seq, start, rows in zip(seqs, starts, wave_rows(counts[:num_decodes])):
        if start + len(rows) >= seq.num_tokens:  # not a generated token recomputed after preemption
            logits_indices.extend(rows)
            sample_seqs.append(seq)
    for seq, start, n in zip(seqs[num_decodes:], starts[num_decodes:], counts[num_decodes:]):
        # Positions before the prompt's last one each predict a prompt token.
        num_prompt = min(start + n, len(seq.prompt_token_ids) - 1) - start
        if seq.params.prompt_logprobs is not None and num_prompt > 0:
            prompt_rows.append((start, len(input_ids), num_prompt))
            prompt_seqs.append(seq)
        input_ids.extend(_token_at(seq, p) for p in range(start, start + n))
        positions.extend(range(start, start + n))
        if start + n >= seq.num_tokens:
            logits_indices.append(len(input_ids) - 1)
            sample_seqs.append(seq)
    block_tables = [[list(seq.block_tables[g]) for seq in seqs] for g in range(num_attention_groups)]
    state_pages = [[seq.state_pages[g] for seq in seqs] for g in range(num_state_groups)]
    loras = [seq.lora_request for seq in seqs] if any(seq.lora_request for seq in seqs) else []
    plan = StepPlan(input_ids, positions, logits_indices, counts, starts, num_decodes, block_tables, state_pages,
                    prompt_rows, num_generated, loras, wave_state_pages=_wave_state_pages(
                        seqs[:num_decodes], counts[:num_decodes], num_state_groups))
    return plan, sample_seqs, prompt_seqs


def _token_at(seq: Sequence, position: int) -> int:
    """The sequence's token at `position`; past its tokens, the draft there (a verify step's)."""
    tokens = seq.num_tokens
    return seq.token_ids[position] if position < tokens else seq.spec_token_ids[position - tokens]


def _wave_state_pages(seqs: list[Sequence], counts: list[int], num_state_groups: int) -> list[list[list[int]]]:
    """Per state group, the page each decode sequence's state is read from in wave 0 and written to by each
    wave: its own page, except after a wave it goes on past, where the state stays in a page of its own
    (Speculator.checkpoint borrowed them: one per state group per draft, wave-major) for the verify to resume
    from the last accepted draft's. Empty when no sequence verifies drafts."""
    if not num_state_groups or all(n == 1 for n in counts):
        return []
    return [[[seq.state_pages[g] for seq in seqs]]
            + [[seq.checkpoint_pages[i * num_state_groups + g] if n > i + 1 else seq.state_pages[g]
                for seq, n in zip(seqs, counts)] for i in range(counts[0])]
            for g in range(num_state_groups)]


def in_sequence_order(hidden: torch.Tensor, plan: StepPlan) -> torch.Tensor:
    """A step's rows with each sequence's positions together, in order (the decode section is in waves)."""
    order = plan.sequence_major_rows()
    return hidden if order is None else hidden[torch.tensor(order, device=hidden.device)]


def split_logits(logits: torch.Tensor, plan: StepPlan, sample_seqs: list[Sequence],
                 prompt_seqs: list[Sequence]) -> tuple[list[Sequence], torch.Tensor, list[PromptLogits]]:
    """`execute_plan`'s logits as the sampled sequences' rows and each prompt chunk's."""
    num_sampled = len(plan.logits_indices)  # one row per sequence, and one per draft
    chunks = logits[num_sampled:].split([n for *_, n in plan.prompt_rows])
    prompt_logits = [PromptLogits(seq, start, chunk)
                     for seq, (start, _, _), chunk in zip(prompt_seqs, plan.prompt_rows, chunks)]
    return sample_seqs, logits[:num_sampled], prompt_logits


DECODE, PROMPT, GENERATED = range(3)


def _kind(seq: Sequence, num_new_tokens: int) -> int:
    """Decodes first, then prompt chunks, then chunks of generated tokens only (speculative verifies)."""
    if _is_decode(seq, num_new_tokens):
        return DECODE
    # Only in an engine that speculates are generated tokens computed again as decoding computed them (its
    # verifies decode); a plain recompute after preemption is a prefill, as transformers' forward over the
    # whole sequence is.
    return GENERATED if seq.speculates and seq.num_computed_tokens >= len(seq.prompt_token_ids) else PROMPT


def _is_decode(seq: Sequence, num_new_tokens: int) -> bool:
    # A one-token step of a generated token is a state update, and so is each position of a verify (the last
    # token and its drafts: runtime/waves.py). A prompt token is scanned even alone (the last token of a
    # chunked prompt, say): transformers scans a prompt, and some mixers' scans and decode steps differ
    # (Nemotron-H's and Zamba2's scans clamp dt, their decode steps do not: runtime.context.GeneratedSplit).
    if seq.num_computed_tokens < len(seq.prompt_token_ids):
        return False
    verifies = seq.num_computed_tokens + 1 == seq.num_tokens and num_new_tokens == 1 + len(seq.spec_token_ids)
    return num_new_tokens == 1 or verifies
