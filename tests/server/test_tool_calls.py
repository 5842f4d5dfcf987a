"""Tool calling through the official openai client against a real `tandem serve` of the shipped model (random
text unless constrained): `required` and named tool_choice give calls whose arguments validate against the
function's schema, streamed and not; `auto` with each parser; a two-turn conversation renders the tool result
through the chat template; bad tools and choices are 400s naming the field. The parsers are checked on the
formats each model family writes."""

import json
from pathlib import Path

import jsonschema
import openai
import pytest
from server_helpers import serve
from transformers import AutoTokenizer

from runtime.llm import DEFAULT_MODEL
from runtime.server.tool_parsers import get_parser

MODEL = "shipped"
MAX_TOKENS = 400
# A Hermes/Qwen-style template: the tools in the system turn, calls as <tool_call> blocks, results as tool turns.
TEMPLATE = (
    "{% if tools %}system: you may call {% for t in tools %}{{ t.function.name }}{{ t.function.parameters | tojson }}"
    "{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}"
    "{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["C", "F"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "unit"],
    "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 5}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tools")
    (directory / "template.jinja").write_text(TEMPLATE)
    args = ("--served-model-name", MODEL, "--max-model-len", "1024", "--chat-template",
            str(directory / "template.jinja"), "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    with serve(DEFAULT_MODEL, directory / "server.log", *args) as server:
        yield server


@pytest.fixture(scope="module")
def client(served):
    return served.client()


def create(client, **fields):
    return client.chat.completions.create(**{"model": MODEL, "messages": MESSAGES, "tools": TOOLS,
                                             "temperature": 0, "max_tokens": MAX_TOKENS, **fields})


def assert_valid(call):
    assert call.type == "function" and call.id
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_function_is_called_with_valid_arguments(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        choice = create(client, tool_choice=named, temperature=1.0, seed=seed).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert_valid(call)


def closing_bias():
    """A bias towards the tokens that end a list: a random model would append calls until max_tokens."""
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    ends = [i for i in range(len(tokenizer)) if tokenizer.decode([i]).strip() in ("]", "}]", "}}]")]
    assert ends
    return {str(i): 6 for i in ends}


def test_required_gives_calls_that_validate(client):
    for seed, parallel in ((0, True), (1, True), (2, False)):
        choice = create(client, tool_choice="required", temperature=1.0, seed=seed, parallel_tool_calls=parallel,
                        logit_bias=closing_bias()).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert_valid(call)
        if not parallel:
            assert len(choice.message.tool_calls) == 1


def test_without_a_forced_choice_the_model_calls_nothing(client):
    """The tests above can fail: left alone ("none", or "auto" finding no <tool_call>) the model writes prose."""
    for choice_name in ("none", "auto"):
        choice = create(client, tool_choice=choice_name, max_tokens=40).choices[0]
        assert not choice.message.tool_calls and choice.finish_reason == "length"
        with pytest.raises(ValueError):
            json.loads(choice.message.content)


def streamed(client, **fields):
    calls, content, reasons = {}, "", []
    for chunk in create(client, stream=True, **fields):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or delta.id
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return calls, content, reasons


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_calls_validate(client, tool_choice):
    calls, content, reasons = streamed(client, tool_choice=tool_choice, temperature=1.0, seed=4,
                                       logit_bias=closing_bias())
    assert reasons == ["tool_calls"] and calls and not content
    for call in calls.values():
        assert call["id"]
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    if isinstance(tool_choice, dict):
        assert [c["name"] for c in calls.values()] == ["get_time"]


def test_streamed_auto_without_calls_is_content(client):
    calls, content, reasons = streamed(client, tool_choice="auto", max_tokens=30)
    assert not calls and reasons == ["length"]
    assert content == create(client, tool_choice="auto", max_tokens=30).choices[0].message.content


def test_a_tool_result_is_rendered_through_the_template_on_the_next_turn(client):
    call = create(client, tool_choice="required", logit_bias=closing_bias()).choices[0].message.tool_calls[0]
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny, 21 C"}'},
    ]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=8)
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    template_messages = messages[:1] + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": messages[2]["content"]}]
    text = tokenizer.apply_chat_template(template_messages, chat_template=TEMPLATE, tools=TOOLS, tokenize=False,
                                         add_generation_prompt=True)
    assert "sunny, 21 C" in text and f"[{call.id}]" in text and "<tool_call>" in text
    assert reply.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tools_are_400s_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, **fields)
    assert (caught.value.body["param"] or "").startswith(param), caught.value.body


def test_auto_needs_the_server_flags(tmp_path):
    with serve(DEFAULT_MODEL, tmp_path / "server.log", "--served-model-name", MODEL) as server:
        with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice") as caught:
            create(server.client(), tool_choice="auto")
        assert caught.value.body["param"] == "tool_choice"
        # Without tool_choice, tools default to "auto" too (OpenAI's default), so the same answer.
        with pytest.raises(openai.BadRequestError):
            create(server.client())


# The parsers, on the text each family's template makes its models write --------------------------------------

PARSED = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]),
    ("qwen3", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>', None,
     [("get_time", {"zone": "UTC"})]),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Lima", "unit": "C"}}]', None,
     [("get_weather", {"city": "Lima", "unit": "C"})]),
    ("granite", '<tool_call>{"name": "get_time", "arguments": {"zone": "PST"}}', None,
     [("get_time", {"zone": "PST"})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', None,
     [("a", {}), ("b", {"x": 1})]),
]


@pytest.mark.parametrize("name, text, content, calls", PARSED)
def test_parsers_find_the_calls(name, text, content, calls):
    extracted = get_parser(name).extract(text)
    assert extracted.content == content
    assert [(c.name, json.loads(c.arguments)) for c in extracted.calls] == calls


@pytest.mark.parametrize("name, text", [
    ("hermes", "No tools needed: it is sunny."),
    ("hermes", '<tool_call>\n{"name": "get_weather", "argu'),  # cut short by max_tokens
    ("granite", "Plain text."),
    ("llama3_json", "The answer is {not a call}."),
])
def test_text_without_a_whole_call_is_content(name, text):
    extracted = get_parser(name).extract(text)
    assert extracted.content == text and not extracted.calls


def test_streamed_content_stops_where_a_call_may_begin():
    hermes = get_parser("hermes")
    assert hermes.content_end("Sure. <tool") == len("Sure. ")
    assert hermes.content_end("Sure. <tool_call>{") == len("Sure. ")
    assert hermes.content_end("Sure.") == len("Sure.")
    llama = get_parser("llama3_json")
    assert llama.content_end(' {"name"') == 0 and llama.content_end("<|py") == 0
    assert llama.content_end("Hello") == 5


def test_an_unknown_parser_is_a_clean_cli_error():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "runtime", "serve", str(DEFAULT_MODEL), "--tool-call-parser",
                             "nope"], capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--tool-call-parser 'nope': unknown parser" in result.stderr


# What a tool-calling model writes under "auto", made certain with a regex (the shipped model would never).
AUTO_CALL = (r'Let me check\. <tool_call>\{"name": "get_time", "arguments": \{"zone": "[A-Z]{3}"\}\}</tool_call>'
             r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Oslo", "unit": "C"\}\}</tool_call>')


def test_auto_parses_the_calls_the_model_writes(client):
    choice = create(client, tool_choice="auto", extra_body={"guided_regex": AUTO_CALL}).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time", "get_weather"]
    for call in choice.message.tool_calls:
        assert_valid(call)
    calls, content, reasons = streamed(client, tool_choice="auto", extra_body={"guided_regex": AUTO_CALL})
    assert reasons == ["tool_calls"] and content.strip() == "Let me check." and "<tool_call>" not in content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
