"""Micro-batches in flight through the pipeline's stages (vLLM's virtual engines), driven by rank 0's engine.

With PP stages, rank 0 keeps up to PP steps ("micro-batches") in flight: it schedules one, runs the first
stage on it and sends its hidden states on, then schedules the next instead of waiting for the first's
logits, so that stage 0 computes micro-batch i+1 while stage 1 computes micro-batch i. It waits for the
oldest micro-batch's logits only when PP of them are in flight (or nothing else can be scheduled), samples
them, and returns that micro-batch's outputs: each `Engine.step` lands one micro-batch.

A sequence belongs to one micro-batch at a time: the scheduler neither schedules nor preempts a sequence
whose step is in flight (`Scheduler.schedule(busy=...)`), so its pages and state are never touched by two
steps at once; its next step needs the token its last one samples anyway. Every rank runs the steps and
page copies in the order rank 0 sent them, so a page freed by one step and given to the next is written in
that order on every stage. Each micro-batch takes its share of the unfinished sequences (their number over
PP, rounded up), so that PP decoding sequences or more split into PP micro-batches of about equal size.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from runtime.scheduler import Batch


class MicroBatches:
    """Rank 0's micro-batches in flight; `depth` of them at most (1: one step at a time, no overlap)."""

    def __init__(self, engine: Any, depth: int):
        self.engine, self.depth = engine, depth
        self.flights: deque[tuple[Batch, Any]] = deque()  # (batch, the runner's InFlight), oldest first
        self.most_in_flight = 0  # the most micro-batches that were in flight at once (tests, bench)

    def __len__(self) -> int:
        return len(self.flights)

    def step(self) -> list[Any]:
        """Fill the pipeline with micro-batches, then land the oldest: its outputs."""
        engine = self.engine
        while len(self.flights) < self.depth:
            busy = frozenset(seq.request_id for batch, _ in self.flights for seq in batch.seqs)
            batch = engine._schedule(busy, self._share() if self.depth > 1 else None)
            if not batch:
                break
            self.flights.append((batch, engine.runner.submit(batch)))
            self.most_in_flight = max(self.most_in_flight, len(self.flights))
        if not self.flights:
            return []
        batch, flight = self.flights.popleft()
        return engine._land(batch, engine.runner.collect(flight))

    def _share(self) -> int:
        scheduler = self.engine.scheduler
        unfinished = len(scheduler.running) + len(scheduler.waiting)
        return max(1, -(-unfinished // self.depth))


def live_part(batch: Batch, seqs: list[Any], logits: torch.Tensor,
              prompt_logits: list[Any]) -> tuple[Batch, list[Any], torch.Tensor, list[Any]]:
    """A landed micro-batch without the sequences that finished (were aborted) while it was in flight: their
    pages are already free and their requests forgotten. A sampled sequence has a row of logits, and one per
    draft it verified."""
    live = Batch([], [])
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        if not seq.is_finished:
            live.seqs.append(seq)
            live.num_new_tokens.append(n)
    rows, at, kept = [], 0, []
    for seq in seqs:
        n = len(seq.spec_token_ids) + 1
        if not seq.is_finished:
            rows.extend(range(at, at + n))
            kept.append(seq)
        at += n
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    return live, kept, logits[index], [chunk for chunk in prompt_logits if not chunk.seq.is_finished]
