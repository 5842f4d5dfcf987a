"""HF transformers is the oracle: our greedy tokens, and the logprobs of every decode step, equal its own.

The tiny models are random in every parameter (tests/tiny_models.py). Prompts of different lengths
run batched together; the longest (101 tokens) is longer than the Mamba chunk (16) and than one
attention page, so prefill crosses chunk and page boundaries. HF's reference is its own incremental
decode (`generate`), one prompt at a time; at each step the engine's chosen and top tokens must
carry HF's log-probabilities within 1e-4 (float32).
"""

import copy

import pytest
import torch
from tiny_models import hf_greedy_logprobs, hf_last_logits
from transformers import AutoTokenizer

from runtime import LLM, SamplingParams
from runtime.config import EngineConfig

PROMPTS = [
    "The",
    "A hybrid model mixes attention",
    "The page pool holds attention blocks and Mamba states of equal size. The scheduler batches",
    "Every model class declares what it supports and what it caches. Chunked prefill processes a long "
    "prompt over several steps, and the quick brown fox jumps over the lazy dog again and again and again.",
]
LONGEST = PROMPTS[-1]
NEW_TOKENS = 16
TOP = 5
LOGPROB_ATOL = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
# Each case proves that its architecture runs on the engine (the V1 column; see docs/contributing.md).
MODELS = [
    pytest.param("llama", marks=pytest.mark.proves("LlamaForCausalLM", "engine")),
    pytest.param("granite", marks=pytest.mark.proves("GraniteForCausalLM", "engine")),
    pytest.param("mamba2", marks=pytest.mark.proves("Mamba2ForCausalLM", "engine")),
    pytest.param("bamba", marks=pytest.mark.proves("BambaForCausalLM", "engine")),
    pytest.param("granitemoehybrid", marks=pytest.mark.proves("GraniteMoeHybridForCausalLM", "engine")),
    pytest.param("granitemoehybrid-dense-nope", marks=pytest.mark.proves("GraniteMoeHybridForCausalLM", "engine")),
    pytest.param("jamba", marks=pytest.mark.proves("JambaForCausalLM", "engine")),
    pytest.param("mamba", marks=pytest.mark.proves("MambaForCausalLM", "engine")),
    pytest.param("falcon_h1", marks=pytest.mark.proves("FalconH1ForCausalLM", "engine")),
    pytest.param("falcon_h1_rms_norm", marks=pytest.mark.proves("FalconH1ForCausalLM", "engine")),
    pytest.param("nemotron_h", marks=pytest.mark.proves("NemotronHForCausalLM", "engine")),
    pytest.param("zamba2", marks=pytest.mark.proves("Zamba2ForCausalLM", "engine")),
]
# Config values the default tiny configs leave at HF's defaults, each where the architecture reads it.
# (Non-default multipliers and Falcon-H1's mamba_rms_norm are in the base configs above.)
DT_LIMIT = dict(time_step_limit=(0.05, 0.5))
VARIANTS = [
    pytest.param("bamba", DT_LIMIT, id="bamba-dt-limit"),
    pytest.param("mamba2", DT_LIMIT, id="mamba2-dt-limit"),
    pytest.param("granitemoehybrid", DT_LIMIT, id="granitemoehybrid-dt-limit"),
    pytest.param("falcon_h1", DT_LIMIT, id="falcon_h1-dt-limit"),
    pytest.param("llama", dict(tie_word_embeddings=True), id="llama-tied"),
    pytest.param("bamba", dict(tie_word_embeddings=True), id="bamba-tied"),
    pytest.param("falcon_h1", dict(tie_word_embeddings=True), id="falcon_h1-tied"),
    # HF's NemotronH keeps lm_head apart from the embeddings even when the config says to tie them
    # (transformers 5.24, in memory and after from_pretrained); the engine ties them.
    pytest.param("nemotron_h", dict(tie_word_embeddings=True), id="nemotron_h-tied", marks=pytest.mark.xfail(
        strict=True, reason="HF's NemotronH never ties lm_head to the embeddings; the engine does")),
    pytest.param("mamba", dict(tie_word_embeddings=False), id="mamba-untied"),
    pytest.param("llama", dict(attention_bias=True, mlp_bias=True), id="llama-biases"),
    pytest.param("granite", dict(attention_bias=True, mlp_bias=True), id="granite-biases"),
    pytest.param("mamba2", dict(use_bias=True, use_conv_bias=True), id="mamba2-biases"),
    pytest.param("mamba", dict(use_bias=True, use_conv_bias=True), id="mamba-biases"),
    pytest.param("bamba", dict(mamba_proj_bias=True, attention_bias=True, mlp_bias=True), id="bamba-biases"),
    pytest.param("granitemoehybrid", dict(mamba_proj_bias=True, attention_bias=True), id="granitemoehybrid-biases"),
    pytest.param("jamba", dict(mamba_proj_bias=True), id="jamba-biases"),
    pytest.param("falcon_h1", dict(mamba_proj_bias=True, projectors_bias=True, attention_bias=True, mlp_bias=True),
                 id="falcon_h1-biases"),
    pytest.param("nemotron_h", dict(use_bias=True, attention_bias=True, mlp_bias=True), id="nemotron_h-biases"),
    pytest.param("zamba2", dict(add_bias_linear=True), id="zamba2-biases"),
]


@pytest.fixture(scope="module")
def hf_reference():
    """hf_reference(hf, prompt_ids, n) -> HF's n greedy tokens and their per-step logprobs, computed once."""
    cache = {}

    def reference(hf, ids, n=NEW_TOKENS):
        key = (id(hf), tuple(ids), n)
        if key not in cache:
            cache[key] = hf_greedy_logprobs(hf, ids, n)
        return cache[key]

    return reference


@pytest.fixture(scope="module", params=MODELS)
def model(request, tiny_checkpoint):
    directory, hf = tiny_checkpoint(request.param)
    return request.param, directory, hf


def assert_matches_hf(outputs, hf, hf_reference, label, restarts=None):
    """Each output's tokens are HF's greedy ones, and every step's logprobs are HF's.

    restarts[i] lists, for output i, how many tokens it had generated each time it was preempted. A
    preempted sequence is recomputed as one prefill of its prompt and those tokens, then decodes on:
    from there the oracle is HF's prefill of the same text followed by HF's decode (the two differ
    where HF clamps dt in its chunked scan only: Nemotron-H and Zamba2 at time_step_min).
    """
    for i, output in enumerate(outputs):
        completion = output.outputs[0]
        tokens = completion.token_ids
        assert completion.finish_reason == "length" and len(tokens) == len(completion.logprobs) == NEW_TOKENS, label
        starts = sorted({0, *(restarts[i] if restarts else ())})
        for start, end in zip(starts, [*starts[1:], NEW_TOKENS]):
            expected_tokens, logprobs = hf_reference(hf, output.prompt_token_ids + tokens[:start], NEW_TOKENS - start)
            assert tokens[start:end] == expected_tokens[: end - start], (label, i, start)
            for step in range(start, end):
                assert_step_matches(completion.logprobs[step], tokens[step], logprobs[step - start],
                                    f"{label}, output {i}, step {step}")


def assert_step_matches(top, token, expected, label):
    ids = sorted(top)
    got = torch.tensor([top[t].logprob for t in ids])
    torch.testing.assert_close(got, expected[ids], atol=LOGPROB_ATOL, rtol=0, msg=lambda m: f"{label}: {m}")
    # The engine's top tokens are HF's top tokens (up to ties closer than the tolerance).
    assert len(top) >= TOP and token in top, label
    kth = expected.topk(TOP).values[-1]
    assert all(expected[t] >= kth - LOGPROB_ATOL for t in ids), label


def test_greedy_tokens_and_logprobs_match_transformers(model, hf_reference):
    name, directory, hf = model
    llm = LLM(directory, dtype="float32")
    assert len(llm.get_tokenizer().encode(LONGEST)) > 96, "the longest prompt must cross chunks and pages"
    assert_matches_hf(llm.generate(PROMPTS, GREEDY, use_tqdm=False), hf, hf_reference, name)


def test_last_token_logits_match_transformers(model):
    name, directory, hf = model
    llm = LLM(directory, dtype="float32")
    ids = prompt_ids(llm)
    for prompt, row in zip(ids, last_token_logits(llm, ids)):
        torch.testing.assert_close(row, hf_last_logits(hf, prompt), atol=1e-4, rtol=0)


@pytest.mark.proves(
    "chunked prefill", "LlamaForCausalLM", "GraniteForCausalLM", "Mamba2ForCausalLM", "BambaForCausalLM",
    "GraniteMoeHybridForCausalLM", "JambaForCausalLM", "MambaForCausalLM", "FalconH1ForCausalLM",
    "NemotronHForCausalLM", "Zamba2ForCausalLM",
)
def test_chunked_prefill_matches_transformers(model, hf_reference):
    """Token budgets that end exactly on Mamba chunks, exactly on attention pages, and inside both.

    The longest prompt arrives first, so it takes the whole budget of each step until its prefill is
    done: its prefill is split at every multiple of the budget. The others fill what is left, so
    they are split too, at other offsets, and resume while earlier sequences decode.
    """
    name, directory, hf = model
    config = EngineConfig(str(directory), dtype="float32")
    chunk, page = config.declaration.mamba_chunk_size(config.hf_config), config.cache.block_size
    budgets = {"inside chunks and pages": 21}
    if chunk:
        budgets["a Mamba chunk"] = chunk
    if page:
        budgets["an attention page"] = page
    assert 21 % 16 and all(21 % size for size in (chunk, page) if size)
    prompts = [LONGEST, *PROMPTS[:-1]]
    for what, budget in budgets.items():
        llm = LLM(directory, dtype="float32", max_num_batched_tokens=budget)
        outputs, splits, restarts = generate_recording(llm, prompts, GREEDY)
        assert not any(restarts), (name, what)
        longest = len(outputs[0].prompt_token_ids)
        assert splits[0] == list(range(budget, longest, budget)), (name, what)
        assert any(splits[1:]), (name, what, "no other prompt was split")
        assert_matches_hf(outputs, hf, hf_reference, f"{name}, budget {budget} ({what})")


def test_a_prompt_whose_last_chunk_is_one_token_matches_transformers(model, hf_reference):
    """The last prompt token alone in a step is scanned as the rest of the prompt, not decoded: Nemotron-H's and
    Zamba2's scans clamp dt and their decode steps do not, and decoding it moved their logprobs by 4e-4."""
    name, directory, hf = model
    tokenizer = AutoTokenizer.from_pretrained(directory)
    prompt = {"prompt_token_ids": tokenizer.encode(LONGEST)}
    budget = len(prompt["prompt_token_ids"]) - 1
    llm = LLM(directory, dtype="float32", max_num_batched_tokens=budget, max_num_seqs=1)
    outputs, splits, _ = generate_recording(llm, [prompt], GREEDY)
    assert splits[0] == [budget], (name, splits)
    assert_matches_hf(outputs, hf, hf_reference, f"{name}, a one-token last chunk")


def test_preemption_matches_transformers(model, hf_reference):
    """A pool that holds every prompt but not every continuation: decoding runs it dry.

    Prompts of 30 to 44 tokens each cross an attention page (16, 32 or 48 tokens) within their 16
    new tokens; the pool holds exactly their prefills, so the first page crossed preempts a sequence.
    """
    name, directory, hf = model
    tokenizer = AutoTokenizer.from_pretrained(directory)
    long_ids, mid_ids = tokenizer.encode(LONGEST), tokenizer.encode(PROMPTS[2])
    prompts = [{"prompt_token_ids": ids} for ids in (long_ids[:40], mid_ids[:44], long_ids[:30], mid_ids[:36])]
    layout = EngineConfig(str(directory), dtype="float32").cache
    num_pages = sum(layout.pages_per_sequence(len(p["prompt_token_ids"])) for p in prompts)
    llm = LLM(directory, dtype="float32", max_model_len=64, num_pages=num_pages)
    outputs, _, restarts = generate_recording(llm, prompts, GREEDY)
    assert [len(r) for r in restarts] == [o.num_preemptions for o in outputs]
    if layout.block_size:
        assert any(any(r) for r in restarts), f"{name}: no sequence was preempted after generating a token"
    # (A model without attention holds one state page per sequence from start to end: it is never preempted.)
    assert_matches_hf(outputs, hf, hf_reference, name, restarts)
    assert llm.engine.cache.num_free_pages == llm.engine.cache.num_pages


@pytest.mark.parametrize("name, overrides", VARIANTS)
def test_config_variant_matches_transformers(name, overrides, tiny_checkpoint, hf_reference):
    directory, hf = tiny_checkpoint(name, **overrides)
    for key, value in overrides.items():
        read = getattr(hf.config, key)
        assert (list(read) if isinstance(read, tuple) else read) == (list(value) if isinstance(value, tuple) else value)
    llm = LLM(directory, dtype="float32", max_num_batched_tokens=21)
    assert_matches_hf(llm.generate(PROMPTS, GREEDY, use_tqdm=False), hf, hf_reference, f"{name} {overrides}")


# At initializer_range 0.3 the tiny models amplify rounding chaotically (HF's own bfloat16 moves
# their logits by up to a third of their range and flips MoE routing); at 1/sqrt(hidden_size),
# the scale of a trained model's weights, bfloat16 stays as close as it does on real models.
BF16_INITIALIZER_RANGE = 0.125


@pytest.mark.parametrize("name", MODELS)
def test_bfloat16_runs_and_stays_close_to_float32(name, tiny_checkpoint):
    directory, hf = tiny_checkpoint(name, initializer_range=BF16_INITIALIZER_RANGE)
    reference = LLM(directory, dtype="float32")
    ids = prompt_ids(reference)
    expected = last_token_logits(reference, ids)
    got = last_token_logits(LLM(directory, dtype="bfloat16"), ids)
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    hf_rows = torch.stack([hf_last_logits(hf_bf16, p) for p in ids])
    hf_error = (hf_rows - expected).abs().max()
    error = (got - expected).abs().max()
    assert error < 0.1 * expected.abs().max(), name
    # Our bfloat16 path loses no more than HF's own bfloat16 forward does (up to a factor 2).
    assert error <= 2 * hf_error, (name, error, hf_error)
    # The same next token, wherever HF's own bfloat16 keeps it (elsewhere the top two are a near-tie).
    kept = hf_rows.argmax(-1) == expected.argmax(-1)
    assert torch.equal(got.argmax(-1)[kept], expected.argmax(-1)[kept]), name


def prompt_ids(llm):
    return [llm.get_tokenizer().encode(p) for p in PROMPTS]


def last_token_logits(llm, ids):
    """The logits of each prompt's last token, from one batched prefill step, in prompt order."""
    engine = llm.engine
    for prompt in ids:
        engine.add_request({"prompt_token_ids": prompt}, GREEDY)
    seqs, logits = engine.runner.execute(engine.scheduler.schedule())
    assert [seq.prompt_token_ids for seq in seqs] == ids
    return logits


def generate_recording(llm, prompts, params):
    """Outputs in prompt order and, per prompt, the offsets where a step ended inside its prefill and
    the number of tokens it had generated each time it was preempted."""
    engine = llm.engine
    request_ids = [engine.add_request(p, params) for p in prompts]
    seqs = [engine._seqs[r] for r in request_ids]
    splits = [[] for _ in prompts]
    restarts = [[] for _ in prompts]
    done = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
        for seq, offsets, preempted in zip(seqs, splits, restarts):
            computed = seq.num_computed_tokens
            if 0 < computed < len(seq.prompt_token_ids) and (not offsets or offsets[-1] != computed):
                offsets.append(computed)
            if seq.num_preemptions > len(preempted):
                preempted.append(len(seq.output_token_ids))
    return [done[r] for r in request_ids], splits, restarts
