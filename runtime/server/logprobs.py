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


def _top(logprobs: dict[int, Logprob], num_top: int) -> list[tuple[int, float]]:
    # The engine's dict holds the top `num_top` and the sampled token, which may be an extra entry.
    return sorted(((t, lp.logprob) for t, lp in logprobs.items()), key=lambda item: -item[1])[:num_top]


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, Logprob] | None], num_top: int,
                        text_offset: int = 0) -> CompletionLogprobs:
    """`text_offset` is where the first of these tokens starts in the choice's text. An echoed prompt's first
    token has no logprobs (None): it is listed with null ones, as OpenAI and vLLM do."""
    out = CompletionLogprobs()
    for token_id, step in zip(token_ids, logprobs, strict=True):
        token = tokenizer.decode([token_id])
        out.tokens.append(token)
        out.token_logprobs.append(step[token_id].logprob if step is not None else None)
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
        content.append(TokenLogprob(**_entry(tokenizer, token_id, step[token_id].logprob).model_dump(),
                                    top_logprobs=top))
    return ChatLogprobs(content=content)
