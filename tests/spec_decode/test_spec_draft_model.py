"""Speculative decoding with a draft model changes how many tokens a step computes, never the tokens
(float32, greedy), on every engine architecture.

The draft is the target's own checkpoint with every weight moved by 5 % of its spread: its argmax agrees with
the target's often but not always, so drafts are accepted and rejected by the models' own choices, and the
draft model (of the target's architecture: stateful drafts included) rolls its own cache back after each
rejection. Its proposals are checked against a fresh greedy run of the draft model from the same tokens,
which they equal only if that rollback is right. Two requests may only pick between two tokens
(allowed_token_ids, which the draft's argmax honours too); a long prompt is prefilled in chunks beside the
others' verifies, and requests whose drafts fail pause proposing, so steps mix verifies, plain decodes and
prefill chunks.
"""

import json
import os
import random
import shutil
import subprocess
import sys

import pytest
from spec_helpers import perturbed_copy, run_watching_steps
from tiny_models import DELTANET_CONFIGS, FAMILY_CONFIGS, build_deltanet_model, build_family_model

from runtime import LLM, SamplingParams, StructuredOutputsParams
from runtime.config import EngineConfig
from runtime.engine import make_prefix_cache
from runtime.plan import build_report, format_report

K = 3
CHOICES = [9, 40]
_rng = random.Random(1)
PROMPTS = [
    {"prompt_token_ids": _rng.sample(range(3, 320), 8)},
    {"prompt_token_ids": [9, 40, 41, 200, 7] * 3},
    {"prompt_token_ids": [77, 78, 79] * 4},
    {"prompt_token_ids": _rng.sample(range(3, 320), 20)},
    {"prompt_token_ids": [_rng.randrange(3, 320) for _ in range(60)]},
]
FEW = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1, allowed_token_ids=CHOICES)
FREE = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
# A structured-output request never proposes (a grammar would have to accept each draft): it decodes beside
# the others' verifies.
GRAMMAR = SamplingParams(temperature=0, max_tokens=16, logprobs=1,
                         structured_outputs=StructuredOutputsParams(regex="[a-z ]{30,60}"))
PARAMS = [GRAMMAR, FEW, FEW, FREE, FREE]
LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1, allowed_token_ids=CHOICES)
BUDGET = 24  # tokens per step: the 60-token prompt takes three steps, beside the others' verifies
ARCHITECTURES = ["llama", "granite", "mamba2", "bamba", "granitemoehybrid", "jamba", "mamba", "falcon_h1",
                 "nemotron_h", "zamba2", "lfm2", "lfm2_moe", "falcon_mamba", "qwen3_next", "qwen3_5", "qwen3_5_moe",
                 "olmo_hybrid"]


def build(name, tmp_path_factory, tiny_checkpoint, tokenizer_dir):
    if name in FAMILY_CONFIGS or name in DELTANET_CONFIGS:
        directory = tmp_path_factory.mktemp(name)
        (build_family_model if name in FAMILY_CONFIGS else build_deltanet_model)(name, directory, tokenizer_dir)
        return directory
    return tiny_checkpoint(name)[0]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def checkpoints(request, tiny_checkpoint, tmp_path_factory, tokenizer_dir):
    target = build(request.param, tmp_path_factory, tiny_checkpoint, tokenizer_dir)
    return target, perturbed_copy(target, tmp_path_factory.mktemp(request.param) / "draft")


@pytest.fixture(scope="module")
def prompts(checkpoints):
    """PROMPTS after a shared prefix a cache block longer than the model's prefix-cache block."""
    config = EngineConfig(str(checkpoints[0]), dtype="float32", enable_prefix_caching=True)
    shared = random.Random(2).sample(range(3, 320), make_prefix_cache(config).block_size + 3)
    return [{"prompt_token_ids": shared + p["prompt_token_ids"]} for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(checkpoints, prompts):
    llm = LLM(checkpoints[0], dtype="float32", max_num_batched_tokens=BUDGET)
    return llm.generate(prompts, PARAMS, use_tqdm=False), llm.generate(PROMPTS[1:4], LONG, use_tqdm=False)


def speculative(target, draft, **options):
    return LLM(target, dtype="float32", speculative_config={"model": str(draft), "num_speculative_tokens": K},
               **options)


def assert_same(outputs, reference):
    for output, want in zip(outputs, reference):
        got, want = output.outputs[0], want.outputs[0]
        assert got.token_ids == want.token_ids
        # A request preempted before it ever verified recomputes its output as a prefill, as the run without
        # speculation does under preemption: Zamba2's chunked scan clamps dt where decoding does not (runner._kind),
        # which moves its logprobs by ~2e-3 from those of decoding, with or without speculation.
        tolerance = 1e-4 if output.num_preemptions == 0 else 1e-2
        for a, b in zip(got.logprobs, want.logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < tolerance for t in a)


def record_proposals(llm):
    """Every (tokens, allowed ids, drafts) the draft model proposes, recorded as the real proposer runs."""
    drafter, seen = llm.engine.speculator.drafter, []
    propose = drafter.propose

    def recording(seqs, rooms):
        drafts = propose(seqs, rooms)
        seen.extend((tuple(s.token_ids), s.params.allowed_token_ids, tuple(d)) for s, d in zip(seqs, drafts) if d)
        return drafts

    drafter.propose = recording
    return seen


def assert_proposals_are_the_drafts_greedy_run(draft, proposals):
    """Each proposal equals the draft model's own greedy continuation of the tokens it was proposed for."""
    unique = sorted(set(proposals))
    prompts = [{"prompt_token_ids": list(tokens)} for tokens, _, _ in unique]
    params = [SamplingParams(temperature=0, max_tokens=len(d), ignore_eos=True, allowed_token_ids=allowed)
              for _, allowed, d in unique]
    fresh = LLM(draft, dtype="float32").generate(prompts, params, use_tqdm=False)
    assert [tuple(o.outputs[0].token_ids) for o in fresh] == [d for *_, d in unique]


def assert_pools_free(llm):
    cache, drafter = llm.engine.cache, llm.engine.speculator.drafter
    assert cache.num_free_pages == cache.num_pages
    assert drafter.cache.num_free_pages == drafter.cache.num_pages and not drafter._shadows


def test_greedy_equals_without_speculation_with_prefix_caching(checkpoints, prompts, reference):
    target, draft = checkpoints
    llm = speculative(target, draft, max_num_batched_tokens=BUDGET, enable_prefix_caching=True)
    proposals = record_proposals(llm)
    outputs, mixed = run_watching_steps(llm, prompts, PARAMS)
    assert_same(outputs, reference[0])
    again = llm.generate(prompts, PARAMS, use_tqdm=False)  # the drafts verified after a cached prefix
    assert_same(again, reference[0])
    assert any(o.num_cached_tokens > 0 for o in again)
    counters = llm.engine.speculator.counters
    assert counters.num_drafts > 0
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    assert mixed, "no step held a verify, a plain decode and a prefill chunk together"
    # The engine's counters (/metrics) and each request's own count the draft model's drafts.
    mine = [o.spec_decode for o in again if o.spec_decode is not None]
    assert sum(c.num_draft_tokens for c in mine) <= counters.num_draft_tokens
    assert llm.engine.stats().spec_decode.num_accepted_tokens == counters.num_accepted_tokens
    assert_pools_free(llm)
    assert_proposals_are_the_drafts_greedy_run(draft, proposals)


def test_with_preemption(checkpoints, reference):
    # As tests/engine/test_speculative.py: a pool that holds one sequence of 64 tokens and the states of a
    # second, less a page where blocks and states share it, so sequences wait or are preempted and recomputed.
    target, draft = checkpoints
    layout = EngineConfig(str(target), dtype="float32").cache
    groups = layout.num_state_groups
    pages = layout.pages_per_sequence(64) + 2 * groups - (1 if layout.block_size and groups else 0)
    llm = speculative(target, draft, max_model_len=64, num_pages=pages, max_num_seqs=2)
    outputs = llm.generate(PROMPTS[1:4], LONG, use_tqdm=False)
    assert_same(outputs, reference[1])
    if layout.block_size:
        assert sum(o.num_preemptions for o in outputs) > 0
    assert llm.engine.speculator.counters.num_accepted_tokens > 0
    assert_pools_free(llm)


@pytest.mark.parametrize("target_name, draft_name", [("bamba", "llama"), ("llama", "mamba2")])
def test_a_draft_of_another_architecture(target_name, draft_name, tiny_checkpoint, tmp_path_factory, tokenizer_dir):
    """A Llama drafting for a hybrid, a Mamba-2 (a stateful draft) for an attention model; same tokenizer."""
    target = build(target_name, tmp_path_factory, tiny_checkpoint, tokenizer_dir)
    draft = build(draft_name, tmp_path_factory, tiny_checkpoint, tokenizer_dir)
    params = [FEW, FEW, FREE]
    reference = LLM(target, dtype="float32").generate(PROMPTS[1:4], params, use_tqdm=False)
    llm = speculative(target, draft)
    assert_same(llm.generate(PROMPTS[1:4], params, use_tqdm=False), reference)
    counters = llm.engine.speculator.counters
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    assert_pools_free(llm)


# Bad input --------------------------------------------------------------------------------------


def bad(target, value):
    with pytest.raises(ValueError) as err:
        LLM(target, dtype="float32", speculative_config=value)
    message = str(err.value)
    assert message.startswith("speculative_config: ") and "\n" not in message
    return message


def test_a_draft_with_another_vocabulary_is_refused(tiny_checkpoint):
    target, draft = tiny_checkpoint("llama")[0], tiny_checkpoint("llama", vocab_size=400)[0]
    message = bad(target, {"model": str(draft), "num_speculative_tokens": 2})
    assert "has a vocabulary of 400 tokens and the model 320: a draft model must share the model's tokenizer" in message


def test_a_draft_with_another_tokenizer_is_refused(tiny_checkpoint, tmp_path):
    target = tiny_checkpoint("llama")[0]
    draft = shutil.copytree(target, tmp_path / "draft")
    tokenizer = json.loads((draft / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # the same size, two ids swapped
    (draft / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert "has another tokenizer than the model's" in bad(target, {"model": str(draft), "num_speculative_tokens": 2})


def test_a_missing_draft_and_a_bad_k_are_refused(tiny_checkpoint, tmp_path):
    target = tiny_checkpoint("llama")[0]
    assert f"the draft model {tmp_path / 'nope'} does not exist" in bad(
        target, {"model": str(tmp_path / "nope"), "num_speculative_tokens": 2})
    assert '"num_speculative_tokens" must be a positive integer, got 0' in bad(
        target, {"model": str(target), "num_speculative_tokens": 0})
    assert '"model" (a draft model\'s directory) goes with method "draft_model" alone' in bad(
        target, {"method": "ngram", "model": str(target), "num_speculative_tokens": 2})


def test_a_draft_pool_without_room_for_one_sequence_is_refused_at_start_up(tiny_checkpoint):
    target = tiny_checkpoint("llama")[0]
    with pytest.raises(ValueError, match=r"the draft model's pool \(8 pages of 8,192 B\) cannot hold one sequence "
                                         r"of 512 tokens, which needs 32 pages: the draft.s pool takes "
                                         r"kv_cache_memory"):
        LLM(target, dtype="float32", num_pages=64, kv_cache_memory=2**16,
            speculative_config={"model": str(target), "num_speculative_tokens": 2})


def _cli(*args):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], capture_output=True, text=True, env=env)


def test_cli_refuses_a_missing_draft_in_one_line_and_exits_2():
    spec = '{"model": "docs/configs/nope", "num_speculative_tokens": 4}'
    result = _cli("plan", "docs/configs/meta-llama__Llama-3.2-1B", "--speculative-config", spec)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        'tandem plan: error: --speculative-config: the draft model docs/configs/nope does not exist; "model" names a '
        'checkpoint directory with the same tokenizer as the model']


def test_plan_prints_the_draft_pool():
    spec = {"model": "docs/configs/meta-llama__Llama-3.2-1B", "num_speculative_tokens": 4}
    with pytest.raises(ValueError, match="a draft model must share the model's tokenizer"):
        EngineConfig("docs/configs/state-spaces__mamba2-130m", speculative_config=spec)
    config = EngineConfig("docs/configs/meta-llama__Llama-3.2-1B", max_model_len=4096, speculative_config=spec)
    printed = format_report(build_report(config, 8 * 2**30, 4096))
    assert "(the argmax of draft model docs/configs/meta-llama__Llama-3.2-1B, LlamaForCausalLM)" in printed
    # A page id spans 16 layers of 16 tokens x 8 KV heads x 64 x K and V in bfloat16 (512 KiB).
    assert "a sequence of 4,096 tokens holds 256 page ids = 134,217,728 B (128.00 MiB)" in printed
    assert "holds 16,384 page ids (no more than max_num_seqs sequences use): 64 sequences at full length" in printed


def test_an_aborted_request_gives_the_draft_pool_back(tiny_checkpoint):
    target = tiny_checkpoint("bamba")[0]
    llm = speculative(target, target)
    engine = llm.engine
    engine.add_request(PROMPTS[1], FREE, request_id="a")
    while not engine.speculator.drafter._shadows:
        engine.step()
    engine.abort("a")
    assert_pools_free(llm)


def test_sampling_with_a_draft_model_keeps_the_distribution(tiny_checkpoint):
    """As tests/spec_decode/test_spec_sampling.py, with a Llama drafting for a Bamba: seeded requests at
    temperature 1 reproduce, and the tokens after accepted and rejected drafts are distributed as without."""
    from test_spec_sampling import CRITICAL_8_DF, chi_square, sample

    target, draft = tiny_checkpoint("bamba")[0], tiny_checkpoint("llama")[0]
    plain = sample(LLM(target, dtype="float32"), 0)
    llm = speculative(target, draft)
    spec = sample(llm, 10_000)
    assert sample(llm, 10_000) == spec
    tails = lambda samples: [s[2:] for s in samples]  # noqa: E731
    assert len(set(tails(plain))) > 4
    assert chi_square(tails(plain), tails(spec)) < CRITICAL_8_DF
    counters = llm.engine.speculator.counters
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
