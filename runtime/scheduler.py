"""Continuous batching with chunked prefill and preemption by recompute. Pure Python.

Each step spends a token budget: running sequences first (a decode needs one token, an
unfinished prompt the rest of it, in chunks), then waiting ones in arrival order. When
the pool runs out of pages, the most recently arrived running sequence is preempted:
its pages are freed and it is recomputed from scratch later (its Mamba state cannot be
rebuilt any other way).
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

    def schedule(self) -> Batch:
        batch = Batch([], [])
        budget = self.limits.max_num_batched_tokens
        preempted = self._schedule_running(batch, budget)
        if not preempted:
            self._schedule_waiting(batch, budget - batch.num_tokens)
        return batch

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """New tokens for `seq` this step, or 0 if it must wait for a larger budget."""
        n = min(seq.num_uncomputed_tokens, budget)
        if n < seq.num_uncomputed_tokens and not self.limits.enable_chunked_prefill:
            return 0
        return n

    def _schedule_running(self, batch: Batch, budget: int) -> bool:
        preempted, i = False, 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, budget)
            if n == 0:
                i += 1
                continue
            while not self.cache.can_allocate(seq, n):
                victim = self.running[-1]
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

    def _schedule_waiting(self, batch: Batch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            seq = self.waiting[0]
            n = self._chunk(seq, budget)
            if n == 0 or not self.cache.can_allocate(seq, n):
                break
            self.waiting.popleft()
            self.cache.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n

    def preempt(self, seq: Sequence) -> None:
        """Free every page of `seq`; it starts again from its first token when rescheduled."""
        self.running.remove(seq)
        self.cache.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def update(self, batch: Batch) -> list[Sequence]:
        """Account for the computed tokens; return the sequences that now need a new token."""
        ready = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                ready.append(seq)
        return ready

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.cache.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
