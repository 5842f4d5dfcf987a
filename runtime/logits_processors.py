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


def _bin_counts(lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Per row, how often each token id occurs in its list: (rows, vocab) long."""
    width = max((len(ids) for ids in lists), default=0)
    # Padding goes to an extra column, dropped below.
    padded = torch.tensor([ids + [vocab] * (width - len(ids)) for ids in lists], dtype=torch.long, device=device)
    counts = torch.zeros(len(lists), vocab + 1, dtype=torch.long, device=device)
    counts.scatter_add_(1, padded.reshape(len(lists), width), torch.ones_like(padded).reshape(len(lists), width))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    histories: list[tuple[list[int], list[int]]]) -> None:
    """vLLM's apply_penalties: repetition over prompt and output tokens, frequency and presence
    (OpenAI's definitions) over output tokens."""
    if not any(p.has_penalties for p in params):
        return
    vocab, device = logits.shape[-1], logits.device
    # Only rows with penalties count their tokens: the others' factors are 1 and 0 whatever they hold.
    wanted = [p.has_penalties for p in params]
    output_counts = _bin_counts([list(out) if w else [] for w, (_, out) in zip(wanted, histories)], vocab, device)
    prompt_counts = _bin_counts([list(prompt) if w else [] for w, (prompt, _) in zip(wanted, histories)], vocab,
                                device)
    seen = (prompt_counts > 0) | (output_counts > 0)

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in params], dtype=logits.dtype, device=device)[:, None]

    repetition = torch.where(seen, column("repetition_penalty"), 1.0)
    logits.copy_(torch.where(logits > 0, logits / repetition, logits * repetition))
    logits -= column("frequency_penalty") * output_counts
    logits -= column("presence_penalty") * (output_counts > 0)


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
