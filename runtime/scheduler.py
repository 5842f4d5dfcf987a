"""Continuous batching with chunked prefill and preemption by recompute. Pure Python.

Each step spends a token budget: running sequences first (a decode needs one token, an
unfinished prompt the rest of it, in chunks), then waiting ones in arrival order. A waiting
sequence starts from the longest prefix the cache holds (with prefix caching on), and its
chunks end where the cache wants a state snapshot. When the pool runs out of pages, the
running sequence admitted last (the last of `running`) is preempted: its pages are freed
and it is recomputed later (its Mamba state cannot be rebuilt any other way), from its
cached prefix if one is left.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from runtime.cache.manager import CacheManager
from runtime.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool = True
    max_loras: int = 0  # distinct LoRA adapters among the running sequences at most (0: no LoRA)


@dataclass
class Batch:
    """The sequences of one step and how many new tokens each one computes."""

    seqs: list[Sequence]
    num_new_tokens: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, cache: CacheManager, limits: SchedulerLimits):
        self.cache = cache
        self.limits = limits
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, busy: frozenset[str] = frozenset(), max_seqs: int | None = None) -> Batch:
        """The next step. `busy`: request ids whose step is still in flight (pipeline micro-batches), neither
        scheduled nor preempted; `max_seqs`: sequences in this step at most (a micro-batch's share)."""
        batch = Batch([], [])
        budget = self.limits.max_num_batched_tokens
        cap = max_seqs if max_seqs is not None else self.limits.max_num_seqs
        preempted = self._schedule_running(batch, budget, busy, cap)
        if not preempted:
            self._schedule_waiting(batch, budget - batch.num_tokens, cap)
        return batch

    def _chunk(self, seq: Sequence, budget: int, start: int) -> int:
        """New tokens for `seq` from `start` this step, or 0 if it must wait for a larger budget."""
        # A running sequence's drafts (speculative decoding) are verified in the same chunk as its last token.
        end = seq.num_tokens + len(seq.spec_token_ids)
        n = min(end - start, budget)
        if n < seq.num_tokens - start and not self.limits.enable_chunked_prefill:
            return 0
        prompt_end = len(seq.prompt_token_ids)
        if self.limits.enable_chunked_prefill and seq.output_token_ids and start < prompt_end < start + n:
            # A recomputed sequence's generated tokens get a chunk of their own, computed as decoding computed
            # them (runtime.context.GeneratedSplit: some scans treat dt otherwise than decode does).
            n = prompt_end - start
        prefix = self.cache.prefix
        if prefix is not None and self.limits.enable_chunked_prefill:
            n = prefix.chunk_end(seq, start, start + n) - start
        return n

    def _schedule_running(self, batch: Batch, budget: int, busy: frozenset[str], cap: int) -> bool:
        """Whether pages ran short (then no waiting sequence is admitted this step)."""
        preempted, i = False, 0
        while i < len(self.running) and budget > 0 and len(batch.seqs) < cap:
            seq = self.running[i]
            if seq.request_id in busy:
                i += 1
                continue
            n = self._chunk(seq, budget, seq.num_computed_tokens)
            if seq.spec_token_ids and not self.cache.can_allocate(seq, n):
                seq.spec_token_ids = []  # drafts never preempt anyone
                n = self._chunk(seq, budget, seq.num_computed_tokens)
            if n == 0:
                i += 1
                continue
            while not self.cache.can_allocate(seq, n):
                victim = self.running[-1]
                if victim.request_id in busy:  # its step is in flight: `seq` waits for it to land instead
                    preempted, i = True, i + 1
                    break
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self.cache.allocate(seq, n)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
                i += 1
        return preempted

    def _schedule_waiting(self, batch: Batch, budget: int, cap: int) -> None:
        while (self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs
               and len(batch.seqs) < cap):
            seq = self.waiting[0]
            hit = self.cache.lookup(seq)
            n = self._chunk(seq, budget, hit.num_tokens)
            if n == 0 or not self.cache.can_admit(seq, hit, n) or not self._lora_fits(seq):
                break
            self.waiting.popleft()
            self.cache.admit(seq, hit, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n

    def _lora_fits(self, seq: Sequence) -> bool:
        """Admitting `seq` keeps the running adapters within the slots (it waits for one to finish otherwise)."""
        if seq.lora_request is None:
            return True
        running = {s.lora_request.lora_int_id for s in self.running if s.lora_request is not None}
        return seq.lora_request.lora_int_id in running or len(running) < self.limits.max_loras

    def preempt(self, seq: Sequence) -> None:
        """Free every page of `seq`; it starts again from its first token when rescheduled."""
        self.running.remove(seq)
        self.cache.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def update(self, batch: Batch) -> None:
        """Account for the computed tokens, and offer what they filled to the prefix cache."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            self.cache.commit(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.cache.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
