"""`speculative_config`, as vLLM spells it: a dict on `LLM(...)`, a JSON object on the command line. No torch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from runtime.hf_config import ConfigError

METHODS = ("ngram", "mtp")
# vLLM's defaults for prompt lookup.
DEFAULT_LOOKUP_MIN = 1
DEFAULT_LOOKUP_MAX = 5
KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP_MIN
    prompt_lookup_max: int = DEFAULT_LOOKUP_MAX

    def describe(self) -> str:
        if self.method == "mtp":
            return f"mtp (the checkpoint's multi-token-prediction head), {self.num_speculative_tokens} tokens per step"
        return (f"{self.method}, {self.num_speculative_tokens} tokens per step "
                f"(n-grams of {self.prompt_lookup_min} to {self.prompt_lookup_max})")


def _fail(spelled: str, problem: str) -> ConfigError:
    return ConfigError(f"{spelled}: {problem}")


def _positive(raw: dict[str, Any], key: str, default: int | None, spelled: str) -> int:
    value = raw.get(key, default)
    if value is None:
        raise _fail(spelled, f'"{key}" is required, e.g. {{"method": "ngram", "{key}": 4}}')
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(spelled, f'"{key}" must be a positive integer, got {value!r}')
    return value


def parse_speculative_config(value: Any, spelled: str, max_model_len: int) -> SpeculativeConfig | None:
    """The config from a dict or its JSON text; `spelled` names the option as the user wrote it."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise _fail(spelled, f"not valid JSON ({err.msg}); write it like "
                                 '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
    if not isinstance(value, dict):
        raise _fail(spelled, f"must be a JSON object (a dict), got {type(value).__name__}")
    unknown = sorted(set(value) - KEYS)
    if unknown:
        raise _fail(spelled, f"unknown key {unknown[0]!r}; the keys are {', '.join(sorted(KEYS))}")
    if "model" in value:
        raise _fail(spelled, 'a draft model ("model") is not supported yet; use {"method": "ngram", ...}')
    method = value.get("method")
    if method not in METHODS:
        raise _fail(spelled, f'unknown method {method!r}; the methods are {", ".join(METHODS)}')
    k = _positive(value, "num_speculative_tokens", None, spelled)
    if k >= max_model_len:
        raise _fail(spelled, f'"num_speculative_tokens" {k} leaves no room in max_model_len={max_model_len}; '
                             f"use at most {max_model_len - 1}")
    low = _positive(value, "prompt_lookup_min", DEFAULT_LOOKUP_MIN, spelled)
    high = _positive(value, "prompt_lookup_max", max(DEFAULT_LOOKUP_MAX, low), spelled)
    if low > high:
        raise _fail(spelled, f'"prompt_lookup_min" {low} is more than "prompt_lookup_max" {high}')
    return SpeculativeConfig(method, k, low, high)
