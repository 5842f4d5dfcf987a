"""POST /v1/completions: one prompt or a list of them (text or token ids), `n` choices each, `echo`; the whole
response or a stream of chunks. Choice `index` is prompt index x n + sample index, as OpenAI and vLLM number them."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from runtime.outputs import CompletionOutput, RequestOutput
from runtime.sampling_params import SamplingParams
from runtime.server.async_engine import RequestHandle
from runtime.server.logprobs import completion_logprobs, prompt_logprobs_json
from runtime.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage
from runtime.server.state import ServerState
from runtime.server.structured import compile_grammar
from runtime.server.streaming import EventStream, TextDeltas, guarded, merged, results_unless_disconnected, sse


async def create_completion(state: ServerState, body: CompletionRequest, request: Request) -> Response:
    state.check_request(body)
    params = body.sampling_params(state.sampling_defaults)
    state.limits.check_params(params)
    await compile_grammar(state.engine.engine, params.structured_outputs, body.structured_field)
    prompts = []
    for prompt in body.engine_prompts():
        if isinstance(prompt, str):
            state.limits.check_prompt_chars(len(prompt), state.max_model_len, "prompt")
            prompt = await state.tokenize.encode(prompt)
        prompts.append(prompt)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    handles = await _add(state, prompts, params, request_id, body.stream, state.lora_for(body.model))
    if body.stream:
        return EventStream(guarded(_chunks(state, body, params, request_id, handles), handles))
    outputs = await results_unless_disconnected(request, handles)
    if outputs is None:
        return Response(status_code=499)  # nobody is there to read it
    choices, num_generated = [], 0
    for output in outputs:
        for completion in output.outputs:
            echo = Echo.of(state, body, output) if body.echo else None
            choices.append(_choice(state, body, len(choices), completion, echo, completion.finish_reason,
                                   prompt_logprobs=_prompt_logprobs(body, output)))
            num_generated += 0 if body.echo_only else len(completion.token_ids)
    usage = Usage.of(sum(len(o.prompt_token_ids) for o in outputs), num_generated)
    response = CompletionResponse(id=request_id, created=int(time.time()), model=body.model, choices=choices,
                                  usage=usage)
    return Response(response.model_dump_json(), media_type="application/json")


async def _add(state: ServerState, prompts: list, params: SamplingParams, request_id: str,
               stream: bool, lora: Any = None) -> list[RequestHandle]:
    """One engine request per prompt; if one is refused, those already queued are aborted."""
    handles: list[RequestHandle] = []
    try:
        for i, prompt in enumerate(prompts):
            engine_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            handles.append(await state.engine.add(prompt, params, engine_id, stream=stream, lora_request=lora))
    except BaseException:
        for handle in handles:
            handle.abort()
        raise
    return handles


@dataclass
class Echo:
    """The prompt a choice starts with when `echo` is set: its text, token ids and logprobs (the first None)."""

    text: str
    token_ids: list[int]
    logprobs: list | None

    @classmethod
    def of(cls, state: ServerState, body: CompletionRequest, output: RequestOutput) -> Echo:
        text = output.prompt if output.prompt is not None else state.tokenizer.decode(output.prompt_token_ids)
        return cls(text, list(output.prompt_token_ids), output.prompt_logprobs)


def _prompt_logprobs(body: CompletionRequest, output: RequestOutput) -> list | None:
    """vLLM's `prompt_logprobs` field of a choice, when the request names `prompt_logprobs`."""
    return output.prompt_logprobs if body.prompt_logprobs is not None else None


def _choice(state: ServerState, body: CompletionRequest, index: int, completion: CompletionOutput, echo: Echo | None,
            finish_reason: str | None, text: str | None = None, num_sent_tokens: int = 0,
            text_offset: int = 0, prompt_logprobs: list | None = None) -> CompletionChoice:
    """A choice holding the completion's text (or `text`, a streamed delta) and its tokens from `num_sent_tokens`
    on, after the echoed prompt if there is one."""
    text = completion.text if text is None else text
    token_ids, logprobs = completion.token_ids[num_sent_tokens:], (completion.logprobs or [])[num_sent_tokens:]
    if body.echo_only:
        text, token_ids, logprobs = "", [], []
    if echo is not None:
        text = echo.text + text
        token_ids = echo.token_ids + token_ids
        logprobs = (echo.logprobs or []) + logprobs
    choice_logprobs = None
    if body.logprobs is not None and token_ids:
        choice_logprobs = completion_logprobs(state.tokenizer, token_ids, logprobs, body.logprobs, text_offset)
    return CompletionChoice(index=index, text=text, logprobs=choice_logprobs, finish_reason=finish_reason,
                            stop_reason=completion.stop_reason if finish_reason is not None else None,
                            prompt_logprobs=prompt_logprobs_json(prompt_logprobs))


@dataclass
class ChoiceStream:
    deltas: TextDeltas
    num_sent_tokens: int = 0
    text_offset: int = 0
    finished: bool = False


async def _chunks(state: ServerState, body: CompletionRequest, params: SamplingParams, request_id: str,
                  handles: list[RequestHandle]) -> AsyncIterator[str]:
    created = int(time.time())
    streams: dict[int, ChoiceStream] = {}
    last: dict[int, RequestOutput] = {}
    async for i, output in merged(handles):
        last[i] = output
        for completion in output.outputs:
            index = i * params.n + completion.index
            first = index not in streams
            # The echoed prompt (and prompt logprobs) lead the first chunk of each choice.
            echo = Echo.of(state, body, output) if body.echo and first else None
            stream = streams.setdefault(index, ChoiceStream(TextDeltas(params.stop)))
            if stream.finished:
                continue
            done = completion.finished()
            text = stream.deltas.next(completion.text, done)
            new_tokens = len(completion.token_ids) > stream.num_sent_tokens and body.logprobs is not None
            leads = first and (body.echo or body.prompt_logprobs is not None)
            if not (text or new_tokens or done or leads):
                continue
            choice = _choice(state, body, index, completion, echo, completion.finish_reason if done else None,
                             text, stream.num_sent_tokens, stream.text_offset,
                             _prompt_logprobs(body, output) if first else None)
            stream.num_sent_tokens = len(completion.token_ids)
            if choice.logprobs is not None:
                stream.text_offset += sum(len(token) for token in choice.logprobs.tokens)
            stream.finished = done
            yield sse(CompletionResponse(id=request_id, created=created, model=body.model, choices=[choice]))
    if body.include_usage:
        outputs = [last[i] for i in sorted(last)]
        generated = 0 if body.echo_only else sum(len(c.token_ids) for o in outputs for c in o.outputs)
        usage = Usage.of(sum(len(o.prompt_token_ids) for o in outputs), generated)
        yield sse(CompletionResponse(id=request_id, created=created, model=body.model, choices=[],
                                     usage=usage))
