"""Structured outputs served: OpenAI's response_format (json_object, json_schema, and the openai client's
`chat.completions.parse` with a pydantic model) and vLLM's structured_outputs and guided_* fields, on chat
and completions, streamed and not, through the official openai client against a real `tandem serve` of the
shipped model, whose unconstrained text is prose: only the constraint can make the output valid."""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_helpers import serve
from structured_cases import CHOICES, GRAMMAR, GRAMMAR_REGEX, REGEXES, SCHEMAS

from runtime.llm import DEFAULT_MODEL

MODEL = "shipped"
MAX_TOKENS = 400  # room for the whitespace a random model puts between JSON tokens (20 at most each)
MESSAGES = [{"role": "user", "content": "Describe the page pool."}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    log = tmp_path_factory.mktemp("structured") / "server.log"
    with serve(DEFAULT_MODEL, log, "--served-model-name", MODEL, "--max-model-len", "1024") as server:
        yield server.client()


def chat(client, **fields):
    return client.chat.completions.create(**{"model": MODEL, "messages": MESSAGES, "temperature": 0,
                                             "max_tokens": MAX_TOKENS, **fields})


def json_schema(schema, name="out"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


class Pool(BaseModel):
    name: str = Field(max_length=6)
    pages: int = Field(ge=1, le=4096)
    hybrid: bool


def test_parse_with_a_pydantic_model_returns_a_parsed_object(client):
    completion = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Pool,
                                               temperature=0, max_tokens=MAX_TOKENS)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Pool) and message.parsed == Pool.model_validate_json(message.content)


def test_every_schema_holds_with_the_requests_sharing_batches(client):
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda s: chat(client, response_format=json_schema(s)), SCHEMAS))
    for schema, response in zip(SCHEMAS, responses):
        choice = response.choices[0]
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_without_response_format_the_reply_is_not_json(client):
    with pytest.raises(ValueError):
        json.loads(chat(client).choices[0].message.content)


def test_unconstrained_requests_keep_their_solo_text_beside_constrained_ones(client):
    solo = chat(client, max_tokens=24).choices[0].message.content
    with ThreadPoolExecutor(6) as pool:
        constrained = [pool.submit(chat, client, response_format=json_schema(s)) for s in SCHEMAS[:5]]
        free = pool.submit(chat, client, max_tokens=24)
        assert free.result().choices[0].message.content == solo
        for future in constrained:
            assert future.result().choices[0].finish_reason == "stop"


def test_json_object_on_chat_and_completions(client):
    # A bias towards closing strings and the object lets a random model's free keys end within max_tokens.
    reply = chat(client, response_format={"type": "json_object"}, temperature=0.8, seed=3,
                 extra_body={"logit_bias": json_close_bias()}).choices[0]
    assert reply.finish_reason == "stop" and isinstance(json.loads(reply.message.content), dict)
    text = client.completions.create(model=MODEL, prompt="The page pool", max_tokens=MAX_TOKENS, temperature=0.8,
                                     seed=3, logit_bias=json_close_bias(),
                                     extra_body={"response_format": {"type": "json_object"}}).choices[0]
    assert text.finish_reason == "stop" and isinstance(json.loads(text.text), dict)


def json_close_bias():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    return {str(tokenizer.convert_tokens_to_ids(t)): 8 for t in ('"', "}")}


@pytest.mark.parametrize("field, value, holds", [
    ("guided_json", SCHEMAS[6], lambda t: jsonschema.validate(json.loads(t), SCHEMAS[6]) is None),
    ("guided_regex", REGEXES[1], lambda t: re.fullmatch(REGEXES[1], t)),
    ("guided_choice", CHOICES[1], lambda t: t in CHOICES[1]),
    ("guided_grammar", GRAMMAR, lambda t: re.fullmatch(GRAMMAR_REGEX, t)),
    ("structured_outputs", {"regex": REGEXES[2]}, lambda t: re.fullmatch(REGEXES[2], t)),
    ("structured_outputs", {"choice": CHOICES[2]}, lambda t: t in CHOICES[2]),
    ("response_format", json_schema(SCHEMAS[10]), lambda t: jsonschema.validate(json.loads(t), SCHEMAS[10]) is None),
])
def test_vllm_fields_on_completions_and_chat(client, field, value, holds):
    completion = client.completions.create(model=MODEL, prompt="The page pool", max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={field: value}).choices[0]
    assert completion.finish_reason == "stop" and holds(completion.text), completion.text
    reply = chat(client, extra_body={field: value}).choices[0]
    assert reply.finish_reason == "stop" and holds(reply.message.content), reply.message.content


def test_streamed_chat_and_completions_hold_too(client):
    schema = SCHEMAS[17]
    stream = chat(client, response_format=json_schema(schema), stream=True, n=2, seed=5, temperature=1.0)
    texts, reasons = {0: "", 1: ""}, {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert reasons == {0: "stop", 1: "stop"}
    for text in texts.values():
        jsonschema.validate(json.loads(text), schema)
    stream = client.completions.create(model=MODEL, prompt="The page pool", max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, extra_body={"guided_regex": REGEXES[0]})
    assert re.fullmatch(REGEXES[0], "".join(chunk.choices[0].text for chunk in stream if chunk.choices))


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": json_schema({"type": "objec"})}, "response_format", "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"guided_regex": "a(b"}, "guided_regex", "guided_regex"),
    ({"guided_grammar": 'root ::= "a'}, "guided_grammar", "guided_grammar"),
    ({"guided_choice": []}, "guided_choice", "guided_choice"),
    ({"structured_outputs": {"json": "{bad"}}, "structured_outputs", "structured_outputs.json"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "jsn"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one structured output"),
])
def test_a_bad_constraint_is_a_400_naming_its_field(client, fields, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, extra_body=fields)
    assert caught.value.body["param"] == param and words in caught.value.body["message"]
    # The server goes on serving.
    assert chat(client, extra_body={"guided_choice": ["ok"]}).choices[0].message.content == "ok"


def test_logprobs_of_tokens_the_constraint_rules_out_are_numbers(client):
    """-inf is not JSON: as vLLM, a ruled-out token's logprob is -9999.0 (null would break OpenAI's schema)."""
    reply = chat(client, logprobs=True, top_logprobs=5, extra_body={"guided_choice": ["yes", "no"]}).choices[0]
    tops = [top.logprob for step in reply.logprobs.content for top in step.top_logprobs]
    assert all(isinstance(value, float) for value in tops) and -9999.0 in tops
    completion = client.completions.create(model=MODEL, prompt="The page pool", max_tokens=8, temperature=0,
                                           logprobs=5, extra_body={"guided_choice": ["yes", "no"]}).choices[0]
    values = [v for step in completion.logprobs.top_logprobs for v in step.values()]
    assert all(isinstance(value, float) for value in values) and -9999.0 in values


def test_a_slow_schema_does_not_hold_up_other_requests(client):
    """Its grammar compiles on a worker thread (seconds, for 5000 patterned fields: 1.6 s for 3000 on an AVX-512
    Xeon): a request sent meanwhile is served at once. Compiled on the engine thread, it would wait for the
    compilation to end."""
    import threading
    import time

    fields = {f"slow_{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 5 + 1}}}[0-9]{{2,{i % 7 + 3}}}$"}
              for i in range(5000)}
    schema = {"type": "object", "properties": fields, "required": list(fields)}
    took = {}

    def slow():
        start = time.monotonic()
        chat(client, response_format=json_schema(schema), max_tokens=1)
        took["slow"] = time.monotonic() - start

    thread = threading.Thread(target=slow)
    thread.start()
    time.sleep(0.5)  # the slow request is in, compiling
    start = time.monotonic()
    client.completions.create(model=MODEL, prompt="The page pool", max_tokens=4, temperature=0)
    took["other"] = time.monotonic() - start
    thread.join()
    assert took["slow"] > 1.0 and took["other"] < took["slow"] / 3, took
