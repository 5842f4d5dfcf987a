"""What every handler reads: the async engine, the served name, the limits, and the tokenizers."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from pydantic import BaseModel

from runtime.server.async_engine import AsyncEngine
from runtime.server.errors import APIError
from runtime.server.limits import ServerLimits, check_text
from runtime.server.tokenize import TokenizerWorker


@dataclass(frozen=True)
class ServerState:
    engine: AsyncEngine
    # Used on the event loop only, for single tokens (log-probabilities); prompts and chat templates go
    # to `tokenize`, a worker thread with a tokenizer of its own (a tokenizer is not safe to share).
    tokenizer: object
    tokenize: TokenizerWorker
    model_name: str
    max_model_len: int
    limits: ServerLimits = ServerLimits()
    api_key: str | None = None
    # The model's generation_config.json sampling defaults, for the fields a request leaves unset (as vLLM).
    sampling_defaults: dict = field(default_factory=dict)
    # Tool calling: `tool_choice: "auto"` needs both (vLLM's --enable-auto-tool-choice --tool-call-parser).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    # Responses by (method, route, status code), for /metrics; touched by the event loop only.
    http_responses: Counter = field(default_factory=Counter)

    def check_request(self, body: BaseModel) -> None:
        """What every generation request passes before anything else: the model's name and valid text."""
        self.check_model(body.model)
        check_text(body.model_dump())

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
