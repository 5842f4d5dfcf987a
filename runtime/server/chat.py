"""POST /v1/chat/completions: messages through the tokenizer's chat template, then the same engine path."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from runtime.sampling_params import SamplingParams
from runtime.server.async_engine import RequestHandle
from runtime.server.logprobs import chat_logprobs, prompt_logprobs_json
from runtime.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    Delta,
    Usage,
)
from runtime.server.state import ServerState
from runtime.server.structured import compile_grammar
from runtime.server.tools import ToolPlan, ToolStream, finish_reason, plan_tools, reply
from runtime.server.streaming import EventStream, TextDeltas, guarded, result_unless_disconnected, sse


async def render_prompt(state: ServerState, body: ChatCompletionRequest, tools: list[dict] | None = None) -> dict:
    """The prompt the chat template makes of the messages, as text and token ids (on the tokenizer's thread)."""
    if not getattr(state.tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template, so messages cannot be turned into a prompt; "
                         "use /v1/completions, or start the server with --chat-template FILE")
    state.limits.check_messages(len(body.messages))
    messages = [message.template_input() for message in body.messages]
    num_chars = sum(len(m["content"]) + len(m.get("name", "")) for m in messages)
    state.limits.check_prompt_chars(num_chars, state.max_model_len, "messages")
    return await state.tokenize.render_chat(messages, body.add_generation_prompt, tools)


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, request: Request) -> Response:
    state.check_request(body)
    plan = plan_tools(body, state.tool_call_parser, state.enable_auto_tool_choice)
    params = body.sampling_params(state.sampling_defaults)
    constrained_by = body.structured_field
    if plan.spec is not None:
        params, constrained_by = dataclasses.replace(params, structured_outputs=plan.spec), "tools"
    state.limits.check_params(params)
    await compile_grammar(state.engine.engine, params.structured_outputs, constrained_by)
    prompt = await render_prompt(state, body, plan.tools)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    handle = await state.engine.add(prompt, params, request_id, stream=body.stream,
                                    lora_request=state.lora_for(body.model))
    if body.stream:
        return EventStream(guarded(_chunks(state, body, handle, params, plan), handle))
    output = await result_unless_disconnected(request, handle)
    if output is None:
        return Response(status_code=499)  # nobody is there to read it
    choices = []
    for completion in output.outputs:
        logprobs = None
        if body.logprobs:
            logprobs = chat_logprobs(state.tokenizer, completion.token_ids, completion.logprobs,
                                     body.top_logprobs or 0)
        content, tool_calls, finish_reason = reply(plan, completion.text, completion.finish_reason)
        choices.append(ChatChoice(index=completion.index,
                                  message=AssistantMessage(content=content, tool_calls=tool_calls),
                                  logprobs=logprobs, finish_reason=finish_reason, stop_reason=completion.stop_reason))
    response = ChatCompletionResponse(id=request_id, created=int(time.time()), model=body.model,
                                      choices=choices, usage=Usage.of_output(output),
                                      prompt_logprobs=prompt_logprobs_json(output.prompt_logprobs))
    return Response(response.model_dump_json(), media_type="application/json")


async def _chunks(state: ServerState, body: ChatCompletionRequest, handle: RequestHandle,
                  params: SamplingParams, plan: ToolPlan) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[ChatStreamChoice], usage: Usage | None = None) -> str:
        return sse(ChatCompletionChunk(id=handle.request_id, created=created, model=body.model,
                                       choices=choices, usage=usage))

    # As OpenAI: the first chunk of each choice names the role, with empty content.
    for index in range(params.n):
        yield chunk([ChatStreamChoice(index=index, delta=Delta(role="assistant", content=""))])
    deltas = {index: TextDeltas(params.stop) for index in range(params.n)}
    tool_streams = {index: ToolStream(plan) for index in range(params.n)} if plan.calls_tools else None
    num_sent_tokens = dict.fromkeys(range(params.n), 0)
    finished: set[int] = set()
    async for output in handle:
        for completion in output.outputs:
            index = completion.index
            if index in finished:
                continue
            done = completion.finished()
            text = deltas[index].next(completion.text, done)
            tool_calls = None
            if tool_streams is not None:
                text, tool_calls = tool_streams[index].feed(text, done)
            logprobs = None
            if body.logprobs and len(completion.token_ids) > num_sent_tokens[index]:
                logprobs = chat_logprobs(state.tokenizer, completion.token_ids[num_sent_tokens[index]:],
                                         completion.logprobs[num_sent_tokens[index]:], body.top_logprobs or 0)
                num_sent_tokens[index] = len(completion.token_ids)
            if text or tool_calls or logprobs or done:
                delta = Delta(content=text or None, tool_calls=tool_calls or None)
                made_calls = tool_streams is not None and tool_streams[index].made_calls
                reason = finish_reason(completion.finish_reason, made_calls) if done else None
                yield chunk([ChatStreamChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=reason)])
            if done:
                finished.add(index)
        if output.finished and body.include_usage:
            yield chunk([], Usage.of_output(output))
