"""What every handler reads: the async engine, the served name, and a tokenizer of the event loop's own."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from runtime.server.async_engine import AsyncEngine
from runtime.server.errors import APIError


@dataclass(frozen=True)
class ServerState:
    engine: AsyncEngine
    # Used on the event loop only (chat templates, log-probability tokens); the engine thread has its own,
    # because a tokenizer is not safe to share between threads.
    tokenizer: object
    model_name: str
    model_path: str
    max_model_len: int
    created: int = field(default_factory=lambda: int(time.time()))

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
