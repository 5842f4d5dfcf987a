"""What one request may ask of the server, resolved once from `tandem serve`'s options.

Each limit keeps one request from slowing the others: the body is read by the event loop, stop strings
are searched on the engine thread at every step, and a prompt is tokenized before its length is known.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.sampling_params import SamplingParams
from runtime.server.protocol import InvalidField

# A token of a real vocabulary spans a few characters; a prompt longer than max_model_len times this
# cannot fit, and is refused before it is tokenized.
DEFAULT_CHARS_PER_TOKEN = 16


@dataclass(frozen=True)
class ServerLimits:
    max_request_bytes: int = 8 * 2**20
    # Characters of a prompt (for chat, of all messages together), or None: max_model_len * 16.
    max_prompt_chars: int | None = None
    max_stop_strings: int = 64
    max_stop_string_chars: int = 1024
    max_chat_messages: int = 1024
    # Choices per prompt (`n`): each is a sequence of its own, and 100,000 of them stall every other stream.
    max_n: int = 128
    # Seconds a client gets to send a request's headers and body; then the connection is closed.
    request_read_timeout: float = 30.0
    # Seconds an idle keep-alive connection stays open (uvicorn's timeout_keep_alive).
    timeout_keep_alive: float = 5.0

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_stop_strings", "max_stop_string_chars", "max_chat_messages", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"--max-prompt-chars must be at least 1, got {self.max_prompt_chars}")
        for name in ("request_read_timeout", "timeout_keep_alive"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be more than 0, got {getattr(self, name)}")

    def prompt_chars(self, max_model_len: int) -> int:
        return self.max_prompt_chars if self.max_prompt_chars is not None else max_model_len * DEFAULT_CHARS_PER_TOKEN

    def check_params(self, params: SamplingParams) -> None:
        """The limits on a request's sampling parameters: its stop strings and its `n`."""
        self.check_stop(params.stop)
        if params.n > self.max_n:
            raise InvalidField(f"n: {params.n} choices, more than the server's limit of {self.max_n} (--max-n)", "n")

    def check_stop(self, stop: tuple[str, ...]) -> None:
        if len(stop) > self.max_stop_strings:
            raise InvalidField(f"stop: {len(stop)} stop strings, more than the server's limit of "
                               f"{self.max_stop_strings} (--max-stop-strings)", "stop")
        longest = max(map(len, stop), default=0)
        if longest > self.max_stop_string_chars:
            raise InvalidField(f"stop: a stop string of {longest} characters, longer than the server's limit of "
                               f"{self.max_stop_string_chars} (--max-stop-string-chars)", "stop")

    def check_prompt_chars(self, num_chars: int, max_model_len: int, param: str) -> None:
        """Refuse, in microseconds, a prompt too long to fit whatever it tokenizes to."""
        limit = self.prompt_chars(max_model_len)
        if num_chars > limit:
            raise InvalidField(f"{param}: {num_chars} characters, more than the {limit} that can fit in "
                               f"max_model_len={max_model_len} tokens (--max-prompt-chars); shorten the prompt",
                               param)

    def check_messages(self, num_messages: int) -> None:
        if num_messages > self.max_chat_messages:
            raise InvalidField(f"messages: {num_messages} messages, more than the server's limit of "
                               f"{self.max_chat_messages} (--max-chat-messages)", "messages")


def first_undecodable(value: object, path: str) -> str | None:
    """The path of the first string in `value` that is not valid Unicode (a lone surrogate from a JSON
    escape such as "\\ud800"), which no tokenizer can encode; None if there is none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = first_undecodable(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def check_text(body: dict) -> None:
    """400 naming the field whose text is not valid Unicode."""
    field = first_undecodable(body, "")
    if field is not None:
        raise InvalidField(f"{field}: the text is not valid Unicode (it holds a lone surrogate, such as \\ud800); "
                           "send UTF-8 text", field.split(".")[0])
