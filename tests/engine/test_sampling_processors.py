"""vLLM's sampling parameters (penalties, min_p, logit_bias, allowed_token_ids, n, prompt logprobs),
checked against an independent computation from HF's own logits (tests/sampling_oracle.py)."""

import json
import shutil

import pytest
import torch
from sampling_oracle import generate, hf_logits, oracle_logits, oracle_probs, steps

from runtime import LLM, Logprob, SamplingParams

PROMPT = "The page pool holds attention"
NEW_TOKENS = 10
# The tiny model's greedy text first repeats a token after about 20: penalties on the output need that long.
GREEDY_TOKENS = 30


@pytest.fixture(scope="module")
def bamba(tiny_checkpoint):
    return tiny_checkpoint("bamba")


@pytest.fixture(scope="module")
def llm(bamba):
    return LLM(bamba[0], dtype="float32")


NEIGHBOUR = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def run(llm, **options):
    """The request with `options`, batched with a plain greedy neighbour, which must get its own tokens."""
    params = SamplingParams(**{"max_tokens": NEW_TOKENS, "ignore_eos": True, **options})
    output, neighbour = llm.generate([PROMPT, "A hybrid model"], [params, NEIGHBOUR], use_tqdm=False)
    alone = llm.generate(["A hybrid model"], NEIGHBOUR, use_tqdm=False)[0]
    assert neighbour.outputs[0].token_ids == alone.outputs[0].token_ids, "a request's parameters leaked to another"
    return params, output


GREEDY = [
    dict(repetition_penalty=1.6),
    dict(repetition_penalty=0.7),
    dict(frequency_penalty=1.5),
    dict(presence_penalty=2.0, frequency_penalty=-0.5),
    dict(presence_penalty=-2.0),
    dict(logit_bias={7: 6.0, 11: 100.0, 13: -100.0}),
    dict(allowed_token_ids=list(range(40, 70))),
    dict(repetition_penalty=1.3, presence_penalty=0.5, logit_bias={"42": 3.5}, allowed_token_ids=list(range(30, 90))),
]


# The output holds token 5 three times and token 7 once; token 1 and a fourth 5 are in the prompt only.
HISTORY = ([1, 5], [5, 5, 7, 5])
# (options, hand-computed change to each logit): presence is taken once per distinct output token,
# frequency once per occurrence in the output; the prompt counts for neither.
PENALTIES = [
    (dict(presence_penalty=0.5), {5: -0.5, 7: -0.5}),
    (dict(frequency_penalty=0.5), {5: -1.5, 7: -0.5}),
    (dict(presence_penalty=0.5, frequency_penalty=0.25), {5: -1.25, 7: -0.75}),
    (dict(presence_penalty=-1.0, frequency_penalty=2.0), {5: -5.0, 7: -1.0}),
    (dict(presence_penalty=2.0, frequency_penalty=-0.5), {5: -0.5, 7: -1.5}),
    ({}, {}),
]


def test_presence_and_frequency_penalties_against_hand_computed_logits():
    from runtime import logits_processors

    logits = torch.zeros(len(PENALTIES), 8)
    params = [SamplingParams(**options) for options, _ in PENALTIES]
    # One batch: each row must get its own penalties.
    logits_processors.process(logits, params, [[]] * len(params), [HISTORY] * len(params))
    for row, (options, change) in enumerate(PENALTIES):
        expected = torch.zeros(8)
        for token, value in change.items():
            expected[token] = value
        assert logits[row].tolist() == expected.tolist(), options


def test_presence_and_frequency_penalties_pick_different_greedy_tokens():
    from runtime.sampler import Sampler

    # Token 5 (3 times in the output) leads token 3 (never seen) by 1.1: a presence penalty of 1 keeps
    # it first, a frequency penalty of 1 takes 3 from it.
    logits = torch.zeros(2, 8)
    logits[:, [5, 3, 7]] = torch.tensor([2.0, 0.9, 1.2])
    params = [SamplingParams(temperature=0, presence_penalty=1.0), SamplingParams(temperature=0, frequency_penalty=1.0)]
    out = Sampler()(logits, params, [None, None], [[], []], [HISTORY, HISTORY])
    assert out.token_ids == [5, 3]


@pytest.mark.parametrize("options", GREEDY, ids=lambda o: ",".join(o))
def test_greedy_tokens_are_the_argmax_of_processed_hf_logits(llm, bamba, options):
    params, output = run(llm, temperature=0, max_tokens=GREEDY_TOKENS, **options)
    prompt, tokens = output.prompt_token_ids, output.outputs[0].token_ids
    free = run(llm, temperature=0, max_tokens=GREEDY_TOKENS)[1].outputs[0].token_ids
    assert tokens != free, "the parameters changed nothing"
    for step, logits in enumerate(steps(bamba[1], prompt, tokens)):
        processed = oracle_logits(logits, prompt, tokens[:step], params)
        top2 = processed.topk(2).values
        assert tokens[step] == processed.argmax().item() or top2[0] - top2[1] < 1e-4, step
    if params.allowed_token_ids is not None:
        assert set(tokens) <= set(params.allowed_token_ids)


SAMPLED = [
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=1.4, min_p=0.05, repetition_penalty=1.2, frequency_penalty=0.4, logit_bias={9: 2.0}),
    dict(temperature=0.8, presence_penalty=1.0, allowed_token_ids=list(range(20, 120))),
]


@pytest.mark.parametrize("options", SAMPLED, ids=lambda o: ",".join(o))
def test_seeded_draws_come_from_processed_hf_probabilities(llm, bamba, options):
    params, output = run(llm, seed=99, **options)
    prompt, tokens = output.prompt_token_ids, output.outputs[0].token_ids
    generator = torch.Generator().manual_seed(99)
    for step, logits in enumerate(steps(bamba[1], prompt, tokens)):
        probs = oracle_probs(oracle_logits(logits, prompt, tokens[:step], params), params)
        assert probs[tokens[step]] > 0, f"step {step}: a token the parameters rule out was drawn"
        assert torch.multinomial(probs.float(), 1, generator=generator).item() == tokens[step], step


def test_min_p_keeps_only_tokens_near_the_best(llm, bamba):
    params = SamplingParams(temperature=1.5, min_p=0.3, max_tokens=1)
    draws = [o.outputs[0].token_ids[0] for o in llm.generate([PROMPT] * 200, params, use_tqdm=False)]
    prompt = llm.get_tokenizer().encode(PROMPT)
    probs = torch.softmax(hf_logits(bamba[1], prompt)[-1] / 1.5, dim=-1)
    support = set((probs >= 0.3 * probs.max()).nonzero().flatten().tolist())
    assert set(draws) <= support and len(support) < 20
    assert len(set(draws)) > 1 or len(support) == 1


def test_logprobs_are_logprob_objects_with_rank_and_text(llm, bamba):
    params, output = run(llm, temperature=1.0, seed=3, logprobs=3)
    completion, tokenizer = output.outputs[0], llm.get_tokenizer()
    prompt = output.prompt_token_ids
    raw = steps(bamba[1], prompt, completion.token_ids).log_softmax(dim=-1)
    for step, (token, top) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert list(top)[0] == token and all(isinstance(lp, Logprob) for lp in top.values())
        for t, lp in top.items():
            assert abs(lp.logprob - raw[step, t].item()) < 1e-4
            assert lp.rank == 1 + int((raw[step] > raw[step, t] + 1e-6).sum())
            assert lp.decoded_token == tokenizer.decode([t])
        assert sorted(lp.rank for t, lp in top.items() if t != token or lp.rank <= 3)[:3] == [1, 2, 3]


@pytest.mark.parametrize("chunk", [None, 8], ids=["whole", "chunked"])
def test_prompt_logprobs_are_hf_log_softmax_over_the_prompt(bamba, chunk):
    options = dict(max_num_batched_tokens=chunk) if chunk else {}
    llm = LLM(bamba[0], dtype="float32", max_model_len=256, **options)
    text = "The scheduler batches prefills and decodes, and preempts when pages run out."
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    # A request without prompt logprobs in the same steps must not get any.
    with_logprobs, without = llm.generate([text, PROMPT], [params, SamplingParams(max_tokens=2)], use_tqdm=False)
    assert without.prompt_logprobs is None
    prompt = with_logprobs.prompt_token_ids
    assert chunk is None or len(prompt) > 2 * chunk
    expected = hf_logits(bamba[1], prompt).log_softmax(dim=-1)
    got = with_logprobs.prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None
    for position, (token, top) in enumerate(zip(prompt[1:], got[1:])):
        row = expected[position]
        assert token in top and 2 <= len(top) <= 3
        assert set(row.topk(2).indices.tolist()) <= set(top)
        for t, lp in top.items():
            assert abs(lp.logprob - row[t].item()) < 1e-4, (position, t)
            assert lp.rank == 1 + int((row > row[t] + 1e-6).sum())


def test_prompt_logprobs_ignore_the_prefix_cache(bamba):
    llm = LLM(bamba[0], dtype="float32", enable_prefix_caching=True)
    # Two prefix blocks and a bit: a prompt shorter than a block has nothing to find in the cache.
    prompt = {"prompt_token_ids": [(7 * i) % 300 + 3 for i in range(2 * llm.engine.cache.prefix.block_size + 3)]}
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    again = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and len(again.prompt_logprobs) == len(prompt["prompt_token_ids"])
    assert all(len(top) == 1 for top in again.prompt_logprobs[1:])
    hit = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert hit.num_cached_tokens > 0


def test_n_samples_are_the_seeded_requests_seed_plus_index(llm, bamba):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, logprobs=1)
    output = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert [c.index for c in output.outputs] == [0, 1, 2] and output.finished
    # Sample i is HF's draw with seed + i (as vLLM seeds its child requests).
    for i, completion in enumerate(output.outputs):
        assert completion.token_ids == generate(bamba[1], output.prompt_token_ids,
                                                SamplingParams(temperature=1.0, seed=7 + i), 6), i
    singles = llm.generate([PROMPT] * 3, [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=6, ignore_eos=True)
                                          for i in range(3)], use_tqdm=False)
    assert [c.token_ids for c in output.outputs] == [s.outputs[0].token_ids for s in singles]
    assert len({tuple(c.token_ids) for c in output.outputs}) == 3
    assert all(len(c.logprobs) == 6 for c in output.outputs)


def test_n_with_greedy_streams_and_prefix_caching(bamba):
    llm = LLM(bamba[0], dtype="float32", enable_prefix_caching=True)
    params = SamplingParams(n=2, temperature=0, max_tokens=5, ignore_eos=True)
    outputs = llm.generate([PROMPT, "A hybrid model"], params, use_tqdm=False)
    for output in outputs:
        assert [c.index for c in output.outputs] == [0, 1]
        assert output.outputs[0].token_ids == output.outputs[1].token_ids
    last = {}
    for index, output in llm.stream([PROMPT], params):
        last[index] = output
    assert last[0].finished and [c.token_ids for c in last[0].outputs] == [c.token_ids for c in outputs[0].outputs]
    assert llm.engine.stats().num_running == 0 and not llm.engine._parents


def test_generation_config_defaults_apply_when_no_params_are_given(bamba, tmp_path):
    directory = tmp_path / "model"
    shutil.copytree(bamba[0], directory)
    path = directory / "generation_config.json"
    # top_k 50 and top_p 1.0 are transformers' own defaults: vLLM (through to_diff_dict) ignores them.
    path.write_text(json.dumps({**json.loads(path.read_text()), "temperature": 0.0, "repetition_penalty": 1.5,
                                "max_new_tokens": 7, "top_k": 50, "top_p": 1.0, "do_sample": True}))
    llm = LLM(directory, dtype="float32")
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.repetition_penalty, defaults.max_tokens, defaults.top_k) == (0.0, 1.5, 7, 0)
    out = llm.generate([PROMPT], use_tqdm=False)[0].outputs[0]
    assert out.token_ids == llm.generate([PROMPT], defaults, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out.token_ids) <= 7
    # Given SamplingParams are taken as they are.
    assert len(llm.generate([PROMPT], SamplingParams(ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids) == 16


TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def test_chat_renders_the_template_and_generates(llm):
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a page?"}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = llm.chat([messages, messages[1:]], params, use_tqdm=False, chat_template=TEMPLATE)
    for output, conversation in zip(outputs, [messages, messages[1:]]):
        text = tokenizer.apply_chat_template(conversation, chat_template=TEMPLATE, tokenize=False,
                                             add_generation_prompt=True)
        assert output.prompt == text and output.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)
        assert output.prompt_token_ids.count(tokenizer.bos_token_id) == len(conversation)
        direct = llm.generate([{"prompt_token_ids": output.prompt_token_ids}], params, use_tqdm=False)[0]
        assert output.outputs[0].token_ids == direct.outputs[0].token_ids
    one = llm.chat(messages, params, use_tqdm=False, chat_template=TEMPLATE)
    assert len(one) == 1 and one[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="chat template"):
        llm.chat(messages, params, use_tqdm=False)


@pytest.mark.parametrize("options, field", [
    (dict(n=0), "n"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
])
def test_bad_values_raise_naming_the_field(options, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**options)


@pytest.mark.parametrize("options, field", [
    (dict(logit_bias={100000: 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[1, 100000]), "allowed_token_ids"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
])
def test_values_the_model_cannot_take_raise_naming_the_field(llm, options, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        llm.generate([PROMPT], SamplingParams(**options), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_logit_bias_is_clamped_as_vllm():
    assert SamplingParams(logit_bias={"5": 250, 6: -1e9}).logit_bias == {5: 100.0, 6: -100.0}


def test_greedy_picks_the_first_of_tied_best_tokens():
    """As HF's and torch's argmax: the lowest token id among equal maxima, in rows long enough to vectorise."""
    from runtime.sampler import Sampler

    logits = torch.zeros(3, 32000)
    logits[0, [7, 9000, 31999]] = 5.0
    logits[1, [20001, 20002]] = 1.0
    logits[2] = 3.0  # every token ties
    params = [SamplingParams(temperature=0)] * 3
    out = Sampler()(logits, params, [None] * 3, [[]] * 3)
    assert out.token_ids == [7, 20001, 0]
