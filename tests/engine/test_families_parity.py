"""Issue 17's families against HF transformers, the oracle, on tiny checkpoints whose every parameter is random.

Greedy tokens of a mixed-length batch, the same with chunked prefill and with preemption, last-token
logits (float32) and bfloat16 within the bounds tests/engine/test_parity.py uses for the other models.
"""

import copy

import pytest
import torch
from tiny_models import build_family_model, hf_greedy, hf_last_logits

from runtime import LLM, SamplingParams, kernels
from runtime.config import EngineConfig

PROMPTS = [
    "The",
    "A hybrid model mixes attention",
    "The page pool holds attention blocks and Mamba states of equal size. The scheduler batches",
    "Every model class declares what it supports and what it caches. Chunked prefill processes a long "
    "prompt over several steps, and the quick brown fox jumps over the lazy dog again and again and again.",
]
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# Each case proves that its architecture runs on the engine (the V1 column; see docs/contributing.md).
MODELS = [
    pytest.param("lfm2", marks=pytest.mark.proves("Lfm2ForCausalLM", "engine")),
    pytest.param("lfm2_bias", marks=pytest.mark.proves("Lfm2ForCausalLM", "engine")),
    pytest.param("lfm2_moe", marks=pytest.mark.proves("Lfm2MoeForCausalLM", "engine")),
    pytest.param("falcon_mamba", marks=pytest.mark.proves("FalconMambaForCausalLM", "engine")),
]
# The same scheduling claims test_scheduling.py makes for the other models, on one variant per family.
SCHEDULED = ["lfm2", "lfm2_moe", "falcon_mamba"]
BF16_INITIALIZER_RANGE = 0.125  # as in test_parity.py: the scale of a trained model's weights


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory, tokenizer_dir):
    """family_checkpoint(name, **overrides) -> (directory, HF model); built once per name and overrides."""
    built = {}

    def make(name: str, **overrides):
        key = (name, tuple(sorted(overrides.items())))
        if key not in built:
            directory = tmp_path_factory.mktemp(name)
            built[key] = (directory, build_family_model(name, directory, tokenizer_dir, **overrides))
        return built[key]

    return make


@pytest.fixture(scope="module", params=MODELS)
def model(request, family_checkpoint):
    directory, hf = family_checkpoint(request.param)
    return request.param, directory, hf


def prompt_ids(llm):
    return [llm.get_tokenizer().encode(p) for p in PROMPTS]


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def hf_tokens(hf, ids):
    return [hf_greedy(hf, prompt, NEW_TOKENS) for prompt in ids]


def assert_pool_free(llm):
    assert llm.engine.cache.num_free_pages == llm.engine.cache.num_pages
    assert not llm.engine.has_unfinished()


def last_token_logits(llm, ids):
    """The logits of each prompt's last token, from one batched prefill step, in prompt order."""
    engine = llm.engine
    for prompt in ids:
        engine.add_request({"prompt_token_ids": prompt}, GREEDY)
    seqs, logits = engine.runner.execute(engine.scheduler.schedule())
    assert [seq.prompt_token_ids for seq in seqs] == ids
    return logits


def test_greedy_tokens_of_a_mixed_batch_match_transformers(model):
    name, directory, hf = model
    llm = LLM(directory, dtype="float32")
    ids = prompt_ids(llm)
    assert max(map(len, ids)) > 48, "the longest prompt must cross several attention blocks"
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(outputs) == hf_tokens(hf, ids), name
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert_pool_free(llm)


def test_last_token_logits_match_transformers(model):
    name, directory, hf = model
    llm = LLM(directory, dtype="float32")
    ids = prompt_ids(llm)
    for prompt, row in zip(ids, last_token_logits(llm, ids)):
        torch.testing.assert_close(row, hf_last_logits(hf, prompt), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", MODELS)
def test_bfloat16_runs_and_stays_close_to_float32(name, family_checkpoint):
    directory, hf = family_checkpoint(name, initializer_range=BF16_INITIALIZER_RANGE)
    reference = LLM(directory, dtype="float32")
    ids = prompt_ids(reference)
    expected = last_token_logits(reference, ids)
    got = last_token_logits(LLM(directory, dtype="bfloat16"), ids)
    hf_rows = torch.stack([hf_last_logits(copy.deepcopy(hf).to(torch.bfloat16), p) for p in ids])
    hf_error = (hf_rows - expected).abs().max()
    error = (got - expected).abs().max()
    assert error < 0.1 * expected.abs().max(), name
    # Our bfloat16 path loses no more than HF's own bfloat16 forward does (up to a factor 2).
    assert error <= 2 * hf_error, (name, error, hf_error)
    kept = hf_rows.argmax(-1) == expected.argmax(-1)
    assert torch.equal(got.argmax(-1)[kept], expected.argmax(-1)[kept]), name


@pytest.mark.proves("chunked prefill", "Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "FalconMambaForCausalLM")
@pytest.mark.parametrize("name", SCHEDULED)
def test_chunked_prefill_matches_transformers(name, family_checkpoint):
    directory, hf = family_checkpoint(name)
    # 7 tokens a step: prompts resume mid-sequence, from their carried states, over many steps.
    chunked = LLM(directory, dtype="float32", max_num_batched_tokens=7)
    outputs = chunked.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(outputs) == hf_tokens(hf, prompt_ids(chunked))
    assert_pool_free(chunked)


@pytest.mark.parametrize("name", SCHEDULED)
def test_preemption_recomputes_the_same_tokens_as_transformers(name, family_checkpoint):
    directory, hf = family_checkpoint(name)
    layout = EngineConfig(str(directory), dtype="float32").cache
    # Pages for one full-length sequence only: with attention, the two medium prompts start together
    # and the later one is preempted when the earlier one's next block does not fit; the others wait.
    # An attention-free model's pages do not grow, so its requests only wait.
    small = LLM(directory, dtype="float32", max_model_len=128, num_pages=layout.pages_per_sequence(128))
    prompts = [PROMPTS[i] for i in (1, 2, 0, 3)]
    outputs = small.generate(prompts, GREEDY, use_tqdm=False)
    ids = [small.get_tokenizer().encode(p) for p in prompts]
    assert tokens(outputs) == hf_tokens(hf, ids)
    if layout.block_size:
        assert sum(o.num_preemptions for o in outputs) > 0
    assert_pool_free(small)


@pytest.fixture
def restore_backend():
    yield
    # Later tests build engines on CPU, whose references must not be left rebound.
    kernels.bind("torch", torch.device("cpu"))


@pytest.mark.parametrize("name", SCHEDULED)
def test_triton_kernels_give_the_tokens_of_transformers(name, family_checkpoint, restore_backend):
    """The whole engine on the Triton kernels (the interpreter on a CPU), prompts prefilled in pieces."""
    directory, hf = family_checkpoint(name)
    llm = LLM(directory, dtype="float32", kernel_backend="triton", max_num_batched_tokens=24)
    assert kernels.backend == "triton"
    few = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate(PROMPTS[:3], few, use_tqdm=False)
    assert tokens(outputs) == [hf_greedy(hf, ids, 4) for ids in prompt_ids(llm)[:3]]
