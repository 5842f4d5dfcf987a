"""Structured outputs offline: SamplingParams(structured_outputs=StructuredOutputsParams(...)) on the shipped
model, whose unconstrained text is prose from the docs, so only the constraint can make the output valid."""

import json
import re

import jsonschema
import pytest
from structured_cases import CHOICES, GRAMMAR, GRAMMAR_REGEX, REGEXES, SCHEMAS

from runtime import LLM, SamplingParams, StructuredOutputsParams

MAX_TOKENS = 200
PROMPTS = ["Tandem is", "The scheduler", "Every model class declares", "A page"]


@pytest.fixture(scope="module")
def llm():
    return LLM()


def constrained(max_tokens=MAX_TOKENS, **spec) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**spec))


def test_every_schema_holds_in_one_shared_batch(llm):
    outputs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(SCHEMAS))],
                           [constrained(json=schema) for schema in SCHEMAS], use_tqdm=False)
    for schema, output in zip(SCHEMAS, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)


def test_without_the_constraint_the_output_is_not_json(llm):
    """The test above can fail: the same prompts unconstrained are prose."""
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    for output in outputs:
        with pytest.raises(ValueError):
            json.loads(output.outputs[0].text)


def test_compact_json_has_no_free_whitespace(llm):
    schema = SCHEMAS[0]
    text = llm.generate(PROMPTS[0], constrained(json=schema, disable_any_whitespace=True),
                        use_tqdm=False)[0].outputs[0].text
    jsonschema.validate(json.loads(text), schema)
    assert text == json.dumps(json.loads(text), ensure_ascii=False)  # one space after "," and ":", no more


def test_a_pydantic_model_and_a_json_string_are_schemas_too(llm):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=6)
        population: int = Field(ge=0, le=10**6)

    for spec in (City, json.dumps(City.model_json_schema())):
        text = llm.generate(PROMPTS[1], constrained(json=spec), use_tqdm=False)[0].outputs[0].text
        City.model_validate_json(text)


def test_regexes_choices_and_grammars(llm):
    cases = ([(constrained(regex=r), lambda t, r=r: re.fullmatch(r, t)) for r in REGEXES]
             + [(constrained(choice=c), lambda t, c=c: t in c) for c in CHOICES]
             + [(constrained(grammar=GRAMMAR), lambda t: re.fullmatch(GRAMMAR_REGEX, t))])
    outputs = llm.generate([PROMPTS[i % 4] for i in range(len(cases))], [p for p, _ in cases], use_tqdm=False)
    for (params, holds), output in zip(cases, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop" and holds(completion.text), (params.structured_outputs,
                                                                              completion.text)


def test_json_object_is_an_object(llm):
    # Free keys and values are strings the model would write until max_tokens: a bias towards closing them
    # (and the object) lets the output end; only the grammar makes it an object.
    tokenizer = llm.get_tokenizer()
    bias = {tokenizer.convert_tokens_to_ids(t): 8.0 for t in ('"', "}")}
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=MAX_TOKENS, n=4, logit_bias=bias,
                            structured_outputs=StructuredOutputsParams(json_object=True))
    for completion in llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs:
        assert completion.finish_reason == "stop" and isinstance(json.loads(completion.text), dict), completion.text
    free = llm.generate(PROMPTS[0], SamplingParams(temperature=0.8, seed=3, max_tokens=MAX_TOKENS, n=4,
                                                   logit_bias=bias), use_tqdm=False)[0].outputs
    assert not any(c.text.lstrip().startswith("{") for c in free)


def test_sampling_with_n_each_sample_is_valid_and_they_differ(llm):
    schema = SCHEMAS[0]
    params = SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=MAX_TOKENS,
                            structured_outputs=StructuredOutputsParams(json=schema))
    completions = llm.generate(PROMPTS[2], params, use_tqdm=False)[0].outputs
    for completion in completions:
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), schema)
    assert len({c.text for c in completions}) > 1


def test_unconstrained_requests_keep_their_solo_tokens(llm):
    free = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True)]
    solo = [llm.generate(PROMPTS[i], p, use_tqdm=False)[0].outputs[0].token_ids for i, p in enumerate(free)]
    mixed = llm.generate([PROMPTS[0], PROMPTS[3], PROMPTS[1], PROMPTS[2]],
                         [free[0], constrained(json=SCHEMAS[6]), free[1], constrained(regex=REGEXES[0])],
                         use_tqdm=False)
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == solo
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMAS[6])


def test_a_finished_grammar_ends_the_request_even_with_ignore_eos(llm):
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    completion = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.text in ("yes", "no")


def test_streaming_and_chat(llm):
    params = constrained(json=SCHEMAS[1])
    final = [out for _, out in llm.stream(PROMPTS[0], params) if out.finished][0]
    assert final.outputs[0].text == llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].text
    chat = llm.chat([{"role": "user", "content": "Is it ok?"}], params, use_tqdm=False)[0].outputs[0]
    jsonschema.validate(json.loads(chat.text), SCHEMAS[1])


def test_prefix_caching_and_eager_steps_give_the_same_constrained_tokens(llm):
    params = [constrained(json=s) for s in SCHEMAS[:3]]
    prompts = [PROMPTS[3] * 20] * 3  # a long shared prompt, for cached blocks
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for options in ({"enable_prefix_caching": True}, {"enforce_eager": True}):
        other = LLM(**options)
        for _ in range(2):  # with prefix caching the second round starts from cached blocks
            got = [o.outputs[0].token_ids for o in other.generate(prompts, params, use_tqdm=False)]
            assert got == expected, options


def test_grammars_are_compiled_once_per_spec(llm):
    grammars = llm.engine.grammars
    first = grammars.compile(StructuredOutputsParams(json=dict(SCHEMAS[0])))
    # The same schema with its keys in another order is the same spec.
    reordered = dict(reversed(list(SCHEMAS[0].items())))
    assert grammars.compile(StructuredOutputsParams(json=reordered)) is first


@pytest.mark.parametrize("spec, field", [
    ({"json": {"type": "objec"}}, "structured_outputs.json"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"regex": "a(b"}, "structured_outputs.regex"),
    ({"grammar": 'root ::= "a'}, "structured_outputs.grammar"),
    ({"grammar": 'start ::= "a"'}, "structured_outputs.grammar"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": "yes"}, "structured_outputs.choice"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ({}, "exactly one of"),
])
def test_a_bad_constraint_is_a_value_error_naming_its_field(llm, spec, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(PROMPTS[0], SamplingParams(structured_outputs=StructuredOutputsParams(**spec)), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_structured_outputs_must_be_the_params_class():
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})


def test_a_complete_output_ends_even_before_min_tokens(llm):
    """Only EOS may follow "yes"; min_tokens would ban it and leave no token at all. The request ends with
    its valid output (finish_reason stop), and the request beside it keeps its solo tokens."""
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    solo = llm.generate(PROMPTS[1], free, use_tqdm=False)[0].outputs[0].token_ids
    short = SamplingParams(temperature=0, max_tokens=20, min_tokens=8,
                           structured_outputs=StructuredOutputsParams(choice=["yes"]))
    outputs = llm.generate([PROMPTS[0], PROMPTS[1]], [short, free], use_tqdm=False)
    assert (outputs[0].outputs[0].text, outputs[0].outputs[0].finish_reason) == ("yes", "stop")
    assert outputs[1].outputs[0].token_ids == solo
    # A grammar that may go on keeps min_tokens: "a" then EOS is complete, but more "a"s are allowed.
    longer = SamplingParams(temperature=0, max_tokens=20, min_tokens=6,
                            structured_outputs=StructuredOutputsParams(regex="a+"))
    assert len(llm.generate(PROMPTS[0], longer, use_tqdm=False)[0].outputs[0].token_ids) >= 6


def test_chat_shows_the_tools_to_the_template_and_a_schema_constrains_the_arguments(llm):
    template = ("{% for t in tools or [] %}tool {{ t.function.name }}\n{% endfor %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    parameters = SCHEMAS[6]
    tools = [{"type": "function", "function": {"name": "move", "parameters": parameters}}]
    messages = [{"role": "user", "content": "Move the point."}]
    params = constrained(json=parameters)
    output = llm.chat(messages, params, chat_template=template, tools=tools, use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(messages, chat_template=template, tools=tools, tokenize=False)
    assert output.prompt == expected and expected.startswith("tool move\n")
    jsonschema.validate(json.loads(output.outputs[0].text), parameters)


def test_preempted_constrained_requests_resume_where_their_grammar_was(llm):
    """A preempted sequence is recomputed from its tokens; its matcher keeps its place, so the output goes on
    as if nothing happened."""
    params = [constrained(json=s, max_tokens=120) for s in SCHEMAS[:6]]
    prompts = ["Tandem is " * 8] * 6
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    # The shipped model's pages: 80-token attention blocks and two state pages a sequence. Six pages run two
    # sequences at once, and one crossing its 80th token takes a block the other must give up.
    small = LLM(max_model_len=160, num_pages=6)
    outputs = small.generate(prompts, params, use_tqdm=False)
    assert sum(o.num_preemptions for o in outputs) > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.parametrize("name", ["bamba", "llama"])
def test_tiny_random_checkpoints_are_held_to_the_schema(tiny_checkpoint, name):
    """On random weights (noise unconstrained, as the next assertion shows) the schemas, a choice and a regex
    still hold: only the grammar makes them so."""
    directory, _ = tiny_checkpoint(name)
    random_llm = LLM(str(directory))
    prompts = [{"prompt_token_ids": [5 + i, 9, 13]} for i in range(4)]
    noise = random_llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    for output in noise:
        with pytest.raises(ValueError):
            json.loads(output.outputs[0].text)
    schemas = SCHEMAS[:4]
    specs = [dict(json=schema) for schema in schemas] + [dict(choice=CHOICES[1]), dict(regex=REGEXES[0])]
    outputs = random_llm.generate([prompts[i % len(prompts)] for i in range(len(specs))],
                                  [constrained(**spec) for spec in specs], use_tqdm=False)
    for schema, output in zip(schemas, outputs):
        assert output.outputs[0].finish_reason == "stop", (schema, output.outputs[0].text)
        # strict=False: xgrammar's JSON grammar lets a string hold raw control characters (U+0000-U+001F but
        # newlines), which random weights pick; docs/features/structured_outputs.md says so.
        jsonschema.validate(json.loads(output.outputs[0].text, strict=False), schema)
    assert outputs[len(schemas)].outputs[0].text in CHOICES[1]
    assert re.fullmatch(REGEXES[0], outputs[len(schemas) + 1].outputs[0].text)
