"""The completions surface lm-eval and vLLM users reach for, through the official openai client against a
real `tandem serve`: echo (with prompt logprobs, the first null), max_tokens 0 with echo, lists of prompts,
n choices in OpenAI's order, and the OpenAI and vLLM sampling fields, each checked against HF's own
logits processed independently (tests/sampling_oracle.py)."""

import pytest
from sampling_oracle import generate, hf_logits
from server_helpers import MODEL

from runtime import SamplingParams

PROMPTS = ["The page pool holds attention", "A hybrid model mixes", "Chunked prefill processes a long prompt"]


@pytest.fixture(scope="module")
def hf(tiny_checkpoint):
    # The served checkpoint is a copy of this one, with a chat template added.
    return tiny_checkpoint("bamba")[1]


def prompt_ids(tokenizer, text):
    return tokenizer.encode(text)


def text_of(tokenizer, ids):
    """The text the server returns for `ids` (skip_special_tokens is on by default)."""
    return tokenizer.decode(ids, skip_special_tokens=True)


def assert_prompt_logprobs(hf, ids, token_logprobs, top_logprobs=None):
    """Served logprobs of an echoed prompt against HF's log-softmax: the first is null."""
    expected = hf_logits(hf, ids).log_softmax(dim=-1)
    assert token_logprobs[0] is None and (top_logprobs is None or top_logprobs[0] is None)
    for position, token in enumerate(ids[1:]):
        assert token_logprobs[position + 1] == pytest.approx(expected[position, token].item(), abs=1e-4), position


@pytest.mark.parametrize("as_ids", [True, False], ids=["token ids", "text"])
def test_echo_with_logprobs_over_a_list_of_prompts(client, tokenizer, hf, as_ids):
    """lm-eval's loglikelihood request: several prompts, max_tokens 1, logprobs 1, echo."""
    ids = [prompt_ids(tokenizer, p) for p in PROMPTS]
    response = client.completions.create(model=MODEL, prompt=ids if as_ids else PROMPTS, max_tokens=1, logprobs=1,
                                         echo=True, temperature=0, seed=1234)
    assert [c.index for c in response.choices] == [0, 1, 2]
    for choice, prompt, text in zip(response.choices, ids, PROMPTS):
        logprobs = choice.logprobs
        assert len(logprobs.token_logprobs) == len(prompt) + 1 == len(logprobs.tokens) == len(logprobs.top_logprobs)
        assert choice.text.startswith(text) and choice.text == "".join(logprobs.tokens)
        assert_prompt_logprobs(hf, prompt, logprobs.token_logprobs, logprobs.top_logprobs)
        # The generated token is the greedy one: its logprob is the largest of its step.
        assert logprobs.token_logprobs[-1] == pytest.approx(max(logprobs.top_logprobs[-1].values()), abs=1e-6)
    assert response.usage.prompt_tokens == sum(map(len, ids)) and response.usage.completion_tokens == 3


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_zero_returns_the_prompt_alone(client, tokenizer, hf, stream):
    """lm-eval's loglikelihood_rolling shape: the prompt's logprobs, nothing generated."""
    ids = [prompt_ids(tokenizer, p) for p in PROMPTS[:2]]
    request = dict(model=MODEL, prompt=ids, max_tokens=0, logprobs=0, echo=True, temperature=0)
    if stream:
        chunks = [c.choices[0] for c in client.completions.create(**request, stream=True) if c.choices]
        texts, logprobs = {}, {}
        for choice in chunks:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            logprobs.setdefault(choice.index, []).extend(choice.logprobs.token_logprobs if choice.logprobs else [])
        assert sorted(texts) == [0, 1]
        served = [(texts[i], logprobs[i]) for i in range(2)]
    else:
        served = [(c.text, c.logprobs.token_logprobs) for c in client.completions.create(**request).choices]
    for (text, token_logprobs), prompt, expected_text in zip(served, ids, PROMPTS):
        assert text == expected_text and len(token_logprobs) == len(prompt)
        assert_prompt_logprobs(hf, prompt, token_logprobs)


def test_prompt_logprobs_field_as_vllm(client, tokenizer, hf):
    choice = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": 2}).choices[0]
    ids = prompt_ids(tokenizer, PROMPTS[0])
    served = choice.model_extra["prompt_logprobs"]
    expected = hf_logits(hf, ids).log_softmax(dim=-1)
    assert served[0] is None and len(served) == len(ids)
    for position, (token, step) in enumerate(zip(ids[1:], served[1:])):
        assert str(token) in step and 2 <= len(step) <= 3
        for t, entry in step.items():
            assert entry["logprob"] == pytest.approx(expected[position, int(t)].item(), abs=1e-4)
            assert entry["rank"] == 1 + int((expected[position] > expected[position, int(t)] + 1e-6).sum())
            assert entry["decoded_token"] == tokenizer.decode([int(t)])


def collect_stream(stream):
    texts, finish = {}, {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (getattr(choice, "text", None) or
                                                                 getattr(getattr(choice, "delta", None), "content",
                                                                         None) or "")
            if choice.finish_reason is not None:
                assert choice.index not in finish, "a choice finished twice"
                finish[choice.index] = choice.finish_reason
    return texts, finish


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_per_prompt_in_openai_order(client, tokenizer, hf, stream):
    request = dict(model=MODEL, prompt=PROMPTS[:2], n=3, max_tokens=5, temperature=1.0, seed=11,
                   extra_body={"ignore_eos": True})
    if stream:
        texts, finish = collect_stream(client.completions.create(**request, stream=True))
        assert sorted(finish) == list(range(6)) and set(finish.values()) == {"length"}
    else:
        choices = client.completions.create(**request).choices
        assert [c.index for c in choices] == list(range(6))
        texts = {c.index: c.text for c in choices}
    # Choice i * n + j is prompt i's sample j, drawn with seed + j (as vLLM).
    for i, prompt in enumerate(PROMPTS[:2]):
        ids = prompt_ids(tokenizer, prompt)
        for j in range(3):
            params = SamplingParams(temperature=1.0, seed=11 + j)
            assert texts[i * 3 + j] == text_of(tokenizer, generate(hf, ids, params, 5)), (i, j)


SERVED = [
    # (OpenAI fields, vLLM extras)
    (dict(presence_penalty=1.5, frequency_penalty=0.5), {}),
    (dict(frequency_penalty=-1.5), {}),
    (dict(logit_bias={"7": 8.0, "11": -100}), {}),
    ({}, dict(repetition_penalty=1.6)),
    ({}, dict(allowed_token_ids=list(range(40, 90)))),
    (dict(presence_penalty=0.8, logit_bias={"42": 2.5}),
     dict(repetition_penalty=1.2, allowed_token_ids=list(range(20, 200)))),
]


@pytest.mark.parametrize("fields, extra", SERVED, ids=lambda o: ",".join(o) or "-")
def test_greedy_completion_under_sampling_fields_is_hfs(client, tokenizer, hf, fields, extra):
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=30, temperature=0, **fields,
                                         extra_body={"ignore_eos": True, **extra})
    params = SamplingParams(temperature=0, **fields, **extra)
    expected = generate(hf, prompt_ids(tokenizer, PROMPTS[0]), params, 30)
    assert response.choices[0].text == text_of(tokenizer, expected)
    plain = generate(hf, prompt_ids(tokenizer, PROMPTS[0]), SamplingParams(temperature=0), 30)
    assert expected != plain, "the fields changed nothing"


def test_seeded_draws_under_min_p_and_penalties_are_hfs(client, tokenizer, hf):
    extra = dict(min_p=0.08, repetition_penalty=1.3, top_k=0, ignore_eos=True)
    response = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=10, temperature=1.2, seed=5,
                                         presence_penalty=0.5, extra_body=extra)
    params = SamplingParams(temperature=1.2, seed=5, presence_penalty=0.5, min_p=0.08, repetition_penalty=1.3)
    assert response.choices[0].text == text_of(tokenizer, generate(hf, prompt_ids(tokenizer, PROMPTS[1]), params, 10))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_n_and_penalties(client, tokenizer, hf, stream):
    messages = [{"role": "user", "content": "What does the page pool hold?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    request = dict(model=MODEL, messages=messages, n=2, max_tokens=12, temperature=0, presence_penalty=1.0,
                   logit_bias={"9": 3.0}, extra_body={"ignore_eos": True, "repetition_penalty": 1.4})
    if stream:
        texts, finish = collect_stream(client.chat.completions.create(**request, stream=True))
        assert finish == {0: "length", 1: "length"}
    else:
        choices = client.chat.completions.create(**request).choices
        assert [c.index for c in choices] == [0, 1]
        texts = {c.index: c.message.content for c in choices}
    params = SamplingParams(temperature=0, presence_penalty=1.0, logit_bias={9: 3.0}, repetition_penalty=1.4)
    expected = text_of(tokenizer, generate(hf, ids, params, 12))
    assert texts == {0: expected, 1: expected}


def test_unset_fields_take_the_generation_config_defaults():
    """The mapping `tandem serve` applies with the model's generation_config.json defaults (as vLLM's server):
    they fill what a request leaves unset, and max_new_tokens caps max_tokens."""
    from runtime.server.protocol import ChatCompletionRequest, CompletionRequest

    defaults = {"temperature": 0.3, "top_k": 7, "min_p": 0.05, "repetition_penalty": 1.2, "max_tokens": 10}
    unset = CompletionRequest(model=MODEL, prompt="x").sampling_params(defaults)
    assert (unset.temperature, unset.top_k, unset.min_p, unset.repetition_penalty, unset.max_tokens) == \
        (0.3, 7, 0.05, 1.2, 10)
    given = CompletionRequest(model=MODEL, prompt="x", temperature=0.9, top_k=3, max_tokens=4,
                              repetition_penalty=1.0).sampling_params(defaults)
    assert (given.temperature, given.top_k, given.repetition_penalty, given.max_tokens, given.min_p) == \
        (0.9, 3, 1.0, 4, 0.05)
    chat = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "x"}]).sampling_params(defaults)
    assert (chat.temperature, chat.max_tokens) == (0.3, 10)
    assert CompletionRequest(model=MODEL, prompt="x").sampling_params({}).temperature == 1.0
