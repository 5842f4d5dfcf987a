"""The "mtp" method: Qwen3-Next's and Qwen3.5's multi-token-prediction head proposes, the model verifies;
greedy tokens and logprobs equal the run without speculation (float32).

transformers' models have no MTP module, so each test checkpoint gets `mtp.*` tensors written into its
safetensors here. A random head would almost never guess right, so the head is built to guess "the
token the target would predict from this hidden state" (fc passes the normed hidden state and drops the
embedding, the decoder layer is a copy of one of the target's attention layers with its output
projections scaled down to a small perturbation, the norms are identity): its first draft is then the
last sampled token again, often right for a tiny random model that repeats itself, and wrong otherwise;
the perturbation still flips some. The attention cache, the fc, and each norm still run on real values.
"""

import json
import random

import pytest
import torch
from spec_helpers import (ATTENTION_LAYER, add_mtp_head, assert_drafts_accepted_and_rejected, assert_same_outputs,
                          quantize_fp8_blocks, run_watching_steps)
from tiny_models import build_deltanet_model

from runtime import LLM, SamplingParams
from runtime.cli import main
from runtime.config import EngineConfig
from runtime.layers.quantized import QuantLinear, weight_bytes
from runtime.plan import build_report, format_report

SPEC = {"method": "mtp", "num_speculative_tokens": 2}
_rng = random.Random(3)
PROMPTS = [
    {"prompt_token_ids": [9, 40, 41, 200, 7] * 3},
    {"prompt_token_ids": _rng.sample(range(3, 320), 12)},
    {"prompt_token_ids": _rng.sample(range(3, 320), 20)},
    {"prompt_token_ids": [_rng.randrange(3, 320) for _ in range(60)]},
]
FREE = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
# Two allowed tokens: the head's unconstrained guess is rarely one of them, so this request's drafts fail
# and it backs off, decoding without drafts beside the others.
FEW = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1, allowed_token_ids=[9, 40])
PARAMS = [FREE, FREE, FEW, FREE]
BUDGET = 24  # the 60-token prompt is prefilled in chunks beside the others' verifies


@pytest.fixture(scope="module", params=list(ATTENTION_LAYER))
def checkpoint(request, tmp_path_factory, tokenizer_dir):
    directory = tmp_path_factory.mktemp(request.param)
    build_deltanet_model(request.param, directory, tokenizer_dir)
    layer, echo = ATTENTION_LAYER[request.param]
    add_mtp_head(directory, layer, echo=echo)
    return directory


def assert_released(llm):
    """Every page back in the pool, and no sequence's head cache left behind."""
    engine = llm.engine
    assert engine.cache.num_free_pages == engine.cache.num_pages
    engine.speculator.propose(engine.scheduler.running)  # drops the caches of sequences no longer running
    assert not engine.speculator._heads and not engine.speculator._rows


def test_greedy_tokens_and_logprobs_equal_without_speculation(checkpoint):
    reference = LLM(checkpoint, dtype="float32", max_num_batched_tokens=BUDGET).generate(PROMPTS, PARAMS,
                                                                                         use_tqdm=False)
    llm = LLM(checkpoint, dtype="float32", max_num_batched_tokens=BUDGET, speculative_config=SPEC)
    outputs, mixed = run_watching_steps(llm, PROMPTS, PARAMS)
    assert_same_outputs(outputs, reference)
    assert_drafts_accepted_and_rejected(llm)
    assert mixed, "no step held a verify, a plain decode and a prefill chunk together"
    assert_released(llm)


def test_a_head_published_in_fp8_blocks_runs_quantized(tmp_path, tokenizer_dir):
    """Qwen3-Next's FP8 release quantizes the head with the model: its linears load as QuantLinears in the
    checkpoint's format, it proposes drafts that hold and fail, and the tokens equal decoding without them."""
    build_deltanet_model("qwen3_next", tmp_path, tokenizer_dir)
    layer, echo = ATTENTION_LAYER["qwen3_next"]
    add_mtp_head(tmp_path, layer, echo=echo)
    quantized = quantize_fp8_blocks(tmp_path)
    reference = LLM(tmp_path, dtype="float32", max_num_batched_tokens=BUDGET).generate(PROMPTS, PARAMS,
                                                                                       use_tqdm=False)
    llm = LLM(tmp_path, dtype="float32", max_num_batched_tokens=BUDGET, speculative_config=SPEC)
    head = llm.engine.speculator.head
    in_head = {"mtp." + name for name, m in head.named_modules() if isinstance(m, QuantLinear)}
    assert in_head == {name[: -len(".weight")] for name in quantized if name.startswith("mtp.")}
    assert "mtp.fc" in in_head and any(".experts." in name or "mlp." in name for name in in_head)
    outputs, _ = run_watching_steps(llm, PROMPTS, PARAMS)
    assert_same_outputs(outputs, reference)
    assert_drafts_accepted_and_rejected(llm)
    assert_released(llm)
    # The plan reads config.json alone: the head's bytes in the model's dtype bound the quantized head's.
    config = EngineConfig(str(tmp_path), dtype="float32", speculative_config=SPEC)
    report = build_report(config, None, None)
    assert weight_bytes(head) < report["speculative"]["mtp"]["weight_bytes"]
    assert "weights at most " in format_report(report)


def test_with_prefix_caching(checkpoint):
    llm = LLM(checkpoint, dtype="float32", max_num_batched_tokens=BUDGET, speculative_config=SPEC,
              enable_prefix_caching=True)
    shared = random.Random(2).sample(range(3, 320), llm.engine.cache.prefix.block_size + 3)
    prompts = [{"prompt_token_ids": shared + p["prompt_token_ids"]} for p in PROMPTS[:3]]
    reference = LLM(checkpoint, dtype="float32").generate(prompts, PARAMS[:3], use_tqdm=False)
    assert_same_outputs(llm.generate(prompts, PARAMS[:3], use_tqdm=False), reference)
    again = llm.generate(prompts, PARAMS[:3], use_tqdm=False)  # the head never saw the cached positions
    assert_same_outputs(again, reference)
    assert all(o.num_cached_tokens > 0 for o in again)
    assert_drafts_accepted_and_rejected(llm)


def test_with_preemption(checkpoint):
    from runtime.config import EngineConfig

    # A pool that holds one sequence of 64 tokens and the states of a second (less a page where blocks and
    # states share one): sequences wait, or are preempted and recomputed, which rebuilds their head caches.
    prompts = PROMPTS[:3]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    reference = LLM(checkpoint, dtype="float32").generate(prompts, params, use_tqdm=False)
    layout = EngineConfig(str(checkpoint), dtype="float32").cache
    groups = layout.num_state_groups
    pages = layout.pages_per_sequence(64) + 2 * groups - (1 if layout.block_size and groups else 0)
    llm = LLM(checkpoint, dtype="float32", speculative_config=SPEC, max_model_len=64, num_pages=pages,
              max_num_seqs=2)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_same_outputs(outputs, reference)
    assert sum(o.num_preemptions for o in outputs) > 0
    assert llm.engine.speculator.counters.num_accepted_tokens > 0
    assert_released(llm)


def test_first_draft_reads_the_hidden_state_of_the_last_sampled_token(tmp_path, tokenizer_dir):
    """With the perturbation off the head predicts exactly what the target predicted from the same hidden
    state, so each first draft of a greedy request is the token the target sampled last: a head fed the
    hidden state of another position, or the wrong next token, would not give it."""
    build_deltanet_model("qwen3_5", tmp_path, tokenizer_dir)
    add_mtp_head(tmp_path, ATTENTION_LAYER["qwen3_5"][0], scale=0.0)
    llm = LLM(tmp_path, dtype="float32", max_num_batched_tokens=BUDGET, speculative_config=SPEC)
    speculator, seen = llm.engine.speculator, []
    guess = speculator._guess

    def watch(seq, room):
        drafts = guess(seq, room)
        seen.append((seq.token_ids[-1], drafts))
        return drafts

    speculator._guess = watch
    llm.generate(PROMPTS[:2], FREE, use_tqdm=False)
    assert len(seen) > 5 and all(drafts and drafts[0] == last for last, drafts in seen)


def test_head_attention_one_row_at_a_time_equals_all_at_once(checkpoint):
    """The head's cache: positions run one by one (as drafts are) give the outputs of one causal call."""
    from runtime.models.qwen3_next.mtp import HeadKV

    llm = LLM(checkpoint, dtype="float32", speculative_config=SPEC)
    speculator = llm.engine.speculator
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, speculator.model.config.hidden_size, generator=generator)
    tokens, positions = torch.randint(3, 300, (7,), generator=generator), torch.arange(7)
    with torch.inference_mode():
        whole = speculator._run(tokens, hidden, positions, HeadKV(), 0)
        kv = HeadKV()
        parts = [speculator._run(tokens[:3], hidden[:3], positions[:3], kv, 0)]
        parts += [speculator._run(tokens[i:i + 1], hidden[i:i + 1], positions[i:i + 1], kv, 0) for i in range(3, 7)]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-5)


def test_a_checkpoint_without_heads_is_refused_in_one_line(tmp_path, tokenizer_dir, capsys):
    build_deltanet_model("qwen3_5", tmp_path, tokenizer_dir)
    with pytest.raises(ValueError) as err:
        LLM(tmp_path, dtype="float32", speculative_config=SPEC)
    assert "needs the checkpoint's multi-token-prediction heads (mtp.* tensors)" in str(err.value)
    assert "\n" not in str(err.value)
    capsys.readouterr()
    args = ["generate", "--model", str(tmp_path), "--speculative-config", json.dumps(SPEC), "--max-tokens", "2", "Hi"]
    assert main(args) == 2
    stderr = capsys.readouterr().err
    assert len(stderr.strip().splitlines()) == 1
    assert "--speculative-config: method \"mtp\" needs the checkpoint's" in stderr


def test_an_architecture_without_heads_is_refused(tiny_checkpoint):
    directory = tiny_checkpoint("llama")[0]
    with pytest.raises(ValueError, match="LlamaForCausalLM has none"):
        LLM(directory, dtype="float32", speculative_config=SPEC)


def test_seeded_sampling_reproduces(checkpoint):
    """At temperature 1 the head's greedy drafts are a point mass, sampled rows are plain decodes' (see
    verify.py): two engines with the same seeds give the same tokens, drafts verified on the way."""
    params = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=5 + i) for i in range(3)]
    runs = []
    for _ in range(2):
        llm = LLM(checkpoint, dtype="float32", speculative_config=SPEC)
        runs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)])
        assert llm.engine.speculator.counters.num_draft_tokens > 0
    assert runs[0] == runs[1]
