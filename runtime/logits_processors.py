"""What SamplingParams does to a batch of logits before a token is picked, in vLLM's order.

Before greedy and random picks alike: allowed_token_ids, the min_tokens bans, logit_bias, then the
repetition, frequency and presence penalties. For random picks only, after the temperature: min_p
(then the sampler's top-k and top-p). Each step is one batched torch operation over the rows that ask
for it; rows that do not are left exactly as they were.
"""

from __future__ import annotations

import torch

from runtime.sampling_params import SamplingParams

NEG_INF = float("-inf")
# Far beyond any real logit, yet divided by the smallest temperature that samples (1e-5) still finite in float32.
PENALISED_LIMIT = 1e30


def _pairs(lists: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) of every token in `lists`, as two long tensors."""
    rows = [row for row, ids in enumerate(lists) for _ in ids]
    cols = [t for ids in lists for t in ids]
    as_long = dict(dtype=torch.long, device=device)
    return torch.tensor(rows, **as_long), torch.tensor(cols, **as_long)


def apply_allowed_token_ids(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    lists = [list(p.allowed_token_ids) if p.allowed_token_ids is not None else [] for p in params]
    if not any(lists):
        return
    masked = torch.zeros_like(logits, dtype=torch.bool)
    masked[[row for row, ids in enumerate(lists) if ids]] = True
    masked[_pairs(lists, logits.device)] = False
    logits.masked_fill_(masked, NEG_INF)


def apply_bans(logits: torch.Tensor, banned: list[list[int]]) -> None:
    """Tokens a row may not pick now (its stop and EOS tokens before min_tokens are out)."""
    if any(banned):
        logits[_pairs(banned, logits.device)] = NEG_INF


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    lists = [list(p.logit_bias) if p.logit_bias else [] for p in params]
    if not any(lists):
        return
    values = [b for p in params if p.logit_bias for b in p.logit_bias.values()]
    logits.index_put_(_pairs(lists, logits.device), torch.tensor(values, dtype=logits.dtype, device=logits.device),
                      accumulate=True)


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    histories: list[tuple[list[int], list[int]]]) -> None:
    """vLLM's apply_penalties: repetition over the distinct tokens of prompt and output, frequency (per
    occurrence) and presence (per distinct token) over the output, as OpenAI defines them.

    Only the logits of tokens a row has seen change, so the work goes by history length, not by
    vocabulary: one gather and one scatter for the repetition penalty, one accumulating add for the others.
    """
    # Flat (row, token id, value) lists: for the repetition penalty its factor, for the others the amount added.
    repeated: tuple[list[int], list[int], list[float]] = ([], [], [])
    added: tuple[list[int], list[int], list[float]] = ([], [], [])
    for row, (p, (prompt, output)) in enumerate(zip(params, histories)):
        if not p.has_penalties:
            continue
        distinct_output = set(output)
        if p.repetition_penalty != 1:
            _extend(repeated, row, set(prompt) | distinct_output, p.repetition_penalty)
        if p.frequency_penalty:
            _extend(added, row, output, -p.frequency_penalty)
        if p.presence_penalty:
            _extend(added, row, distinct_output, -p.presence_penalty)
    if repeated[0]:
        index, factor = _index(repeated[0], repeated[1], logits.device), _values(repeated[2], logits)
        values = logits[index]
        penalised = torch.where(values > 0, values / factor, values * factor)
        # A factor like 1e-38 (or 1e38) overflows float32 to inf, whose softmax is nan. Clamping keeps such a
        # token infinitely (in)attractive next to real logits while the sampler's arithmetic stays finite;
        # a banned token's -inf stays -inf.
        logits[index] = torch.where(values.isfinite(), penalised.clamp(-PENALISED_LIMIT, PENALISED_LIMIT), values)
    if added[0]:
        logits.index_put_(_index(added[0], added[1], logits.device), _values(added[2], logits), accumulate=True)


def _extend(flat: tuple[list[int], list[int], list[float]], row: int, tokens, value: float) -> None:
    tokens = list(tokens)
    flat[0].extend([row] * len(tokens))
    flat[1].extend(tokens)
    flat[2].extend([value] * len(tokens))


def _index(rows: list[int], tokens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(tokens, dtype=torch.long, device=device))


def _values(values: list[float], logits: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=logits.dtype, device=logits.device)


def apply_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Drop tokens less likely than min_p times the most likely one (after the temperature)."""
    if not any(p.min_p > 0 for p in params):
        return
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=probs.device)
    logits.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * min_p[:, None], NEG_INF)


def process(logits: torch.Tensor, params: list[SamplingParams], banned: list[list[int]],
            histories: list[tuple[list[int], list[int]]]) -> None:
    """Everything before the greedy pick, in place, in vLLM's order."""
    apply_allowed_token_ids(logits, params)
    apply_bans(logits, banned)
    apply_logit_bias(logits, params)
    apply_penalties(logits, params, histories)
