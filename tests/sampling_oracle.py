"""vLLM's sampling parameters applied to HF's own logits, written independently of runtime/logits_processors.py.

Each parameter acts on HF's float64 logits one token at a time, as vLLM documents it: allowed ids, logit
bias, repetition over prompt and output, frequency and presence over the output; for random draws the
temperature, then min_p. `generate` runs HF step by step with that processing, for a whole reference
completion (greedy, or drawn with a generator seeded as the engine seeds a request's).
"""

from __future__ import annotations

import math

import torch


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """HF's float64 logits at every position of `ids`."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].double()


def steps(hf, prompt_ids: list[int], tokens: list[int]) -> torch.Tensor:
    """HF's logits for each of `tokens` after the prompt (one forward over the whole text)."""
    logits = hf_logits(hf, prompt_ids + tokens)
    return logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(tokens)]


def oracle_logits(logits: torch.Tensor, prompt: list[int], output: list[int], params) -> torch.Tensor:
    """One step's logits after the processors that act before the greedy pick."""
    x = logits.clone()
    if params.allowed_token_ids is not None:
        keep = torch.full_like(x, -math.inf)
        keep[list(params.allowed_token_ids)] = 0
        x = x + keep
    for token, bias in (params.logit_bias or {}).items():
        x[token] += bias
    for token in set(prompt) | set(output):
        x[token] = x[token] / params.repetition_penalty if x[token] > 0 else x[token] * params.repetition_penalty
    for token in set(output):
        x[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return x


def oracle_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """The distribution a random draw comes from: temperature, then min_p."""
    probs = torch.softmax(logits / params.temperature, dim=-1)
    probs[probs < params.min_p * probs.max()] = 0
    return probs / probs.sum()


def generate(hf, prompt: list[int], params, num_tokens: int) -> list[int]:
    """HF's completion under `params`: greedy at temperature 0, else drawn with a generator seeded with
    params.seed (one multinomial draw per step, as the engine draws)."""
    generator = torch.Generator().manual_seed(params.seed) if not params.greedy else None
    tokens: list[int] = []
    for _ in range(num_tokens):
        logits = oracle_logits(hf_logits(hf, prompt + tokens)[-1], prompt, tokens, params)
        if generator is None:
            tokens.append(logits.argmax().item())
        else:
            tokens.append(torch.multinomial(oracle_probs(logits, params).float(), 1, generator=generator).item())
    return tokens
