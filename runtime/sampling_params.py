"""SamplingParams, shaped like vLLM's so that its users feel at home."""

from __future__ import annotations

import math
from dataclasses import dataclass

# As vLLM's _SAMPLING_EPS: a temperature below this is greedy. Dividing logits by it would overflow
# float32 (1e-40 is 0 there) and hand inf/nan to the sampler.
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token and when to stop.

    temperature 0 (or below 1e-5) means greedy. `top_k` 0 or -1 and `top_p` 1 disable those filters.
    `logprobs=N` returns the N most likely tokens' log-probabilities at each step (plus
    the sampled one). Stop strings are removed from the returned text.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._validate()
        if self.temperature < SAMPLING_EPS:
            object.__setattr__(self, "temperature", 0.0)

    def _validate(self) -> None:
        if self.n != 1:
            raise ValueError(f"n={self.n} is not supported; send the request n times with different seeds")
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be non-negative and finite, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable) or positive, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
