"""The subset of OpenAI's API that Tandem serves, as pydantic models, and its mapping onto SamplingParams.

Field names and defaults are OpenAI's; `top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`,
`ignore_eos`, `prompt_logprobs`, `allowed_token_ids`, `skip_special_tokens` and `include_stop_str_in_output`
are vLLM's extensions, under vLLM's names, as are `structured_outputs` and the older `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar` (runtime/server/structured.py). Sampling fields left unset
take the model's generation_config.json defaults, as vLLM's server does.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams
from runtime.structured_outputs import StructuredOutputsParams

# As vLLM: more top log-probabilities per token than this is refused.
MAX_LOGPROBS = 20

# OpenAI fields Tandem does not implement, with the values that mean "off"; anything else is refused.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
}


class InvalidField(ValueError):
    """A bad value in a request; `param` names its field for the error's "param"."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """The fields completions and chat completions share."""

    # NaN or infinity in a sampling value would poison the whole batch's step, not only this request.
    model_config = ConfigDict(allow_inf_nan=False)
    _structured_field: str | None = PrivateAttr(default=None)

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # what torch.Generator takes
    stop: str | list[str] | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured outputs: OpenAI's response_format, or vLLM's fields (one of them at most).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                         defaults: dict[str, Any]) -> SamplingParams:
        """SamplingParams for this request; a bad value raises ValueError naming the field. `defaults` (the
        model's generation_config.json) fill the sampling fields the request leaves unset."""
        for name, off in UNSUPPORTED.items():
            if getattr(self, name, None) not in off:
                raise InvalidField(f"{name} is not supported by this server; leave it unset", name)
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidField(f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}", name)
        from runtime.server.structured import structured_outputs

        spec, self._structured_field = structured_outputs(self)
        try:
            return self._to_sampling_params(max_tokens, logprobs, prompt_logprobs, defaults, spec)
        except ValueError as err:
            # SamplingParams' messages start with the field's name: "top_p must be in (0, 1], got 0.0".
            name = re.split(r"[ =:]", str(err), maxsplit=1)[0]
            raise InvalidField(str(err), name if name in type(self).model_fields else None) from None

    def _to_sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                            defaults: dict[str, Any],
                            structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        def pick(name: str, default: Any) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, default)

        if "max_tokens" in defaults:
            # As vLLM's server: the model's max_new_tokens caps what a request may ask for.
            max_tokens = defaults["max_tokens"] if max_tokens is None else min(max_tokens, defaults["max_tokens"])

        return SamplingParams(
            n=self.n,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", 1.0),
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop or (),
            stop_token_ids=self.stop_token_ids or (),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            structured_outputs=structured_outputs,
        )

    @property
    def structured_field(self) -> str | None:
        """The field that asked for structured output (once sampling_params() has run), for errors."""
        return self._structured_field


# Completions ----------------------------------------------------------------------------------


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default; null means "until the context is full"
    logprobs: int | None = None
    best_of: int | None = None
    echo: bool = False
    suffix: str | None = None

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the prompt (and its logprobs) back, nothing generated."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        # As vLLM: echo asks for the prompt's logprobs too, and max_tokens 0 with echo generates one
        # token that the response leaves out.
        prompt_logprobs = self.prompt_logprobs if self.prompt_logprobs is not None else \
            (self.logprobs if self.echo else None)
        max_tokens = 1 if self.echo_only else self.max_tokens
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs, defaults or {})

    def engine_prompts(self) -> list[str | dict[str, list[int]]]:
        """The prompts, each as text or as token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise InvalidField("prompt is an empty list; send at least one prompt", "prompt")
        return [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompts]


class LogprobJSON(BaseModel):
    """vLLM's Logprob, as its server writes prompt_logprobs."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt token, {token id: Logprob} (the first None), as vLLM's `prompt_logprobs` field.
PromptLogprobsJSON = list[dict[int, LogprobJSON] | None]


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    # None for the first prompt token when the prompt is echoed: nothing comes before it.
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsJSON | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, num_prompt_tokens: int, num_completion_tokens: int) -> Usage:
        return cls(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                   total_tokens=num_prompt_tokens + num_completion_tokens)

    @classmethod
    def of_output(cls, output: RequestOutput) -> Usage:
        return cls.of(len(output.prompt_token_ids), sum(len(c.token_ids) for c in output.outputs))


class CompletionResponse(BaseModel):
    """A whole completion, and also each streamed chunk of one (OpenAI uses the same shape)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# Chat completions -----------------------------------------------------------------------------


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # An assistant turn's calls, and a tool turn's answer to one of them.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def template_input(self) -> dict[str, Any]:
        if isinstance(self.content, list):
            content = "".join(part.text for part in self.content)
        else:
            content = self.content or ""
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            # As vLLM: the arguments as a dict, which is what chat templates (Qwen's, Granite's, Llama's) expect.
            message["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": _arguments(call.function.arguments)}}
                for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    # Both absent: generate until the context is full (OpenAI's behaviour).
    max_completion_tokens: int | None = None
    max_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM's extension
    tools: list[ToolDefinition] | None = None
    # None: "auto" with tools, "none" without (OpenAI's default).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True

    def sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidField("top_logprobs needs logprobs: true", "top_logprobs")
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise InvalidField(f"max_completion_tokens must be at least 1, got {self.max_completion_tokens}",
                               "max_completion_tokens")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None,
                                     self.prompt_logprobs, defaults or {})


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobsJSON | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


# Models and errors ----------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tandem"
    root: str
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
