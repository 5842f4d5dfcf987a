"""The model runner: a scheduled batch becomes packed inputs, one ForwardContext, a forward pass and logits."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from runtime import kernels
from runtime.cache.layout import CacheLayout
from runtime.cache.pool import allocate_pool, bind_pool, default_cache_bytes
from runtime.config import EngineConfig
from runtime.context import ForwardContext, forward_context
from runtime.kernels.metadata import build_attention_metadata, build_mamba_prefill_metadata
from runtime.layers.linear import pack_linears
from runtime.loader import build_model
from runtime.scheduler import Batch
from runtime.sequence import Sequence

logger = logging.getLogger("tandem")

MAMBA1_CHUNK = 256
# Compiling the CPU kernels takes seconds; it pays back only when each state update moves this much.
COMPILE_MIN_STATE_BYTES = 256 * 1024


def compile_pays(layout: CacheLayout) -> bool:
    return layout.mamba is not None and layout.mamba.unpadded_page_size_bytes >= COMPILE_MIN_STATE_BYTES


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # Checked before anything global (the kernel binding) changes, so a failed engine leaves others intact.
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: no CUDA device is available here; use --device cpu (or auto)")
    return torch.device(name)


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
        if config.derived_threads is not None:  # process-wide, as torch's thread pool is
            torch.set_num_threads(config.derived_threads)
        # Once per engine, before any kernel runs: no kernel call checks its device.
        backend = kernels.resolve_backend(config.kernel_backend, self.device)
        self.kernel_backend = kernels.bind(backend, self.device, compile_cpu=compile_pays(self.layout))
        logger.info("kernel backend: %s on %s", self.kernel_backend, self.device)
        self.model = build_model(config, self.device)
        if self.device.type == "cpu" and self.kernel_backend == "torch":
            pack_linears(self.model)
        self.num_pages = self._num_pages()
        self.pool = allocate_pool(self.layout, self.num_pages, self.device)
        bind_pool(self.model, self.pool, self.layout)
        # Mamba-1 has no chunked scan; its prefill metadata still wants a chunk length.
        self.chunk_size = config.declaration.mamba_chunk_size(config.hf_config) or MAMBA1_CHUNK
        logger.info("page pool: %d pages of %d B x %d layers (%.1f MiB)", self.num_pages,
                    self.layout.page_size_bytes, self.layout.group_size, self.pool.numel() / 2**20)

    def _num_pages(self) -> int:
        if self.config.num_pages is not None:
            return self.config.num_pages
        budget = self.config.kv_cache_memory_bytes or default_cache_bytes(self.device)
        by_memory = budget // self.layout.bytes_per_page_id
        # No point holding more pages than every sequence at full length could use, or, with prefix
        # caching, as many again for cached blocks and snapshots.
        useful = self.config.max_num_seqs * self.layout.pages_per_sequence(self.config.derived_max_model_len)
        if self.config.enable_prefix_caching:
            useful *= 2
        return max(1, min(by_memory, useful))

    @torch.inference_mode()
    def execute(self, batch: Batch) -> tuple[list[Sequence], torch.Tensor]:
        """Run one step; return the sequences that get a new token and their logits (float32)."""
        step = self.prepare(batch)
        with forward_context(step.context):
            hidden = self.model(step.input_ids, step.positions)
        return step.sample_seqs, self.model.compute_logits(hidden[step.logits_indices])

    @torch.inference_mode()
    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole page ids (every slab of the group), in order: a later copy may read an earlier one's target."""
        for source, destination in copies:
            self.pool[destination].copy_(self.pool[source])

    def prepare(self, batch: Batch) -> StepInputs:
        order = sorted(range(len(batch.seqs)), key=lambda i: not _is_decode(batch.seqs[i], batch.num_new_tokens[i]))
        seqs = [batch.seqs[i] for i in order]
        counts = [batch.num_new_tokens[i] for i in order]
        starts = [seq.num_computed_tokens for seq in seqs]
        num_decodes = sum(_is_decode(seq, n) for seq, n in zip(seqs, counts))
        input_ids, positions, logits_indices, sample_seqs = [], [], [], []
        for seq, start, n in zip(seqs, starts, counts):
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            if start + n == seq.num_tokens:
                logits_indices.append(len(input_ids) - 1)
                sample_seqs.append(seq)
        context = self._context(seqs, starts, counts, num_decodes, len(input_ids))
        as_long = dict(dtype=torch.long, device=self.device)
        return StepInputs(torch.tensor(input_ids, **as_long), torch.tensor(positions, **as_long), context,
                          torch.tensor(logits_indices, **as_long), sample_seqs)

    def _context(self, seqs, starts, counts, num_decodes, num_tokens) -> ForwardContext:
        layout, device = self.layout, self.device
        attention, block_tables, slot_mappings = None, (), ()
        if layout.block_size:
            seq_lens = [start + n for start, n in zip(starts, counts)]
            attention = build_attention_metadata(counts, seq_lens, device)
            block_tables = tuple(self._block_table(seqs, g) for g in range(layout.num_attention_groups))
            slot_mappings = tuple(self._slot_mapping(seqs, starts, counts, g)
                                  for g in range(layout.num_attention_groups))
        mamba_prefill, decode_idx, prefill_idx = None, (), ()
        if layout.mamba is not None:
            if num_decodes < len(seqs):
                mamba_prefill = build_mamba_prefill_metadata(counts[num_decodes:], starts[num_decodes:],
                                                             self.chunk_size, device)
            pages = [torch.tensor([seq.state_pages[g] for seq in seqs], dtype=torch.long, device=device)
                     for g in range(layout.num_state_groups)]
            decode_idx = tuple(p[:num_decodes] for p in pages)
            prefill_idx = tuple(p[num_decodes:] for p in pages)
        return ForwardContext(num_decodes, num_tokens - num_decodes, attention, block_tables, slot_mappings,
                              mamba_prefill, decode_idx, prefill_idx)

    def _block_table(self, seqs: list[Sequence], group: int) -> torch.Tensor:
        width = max(len(seq.block_tables[group]) for seq in seqs)
        rows = [seq.block_tables[group] + [0] * (width - len(seq.block_tables[group])) for seq in seqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    def _slot_mapping(self, seqs, starts, counts, group: int) -> torch.Tensor:
        size = self.layout.block_size
        slots = [
            seq.block_tables[group][p // size] * size + p % size
            for seq, start, n in zip(seqs, starts, counts)
            for p in range(start, start + n)
        ]
        return torch.tensor(slots, dtype=torch.long, device=self.device)


def _is_decode(seq: Sequence, num_new_tokens: int) -> bool:
    # A one-token step of a sequence with cached state is a state update, whatever its phase.
    return num_new_tokens == 1 and seq.num_computed_tokens > 0
