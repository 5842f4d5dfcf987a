"""Tool calling on /v1/chat/completions: `tools`, `tool_choice` and `parallel_tool_calls`, as OpenAI and vLLM.

- `none`: the model answers in text (the tools still reach the chat template, as vLLM).
- `auto` (the default with tools): the model decides; the server's tool-call parser (`--enable-auto-tool-choice
  --tool-call-parser NAME`, runtime/server/tool_parsers.py) finds the calls in its text.
- `required`: the output is constrained to a JSON list of calls [{"name": ..., "parameters": {...}}], each one's
  parameters by its function's JSON schema (one call at most with `parallel_tool_calls: false`).
- a named function: the output is constrained to that function's parameters, which are its arguments.

The constrained arguments always parse (unless max_tokens cuts them), and are compact JSON. A reply that calls tools has
`tool_calls` and finish_reason "tool_calls".
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from runtime.server.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    InvalidField,
    NamedToolChoice,
    ToolCall,
)
from runtime.server.tool_parsers import ParsedCall, ToolParser, get_parser
from runtime.structured_outputs import StructuredOutputsParams

ANY_OBJECT = {"type": "object"}


@dataclass
class ToolPlan:
    """What a request's tools mean for its prompt, its constraint and its reply."""

    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict] | None = None  # for the chat template
    name: str | None = None  # the named function
    parser: ToolParser | None = None
    spec: StructuredOutputsParams | None = None

    @property
    def calls_tools(self) -> bool:
        return self.mode != "none"


def plan_tools(body: ChatCompletionRequest, parser_name: str | None, enable_auto: bool) -> ToolPlan:
    """The request's ToolPlan; a tool_choice the request or the server cannot honour is a 400 naming the field."""
    tools = body.tools or []
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if not tools:
        if choice != "none":
            raise InvalidField("tool_choice needs tools: send `tools`, or leave tool_choice unset", "tool_choice")
        return ToolPlan("none")
    template_tools = [tool.model_dump(exclude_none=True) for tool in tools]
    functions = {tool.function.name: tool.function for tool in tools}
    if choice == "none":
        return ToolPlan("none", template_tools)
    if choice == "auto":
        if not (enable_auto and parser_name):
            raise InvalidField('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                               'set on the server; send tool_choice "required", a named function or "none"',
                               "tool_choice")
        return ToolPlan("auto", template_tools, parser=get_parser(parser_name))
    if _structured(body):
        raise InvalidField(f"{_structured(body)}: a tool_choice that forces a call constrains the output itself; "
                           "send one or the other", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in functions:
            raise InvalidField(f"tool_choice names the function {name!r}, which is not among the tools "
                               f"({', '.join(functions)})", "tool_choice")
        schema = functions[name].parameters or ANY_OBJECT
        return ToolPlan("named", template_tools, name=name, spec=_spec(schema))
    return ToolPlan("required", template_tools, spec=_spec(required_schema(functions, body.parallel_tool_calls)))


def _structured(body: ChatCompletionRequest) -> str | None:
    for name in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar"):
        value = getattr(body, name)
        if value is not None and value != {"type": "text"}:
            return name
    return None


def _spec(schema: dict) -> StructuredOutputsParams:
    # Compact JSON: arguments are read by programs, and free whitespace is tokens a model may loop in.
    try:
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    except ValueError as err:
        raise InvalidField(str(err).replace("structured_outputs.json", "tools.function.parameters"), "tools") from None


def required_schema(functions: dict, parallel: bool | None) -> dict:
    """vLLM's schema for tool_choice "required": a list of calls, each of a named function with its parameters."""
    calls = [{"type": "object", "properties": {"name": {"const": name},
                                               "parameters": function.parameters or ANY_OBJECT},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, function in functions.items()]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if parallel is False:
        schema["maxItems"] = 1
    return schema


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _parse_required(text: str) -> list[ParsedCall] | None:
    try:
        values = json.loads(text)
    except ValueError:
        return None  # cut short by max_tokens
    return [ParsedCall(v["name"], json.dumps(v["parameters"], ensure_ascii=False)) for v in values]


def _calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a finished text."""
    if plan.mode == "named":
        return None, [ParsedCall(plan.name, text)]
    if plan.mode == "required":
        calls = _parse_required(text)
        return (None, calls) if calls else (text, [])
    if plan.mode == "auto":
        extracted = plan.parser.extract(text)
        return (extracted.content, extracted.calls) if extracted.calls else (text, [])
    return text, []


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    return "tool_calls" if made_calls and reason == "stop" else reason


def reply(plan: ToolPlan, text: str, reason: str | None) -> tuple[str | None, list[ToolCall], str | None]:
    """A finished choice's content, tool_calls and finish_reason."""
    content, calls = _calls(plan, text)
    tool_calls = [ToolCall(id=call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
    return content, tool_calls, finish_reason(reason, bool(tool_calls))


@dataclass
class ToolStream:
    """One streamed choice: its text deltas in, content deltas and OpenAI's tool_call deltas out.

    A named function's arguments stream as they come; `required` calls come whole at the end (the list
    parses only then); with `auto`, content streams until the parser's marker may have begun, and the
    calls come at the end.
    """

    plan: ToolPlan
    text: str = ""
    num_sent: int = 0  # content characters sent
    made_calls: bool = False
    _id: str = field(default_factory=call_id)

    def feed(self, delta: str, done: bool) -> tuple[str | None, list[DeltaToolCall]]:
        self.text += delta
        if self.plan.mode == "named":
            return None, self._named(delta)
        if self.plan.mode == "auto" and not done:
            end = max(self.num_sent, self.plan.parser.content_end(self.text))
            content, self.num_sent = self.text[self.num_sent:end], end
            return content or None, []
        if not done:
            return None, []  # required: nothing until the list is whole
        content, calls = _calls(self.plan, self.text)
        self.made_calls = bool(calls)
        rest = (content or "")[self.num_sent:] if calls else self.text[self.num_sent:]
        deltas = [DeltaToolCall(index=i, id=call_id(), type="function",
                                function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
                  for i, c in enumerate(calls)]
        return rest or None, deltas

    def _named(self, delta: str) -> list[DeltaToolCall]:
        if not self.made_calls:
            self.made_calls = True
            return [DeltaToolCall(index=0, id=self._id, type="function",
                                  function=DeltaFunctionCall(name=self.plan.name, arguments=delta))]
        return [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta))] if delta else []
