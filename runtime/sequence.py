"""One request's tokens and its place in the page pool. Pure Python: no torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from runtime.outputs import Logprob
from runtime.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    stream: bool = False
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Page ids, per attention group: the KV blocks, in order.
    block_tables: list[list[int]] = field(default_factory=list)
    # Page ids, per state group: this sequence's Mamba state page.
    state_pages: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Prefix caching: the chained hash of each full block of token_ids (grown as tokens come),
    # how many of the blocks this sequence holds are registered in the cache, and how many
    # prompt tokens its first admission found cached.
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0
    # Per generated token: {token id: Logprob}, when logprobs were requested.
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    # With params.prompt_logprobs: per prompt token so far, the first None (it has nothing before it).
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    # With SamplingParams.n > 1 each sample is a sequence of its own: the request it belongs to and its index.
    parent_id: str | None = None
    index: int = 0
    cumulative_logprob: float = 0.0
    # Set when a stop string cut the text; otherwise the text is decoded from output_token_ids.
    text: str | None = None
    # With params.structured_outputs: the GrammarState that says which tokens may come next.
    grammar: Any = None
    # Speculative decoding: the tokens proposed for this step (not yet part of token_ids), and the pages
    # that keep its state after each of the step's positions but the last (runtime/spec_decode/speculator.py).
    spec_token_ids: list[int] = field(default_factory=list)
    checkpoint_pages: list[int] = field(default_factory=list)
    spec_counters: Any = None  # runtime.spec_decode.verify.SpecCounters, once the request verified drafts
    # In an engine that speculates: its generated tokens, recomputed after preemption, are computed as decoding
    # computed them (runtime.runner._kind), as the verifies that may have computed them did.
    speculates: bool = False
    # (steps left without proposals, the next such pause): drafts that keep failing pause (Speculator.settle).
    spec_backoff: tuple[int, int] = (0, 0)
    prompt_lookup: Any = None  # runtime.spec_decode.ngram.PromptLookup: its tokens' positions, kept between steps
    # The request's LoRARequest, or None for the base model.
    lora_request: Any = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def has_pages(self) -> bool:
        return bool(self.state_pages) or any(self.block_tables)
