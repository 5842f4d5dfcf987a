"""SamplingParams.n > 1: one request, n sequences (vLLM's ParentRequest). Pure Python.

Each sample is a Sequence of its own, with its own pages and generator (seed + index when seeded, as
vLLM); with prefix caching the samples share the prompt's blocks. The parent gathers their outputs
into one RequestOutput whose `outputs` are in index order. Only sample 0 computes prompt logprobs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from runtime.outputs import CompletionOutput, RequestOutput
from runtime.sampling_params import SamplingParams
from runtime.sequence import Sequence


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    seed = params.seed + index if params.seed is not None else None
    return dataclasses.replace(params, n=1, seed=seed,
                               prompt_logprobs=params.prompt_logprobs if index == 0 else None)


def child_id(request_id: str, index: int) -> str:
    return f"{index}_{request_id}"


@dataclass
class ParentRequest:
    request_id: str
    children: list[Sequence]
    # The latest completion of each sample, by index.
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return len(self.completions) == len(self.children) and all(c.finished() for c in self.completions.values())

    def update(self, seq: Sequence, completion: CompletionOutput, error: str | None = None) -> RequestOutput | None:
        """Record a sample's completion; the parent's output when there is one to give (every step while
        streaming, else once every sample has finished)."""
        self.completions[seq.index] = completion
        if error is not None:
            self.errors.append(error)
        if not (self.finished or seq.stream):
            return None
        first = self.children[0]
        return RequestOutput(
            self.request_id, first.prompt, list(first.prompt_token_ids),
            [self.completions[i] for i in sorted(self.completions)], finished=self.finished,
            num_preemptions=sum(c.num_preemptions for c in self.children), num_cached_tokens=first.num_cached_tokens,
            error="; ".join(self.errors) or None,
            prompt_logprobs=list(first.prompt_logprobs) if first.params.prompt_logprobs is not None else None)
