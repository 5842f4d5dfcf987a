"""SamplingParams, shaped like vLLM's so that its users feel at home."""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.structured_outputs.params import StructuredOutputsParams

# As vLLM's _SAMPLING_EPS: a temperature below this is greedy. Dividing logits by it would overflow
# float32 (1e-40 is 0 there) and hand inf/nan to the sampler.
SAMPLING_EPS = 1e-5

# generation_config.json keys that vLLM takes as sampling defaults, and transformers' own defaults:
# vLLM reads the file through GenerationConfig.to_diff_dict(), which leaves out values equal to these.
GENERATION_DEFAULTS: dict[str, Any] = {
    "repetition_penalty": 1.0, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None, "max_new_tokens": None,
}

# The numeric fields and the kind of number each takes; the comparisons in _validate would raise a TypeError
# naming no field on a string ("0"), and a bool is a mistake rather than a number here.
INTEGER_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")
REAL_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p")
OPTIONAL_FIELDS = ("seed", "max_tokens", "logprobs", "prompt_logprobs")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token and when to stop; every field has vLLM's name and meaning.

    temperature 0 (or below 1e-5) means greedy. `top_k` 0 or -1, `top_p` 1 and `min_p` 0 disable those
    filters. `presence_penalty` and `frequency_penalty` (OpenAI's, in [-2, 2]) lower the logits of tokens
    already generated, once or per occurrence; `repetition_penalty` (> 0, 1 is off) divides the positive
    logits and multiplies the negative ones of tokens in the prompt or the output. `logit_bias` adds to
    the logits of token ids (clamped to [-100, 100]); `allowed_token_ids` restricts sampling to those ids.
    `logprobs=N` returns the N most likely tokens' log-probabilities at each step (plus the sampled one);
    `prompt_logprobs=N` does the same for each prompt token after the first. `n` completions per prompt.
    Stop strings are removed from the returned text. `structured_outputs` (a StructuredOutputsParams)
    constrains the output to a JSON schema, a regex, a choice of strings or a grammar.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    allowed_token_ids: tuple[int, ...] | None = None
    structured_outputs: StructuredOutputsParams | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        _check_types(self)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if self.logit_bias:
            # As vLLM (and OpenAI): token ids may come as strings, and a bias is clamped to [-100, 100].
            bias = {_token_id(t, "logit_bias"): min(100.0, max(-100.0, _bias(b))) for t, b in self.logit_bias.items()}
            object.__setattr__(self, "logit_bias", bias)
        self._validate()
        if self.temperature < SAMPLING_EPS:
            object.__setattr__(self, "temperature", 0.0)

    def _validate(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be greater than zero and finite, got {self.repetition_penalty}")
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be non-negative and finite, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be non-negative, got {getattr(self, name)}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty; leave it unset to allow every token")
            for t in self.allowed_token_ids:
                _token_id(t, "allowed_token_ids")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams (from runtime import "
                             f"StructuredOutputsParams), got {type(self.structured_outputs).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def check_some_token_allowed(self, eos_token_ids: set[int] | frozenset[int]) -> None:
        """Refuse constraints that leave no token to pick: `allowed_token_ids` all among the tokens that
        `min_tokens` holds back (the stop token ids, and EOS unless `ignore_eos`). The sampler would have
        nothing to sample from at the first step; refusing up front says why."""
        if self.allowed_token_ids is None or self.min_tokens == 0:
            return
        held_back = set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))
        if set(self.allowed_token_ids) <= held_back:
            raise ValueError(f"allowed_token_ids {list(self.allowed_token_ids)} are all end-of-sequence or stop "
                             f"tokens, which min_tokens={self.min_tokens} bans until that many tokens are generated, "
                             "so no token could be generated; allow another token, or set min_tokens to 0")

    def token_ids_to_check(self) -> dict[str, list[int]]:
        """The token ids the engine checks against the vocabulary, by field."""
        return {"stop_token_ids": list(self.stop_token_ids), "logit_bias": list(self.logit_bias or ()),
                "allowed_token_ids": list(self.allowed_token_ids or ())}


def _check_types(params: SamplingParams) -> None:
    for name in INTEGER_FIELDS + REAL_FIELDS:
        value = getattr(params, name)
        kind = numbers.Integral if name in INTEGER_FIELDS else numbers.Real
        if value is None and name in OPTIONAL_FIELDS:
            continue
        if isinstance(value, bool) or not isinstance(value, kind):
            expected = "an integer" if kind is numbers.Integral else "a number"
            optional = " or None" if name in OPTIONAL_FIELDS else ""
            raise ValueError(f"{name} must be {expected}{optional}, got {value!r} ({type(value).__name__})")


def _bias(value: Any) -> float:
    """A logit_bias value, checked before the clamp: NaN would clamp to -100 and infinity to 100."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"logit_bias values must be finite numbers, got {value!r}")
    return float(value)


def _token_id(value: Any, name: str) -> int:
    try:
        token = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: {value!r} is not a token id") from None
    if isinstance(value, float) and value != token:
        raise ValueError(f"{name}: {value!r} is not a token id")
    return token


def generation_defaults(model_dir: Path) -> dict[str, Any]:
    """The sampling defaults a model's generation_config.json sets, as SamplingParams keywords (vLLM's rule:
    repetition_penalty, temperature, top_k, top_p, min_p and max_new_tokens as max_tokens, where they differ
    from transformers' defaults)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    found = {key: config[key] for key, default in GENERATION_DEFAULTS.items()
             if config.get(key) is not None and config[key] != default}
    if "max_new_tokens" in found:
        found["max_tokens"] = found.pop("max_new_tokens")
    return found
