"""`speculative_config`, as vLLM spells it: a dict on `LLM(...)`, a JSON object on the command line. No torch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pathlib import Path

from runtime.hf_config import ConfigError, architecture_of, load_raw_config
from runtime.models import resolve

# "draft_model" is vLLM's name for the method a "model" key picks: a smaller model with the same tokenizer.
METHODS = ("ngram", "draft_model")
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
    model: str | None = None  # the draft model's directory (method "draft_model")

    def describe(self) -> str:
        if self.model is not None:
            return f"draft model {self.model}, {self.num_speculative_tokens} tokens per step"
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


def _draft_model(raw: dict[str, Any], spelled: str, vocab_size: int | None) -> str:
    """The draft model's directory, checked: it exists, its config.json reads, and its vocabulary is the model's."""
    path = raw["model"]
    if not isinstance(path, str) or not path:
        raise _fail(spelled, f'"model" must name the draft model\'s directory, got {path!r}')
    if not Path(path).exists():
        raise _fail(spelled, f'the draft model {path} does not exist; "model" names a checkpoint directory '
                             "with the same tokenizer as the model")
    try:
        raw_config = load_raw_config(path)
        hf = resolve(architecture_of(raw_config)).read_config(raw_config)
    except ConfigError as err:
        raise _fail(spelled, f"the draft model {path}: {err}") from None
    draft_vocab = hf.first("vocab_size")
    if vocab_size is not None and draft_vocab != vocab_size:
        raise _fail(spelled, f"the draft model {path} has a vocabulary of {draft_vocab} tokens and the model "
                             f"{vocab_size}: a draft model must share the model's tokenizer")
    return path


def parse_speculative_config(value: Any, spelled: str, max_model_len: int,
                             vocab_size: int | None = None) -> SpeculativeConfig | None:
    """The config from a dict or its JSON text; `spelled` names the option as the user wrote it, and
    `vocab_size` is the model's, which a draft model must have too."""
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
    method = value.get("method", "draft_model" if "model" in value else None)
    if (method == "draft_model") != ("model" in value):
        raise _fail(spelled, '"model" (a draft model\'s directory) goes with method "draft_model" alone')
    if method not in METHODS:
        hint = " (a checkpoint's MTP heads are not supported yet)" if method == "mtp" else ""
        raise _fail(spelled, f'unknown method {method!r}{hint}; the methods are {", ".join(METHODS)}')
    k = _positive(value, "num_speculative_tokens", None, spelled)
    if k >= max_model_len:
        raise _fail(spelled, f'"num_speculative_tokens" {k} leaves no room in max_model_len={max_model_len}; '
                             f"use at most {max_model_len - 1}")
    if method == "draft_model":
        return SpeculativeConfig(method, k, model=_draft_model(value, spelled, vocab_size))
    low = _positive(value, "prompt_lookup_min", DEFAULT_LOOKUP_MIN, spelled)
    high = _positive(value, "prompt_lookup_max", max(DEFAULT_LOOKUP_MAX, low), spelled)
    if low > high:
        raise _fail(spelled, f'"prompt_lookup_min" {low} is more than "prompt_lookup_max" {high}')
    return SpeculativeConfig(method, k, low, high)
