"""The engine's per-token {token id: Logprob} dicts in OpenAI's two shapes (completions and chat)."""

from __future__ import annotations

from runtime.outputs import Logprob
from runtime.server.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    LogprobJSON,
    PromptLogprobsJSON,
    TokenLogprob,
    TopLogprob,
)


# As vLLM's server: a token that a constraint (a structured output's grammar) rules out has logprob -inf,
# which JSON cannot hold (it would be written as null); it is reported as this.
MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _top(logprobs: dict[int, Logprob], num_top: int) -> list[tuple[int, float]]:
    # The engine's dict holds the top `num_top` and the sampled token, which may be an extra entry.
    top = sorted(((t, lp.logprob) for t, lp in logprobs.items()), key=lambda item: -item[1])[:num_top]
    return [(t, _finite(lp)) for t, lp in top]


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, Logprob] | None], num_top: int,
                        text_offset: int = 0) -> CompletionLogprobs:
    """`text_offset` is where the first of these tokens starts in the choice's text. An echoed prompt's first
    token has no logprobs (None): it is listed with null ones, as OpenAI and vLLM do."""
    out = CompletionLogprobs()
    for token_id, step in zip(token_ids, logprobs, strict=True):
        token = tokenizer.decode([token_id])
        out.tokens.append(token)
        out.token_logprobs.append(_finite(step[token_id].logprob) if step is not None else None)
        out.top_logprobs.append({tokenizer.decode([t]): lp for t, lp in _top(step, num_top)} if step is not None
                                else None)
        out.text_offset.append(text_offset)
        text_offset += len(token)
    return out


def prompt_logprobs_json(logprobs: list[dict[int, Logprob] | None] | None) -> PromptLogprobsJSON | None:
    """vLLM's `prompt_logprobs` field: per prompt token {token id: {logprob, rank, decoded_token}}, the first None."""
    if logprobs is None:
        return None
    return [None if step is None else {t: LogprobJSON(**vars(lp)) for t, lp in step.items()} for step in logprobs]


def _entry(tokenizer, token_id: int, logprob: float) -> TopLogprob:
    token = tokenizer.decode([token_id])
    return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, Logprob]], num_top: int) -> ChatLogprobs:
    content = []
    for token_id, step in zip(token_ids, logprobs, strict=True):
        top = [_entry(tokenizer, t, lp) for t, lp in _top(step, num_top)]
        content.append(TokenLogprob(**_entry(tokenizer, token_id, _finite(step[token_id].logprob)).model_dump(),
                                    top_logprobs=top))
    return ChatLogprobs(content=content)
