"""The subset of OpenAI's API that Tandem serves, as pydantic models, and its mapping onto SamplingParams.

Field names and defaults are OpenAI's; `top_k`, `min_tokens`, `stop_token_ids`, `ignore_eos`,
`skip_special_tokens` and `include_stop_str_in_output` are vLLM's extensions, under vLLM's names.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams

# As vLLM: more top log-probabilities per token than this is refused.
MAX_LOGPROBS = 20

# OpenAI fields Tandem does not implement, with the values that mean "off"; anything else is refused.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "tools": (None, []),
    "response_format": (None, {"type": "text"}),
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

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # what torch.Generator takes
    stop: str | list[str] | None = None
    user: str | None = None
    # vLLM's extensions.
    top_k: int | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Accepted only at their "off" values (UNSUPPORTED).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """SamplingParams for this request; a bad value raises ValueError naming the field."""
        for name, off in UNSUPPORTED.items():
            if getattr(self, name, None) not in off:
                raise InvalidField(f"{name} is not supported by this server; leave it unset", name)
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise InvalidField(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}", "logprobs")
        try:
            return self._to_sampling_params(max_tokens, logprobs)
        except ValueError as err:
            # SamplingParams' messages start with the field's name: "top_p must be in (0, 1], got 0.0".
            name = re.split(r"[ =]", str(err), maxsplit=1)[0]
            raise InvalidField(str(err), name if name in type(self).model_fields else None) from None

    def _to_sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop or (),
            stop_token_ids=self.stop_token_ids or (),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


# Completions ----------------------------------------------------------------------------------


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default; null means "until the context is full"
    logprobs: int | None = None
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None

    def sampling_params(self) -> SamplingParams:
        return self._sampling_params(self.max_tokens, self.logprobs)

    def engine_prompt(self) -> str | dict[str, list[int]]:
        """The one prompt, as text or as token ids; a batch of prompts is refused."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidField(f"prompt holds {len(prompt)} prompts; send one request per prompt", "prompt")
            prompt = prompt[0]
        return prompt if isinstance(prompt, str) else {"prompt_token_ids": list(prompt)}


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


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
        return cls.of(len(output.prompt_token_ids), len(output.outputs[0].token_ids))


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


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def template_input(self) -> dict[str, str]:
        if isinstance(self.content, list):
            content = "".join(part.text for part in self.content)
        else:
            content = self.content or ""
        message = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    # Both absent: generate until the context is full (OpenAI's behaviour).
    max_completion_tokens: int | None = None
    max_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM's extension
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidField("top_logprobs needs logprobs: true", "top_logprobs")
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise InvalidField(f"max_completion_tokens must be at least 1, got {self.max_completion_tokens}",
                               "max_completion_tokens")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


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
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


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
