"""What `LLM.generate` returns, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.spec_decode.verify import SpecCounters


@dataclass
class Logprob:
    """One token's log-probability under the model, its rank among all tokens (1 is the most likely)
    and its text, as vLLM's."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position, {token id: Logprob}: the top-N tokens and the chosen one (vLLM's SampleLogprobs).
SampleLogprobs = list[dict[int, Logprob]]
# The same for the prompt; the first prompt token has nothing before it, so its entry is None.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # One {token id: Logprob} dict per generated token, when SamplingParams.logprobs is set.
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # One CompletionOutput per sample (SamplingParams.n), in index order once finished; while streaming,
    # the samples that advanced in this step.
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_preemptions: int = 0
    # Prompt tokens found in the prefix cache when the request was first scheduled (vLLM's field).
    num_cached_tokens: int = 0
    # Why the request failed (finish reason "error"): an error in its own sampling or post-processing.
    error: str | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token, the first None (vLLM's field).
    prompt_logprobs: PromptLogprobs | None = None
    # With speculative decoding: this request's drafts, draft tokens and accepted tokens (vLLM's counters).
    spec_decode: SpecCounters | None = None
