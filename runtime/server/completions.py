"""POST /v1/completions: one prompt, as text or token ids; the whole completion or a stream of chunks."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from runtime.server.async_engine import RequestHandle
from runtime.server.logprobs import completion_logprobs
from runtime.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage
from runtime.server.state import ServerState
from runtime.server.streaming import EventStream, TextDeltas, guarded, result_unless_disconnected, sse


async def create_completion(state: ServerState, body: CompletionRequest, request: Request) -> Response:
    state.check_request(body)
    params = body.sampling_params()
    state.limits.check_stop(params.stop)
    prompt = body.engine_prompt()
    if isinstance(prompt, str):
        state.limits.check_prompt_chars(len(prompt), state.max_model_len, "prompt")
        prompt = await state.tokenize.encode(prompt)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    handle = await state.engine.add(prompt, params, request_id, stream=body.stream)
    if body.stream:
        return EventStream(guarded(_chunks(state, body, handle, TextDeltas(params.stop)), handle))
    output = await result_unless_disconnected(request, handle)
    if output is None:
        return Response(status_code=499)  # nobody is there to read it
    completion = output.outputs[0]
    logprobs = None
    if body.logprobs is not None:
        logprobs = completion_logprobs(state.tokenizer, completion.token_ids, completion.logprobs, body.logprobs)
    choice = CompletionChoice(text=completion.text, logprobs=logprobs, finish_reason=completion.finish_reason)
    response = CompletionResponse(id=request_id, created=int(time.time()), model=state.model_name, choices=[choice],
                                  usage=Usage.of_output(output))
    return Response(response.model_dump_json(), media_type="application/json")


async def _chunks(state: ServerState, body: CompletionRequest, handle: RequestHandle,
                  deltas: TextDeltas) -> AsyncIterator[str]:
    created = int(time.time())
    num_sent_tokens, text_offset = 0, 0
    async for output in handle:
        completion = output.outputs[0]
        text = deltas.next(completion.text, output.finished)
        logprobs = None
        if body.logprobs is not None and len(completion.token_ids) > num_sent_tokens:
            logprobs = completion_logprobs(state.tokenizer, completion.token_ids[num_sent_tokens:],
                                           completion.logprobs[num_sent_tokens:], body.logprobs, text_offset)
            num_sent_tokens = len(completion.token_ids)
            text_offset += sum(len(token) for token in logprobs.tokens)
        if text or logprobs or output.finished:
            choice = CompletionChoice(text=text, logprobs=logprobs, finish_reason=completion.finish_reason)
            yield sse(CompletionResponse(id=handle.request_id, created=created, model=state.model_name,
                                         choices=[choice]))
        if output.finished and body.include_usage:
            yield sse(CompletionResponse(id=handle.request_id, created=created, model=state.model_name, choices=[],
                                         usage=Usage.of_output(output)))
