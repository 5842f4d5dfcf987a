"""Tool-call parsers: the function calls a model wrote in its own format, as OpenAI's `tool_calls`.

Selected as vLLM selects them (`--enable-auto-tool-choice --tool-call-parser NAME`) and used for
`tool_choice: "auto"`, where the model decides whether to call. `required` and named choices need no
parser: their output is constrained JSON (runtime/server/tools.py).

- `hermes` and `qwen3`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call
  (Hermes 2 Pro, Qwen 2.5 and Qwen3 chat templates; Granite 4.0's template writes this too).
- `granite`: `<|tool_call|>` (or `<tool_call>`) then a JSON list of {"name", "arguments"} (Granite 3.x).
- `llama3_json`: optionally `<|python_tag|>`, then JSON objects {"name", "parameters"} separated by `;`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

DECODER = json.JSONDecoder()


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI's function.arguments


@dataclass
class Extracted:
    """The text the model wrote besides its calls (None when there is none), and the calls."""

    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


def _call(value: object, arguments_key: str = "arguments") -> ParsedCall | None:
    """A call from a decoded {"name": ..., "arguments": {...}} object; None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    return ParsedCall(value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                                              ensure_ascii=False))


def _held_prefix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (held back while streaming)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    """Finds the calls in a finished text; while streaming, says how much of the text is surely content."""

    markers: tuple[str, ...] = ()

    def extract(self, text: str) -> Extracted:
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        """The length of the text's start that is content whatever follows: up to the first marker, less
        any tail that may be the start of one."""
        found = [text.find(m) for m in self.markers if m in text]
        if found:
            return min(found)
        return len(text) - max(_held_prefix(text, m) for m in self.markers)

    def _split(self, text: str) -> tuple[str | None, str | None]:
        """(content before the first marker, the rest after that marker), or (text, None) without one."""
        found = sorted((text.find(m), m) for m in self.markers if m in text)
        if not found:
            return text, None
        index, marker = found[0]
        return text[:index].strip() or None, text[index + len(marker):]


class HermesParser(ToolParser):
    markers = ("<tool_call>",)

    def extract(self, text: str) -> Extracted:
        content, rest = self._split(text)
        if rest is None:
            return Extracted(text)
        calls = []
        # Each block up to its </tool_call>; the last may be cut short by max_tokens, and is then left out.
        for block in re.split(r"<tool_call>", rest):
            body = block.split("</tool_call>")[0].strip()
            try:
                call = _call(json.loads(body))
            except ValueError:
                call = None
            if call is None:
                return Extracted(text)  # not the format after all: the whole text is content
            calls.append(call)
        return Extracted(content, calls)


class GraniteParser(ToolParser):
    markers = ("<|tool_call|>", "<tool_call>")

    def extract(self, text: str) -> Extracted:
        content, rest = self._split(text)
        if rest is None:
            return Extracted(text)
        try:
            value, _ = DECODER.raw_decode(rest.strip())
        except ValueError:
            return Extracted(text)
        values = value if isinstance(value, list) else [value]
        calls = [_call(v) for v in values]
        if not calls or None in calls:
            return Extracted(text)
        return Extracted(content, calls)


class Llama3JsonParser(ToolParser):
    markers = ("<|python_tag|>", "{")

    def content_end(self, text: str) -> int:
        # A call is the whole reply (after an optional <|python_tag|>): content is sure only once the reply
        # has begun with something else.
        tag, stripped = self.markers[0], text.lstrip()
        if not stripped or stripped.startswith(("{", tag)) or tag.startswith(stripped):
            return 0
        return len(text)

    def extract(self, text: str) -> Extracted:
        rest = text.strip()
        if rest.startswith("<|python_tag|>"):
            rest = rest[len("<|python_tag|>"):].lstrip()
        if not rest.startswith("{"):
            return Extracted(text)
        calls, position = [], 0
        while position < len(rest):
            try:
                value, end = DECODER.raw_decode(rest, position)
            except ValueError:
                return Extracted(text)
            call = _call(value, "parameters")
            if call is None:
                return Extracted(text)
            calls.append(call)
            position = end
            while position < len(rest) and rest[position] in " \n\t;":
                position += 1
        return Extracted(None, calls)


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "qwen3": HermesParser, "granite": GraniteParser, "llama3_json": Llama3JsonParser,
}


def get_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"--tool-call-parser {name!r}: unknown parser; choose one of {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()
