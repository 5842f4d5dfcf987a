"""What every handler reads: the async engine, the served name, the limits, and the tokenizers."""

from __future__ import annotations

import itertools
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
    # LoRA adapters by the name requests give as `model` (runtime/server/lora.py); touched by the event loop only.
    loras: dict = field(default_factory=dict)
    _lora_ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def next_lora_id(self) -> int:
        return next(self._lora_ids)

    def lora_for(self, name: str):
        """The LoRARequest a request's `model` names, or None for the base model."""
        return self.loras.get(name)

    def check_request(self, body: BaseModel) -> None:
        """What every generation request passes before anything else: the model's name and valid text."""
        self.check_model(body.model)
        check_text(body.model_dump())

    def check_model(self, name: str) -> None:
        if name != self.model_name and name not in self.loras:
            served = ", ".join(repr(n) for n in [self.model_name, *self.loras])
            raise APIError(404, f"the model {name!r} does not exist; this server serves {served}",
                           param="model", code="model_not_found")
