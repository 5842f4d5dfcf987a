"""Pipeline parallelism: for every architecture on the engine, greedy tokens at PP=2 equal PP=1 and HF.

One 2-rank group (gloo: this process, stage 0, and one spawned worker, stage 1) serves the module. Each
run batches four prompts of different lengths (continuous batching), computes at most 16 tokens a step
(chunked prefill) and has a pool of about one full-length sequence's pages, so that models with attention
preempt requests and recompute them; the PP=2 run, scheduled by the same pure-Python scheduler on rank 0,
preempts the same requests.
"""

import math

import pytest
from pp_helpers import DELTANET, LAST_RUN, MAX_MODEL_LEN, NEW_TOKENS, PROMPTS, STEP_TOKENS, checkpoint, \
    one_device_run_that_preempts, run  # noqa: F401 (checkpoint is a fixture)
from safetensors import safe_open
from tiny_models import hf_greedy

from runtime import LLM, SamplingParams
from runtime.config import EngineConfig
from runtime.distributed.pipeline import stage_plan


CASES = [
    pytest.param("llama", False, id="llama", marks=pytest.mark.proves("LlamaForCausalLM", "pipeline parallel")),
    pytest.param("granite", False, id="granite", marks=pytest.mark.proves("GraniteForCausalLM", "pipeline parallel")),
    pytest.param("mamba2", False, id="mamba2", marks=pytest.mark.proves("Mamba2ForCausalLM", "pipeline parallel")),
    pytest.param("bamba", False, id="bamba", marks=pytest.mark.proves("BambaForCausalLM", "pipeline parallel")),
    pytest.param("granitemoehybrid", False, id="granitemoehybrid",
                 marks=pytest.mark.proves("GraniteMoeHybridForCausalLM", "pipeline parallel")),
    pytest.param("granitemoehybrid-dense-nope", False, id="granitemoehybrid-dense-nope",
                 marks=pytest.mark.proves("GraniteMoeHybridForCausalLM", "pipeline parallel")),
    pytest.param("jamba", False, id="jamba", marks=pytest.mark.proves("JambaForCausalLM", "pipeline parallel")),
    pytest.param("mamba", False, id="mamba", marks=pytest.mark.proves("MambaForCausalLM", "pipeline parallel")),
    pytest.param("falcon_h1", False, id="falcon_h1",
                 marks=pytest.mark.proves("FalconH1ForCausalLM", "pipeline parallel")),
    pytest.param("nemotron_h", False, id="nemotron_h",
                 marks=pytest.mark.proves("NemotronHForCausalLM", "pipeline parallel")),
    pytest.param("zamba2", False, id="zamba2", marks=pytest.mark.proves("Zamba2ForCausalLM", "pipeline parallel")),
    pytest.param("lfm2", True, id="lfm2", marks=pytest.mark.proves("Lfm2ForCausalLM", "pipeline parallel")),
    pytest.param("lfm2_moe", True, id="lfm2_moe", marks=pytest.mark.proves("Lfm2MoeForCausalLM", "pipeline parallel")),
    pytest.param("falcon_mamba", True, id="falcon_mamba",
                 marks=pytest.mark.proves("FalconMambaForCausalLM", "pipeline parallel")),
    pytest.param("qwen3_next", DELTANET, id="qwen3_next",
                 marks=pytest.mark.proves("Qwen3NextForCausalLM", "pipeline parallel")),
    pytest.param("qwen3_5", DELTANET, id="qwen3_5",
                 marks=pytest.mark.proves("Qwen3_5ForCausalLM", "pipeline parallel")),
    pytest.param("qwen3_5_moe", DELTANET, id="qwen3_5_moe",
                 marks=pytest.mark.proves("Qwen3_5MoeForCausalLM", "pipeline parallel")),
    pytest.param("olmo_hybrid", DELTANET, id="olmo_hybrid",
                 marks=pytest.mark.proves("OlmoHybridForCausalLM", "pipeline parallel")),
]


@pytest.mark.parametrize("name, family", CASES)
def test_pp2_tokens_equal_pp1_and_transformers(name, family, checkpoint):
    directory, hf = checkpoint(name, family)
    pp1, preemptions_pp1, ids, pages, layout = one_device_run_that_preempts(directory)
    pp2, preemptions, _ = run(directory, pages, pipeline_parallel_size=2)
    assert pp2 == pp1
    assert pp1 == [hf_greedy(hf, prompt, NEW_TOKENS) for prompt in ids]
    if layout.block_size:
        # attention pages ran out mid-run: requests were recomputed (micro-batches preempt otherwise than one
        # step at a time does, so the counts may differ)
        assert preemptions > 0 and preemptions_pp1 > 0
    # The two stages overlapped micro-batches (a pool without attention pages holds one sequence here).
    assert LAST_RUN["most_in_flight"] == (2 if layout.block_size else 1)
    assert max(len(i) for i in ids) > STEP_TOKENS  # and prefill was chunked


def test_each_stage_holds_only_its_layers_weights_and_pages(tiny_checkpoint):
    """Nemotron-H's "M*-ME": rank 0 holds the embedding and its layers, rank 1 the rest, the final norm and
    the LM head; every checkpoint tensor is on exactly one stage; a stage's pool has a slab only for the
    layer positions its own layers use, and a stage without attention layers binds no KV cache."""
    directory, _ = tiny_checkpoint("nemotron_h")
    config = EngineConfig(str(directory), pipeline_parallel_size=2)
    stages = stage_plan(config)
    llm = LLM(directory, dtype="float32", pipeline_parallel_size=2)
    try:
        ranks = llm.engine.runner.describe()
    finally:
        llm.engine.shutdown()
    with safe_open(directory / "model.safetensors", framework="pt") as f:
        theirs = {n: f.get_slice(n).get_shape() for n in f.keys()}
    assert set(ranks[0]["parameters"]) | set(ranks[1]["parameters"]) == set(theirs)
    assert not set(ranks[0]["parameters"]) & set(ranks[1]["parameters"])
    for rank, stage in zip(ranks, stages):
        layers = {int(n.split(".")[2]) for n in rank["parameters"] if n.startswith("backbone.layers.")}
        assert layers <= set(stage.layers) and rank["layers"] == list(stage.layers)
        kinds = dict(enumerate(config.cache.layers))
        assert rank["attention_layers"] == [i for i in stage.layers if kinds[i].has_attention]
        assert rank["state_layers"] == [i for i in stage.layers if kinds[i].has_state]
        slabs = {j % config.cache.group_size for j, i in enumerate(config.cache.attention_layers) if i in stage.layers}
        slabs |= {j % config.cache.group_size for j, i in enumerate(config.cache.state_layers) if i in stage.layers}
        assert rank["pool_shape"][1] == len(slabs) < config.cache.group_size or config.cache.group_size == 1
    assert "backbone.embeddings.weight" in ranks[0]["parameters"]
    assert {"lm_head.weight", "backbone.norm_f.weight"} <= set(ranks[1]["parameters"])
    assert ranks[0]["weight_bytes"] + ranks[1]["weight_bytes"] == sum(math.prod(s) * 4 for s in theirs.values())
    assert [r["attention_layers"] for r in ranks].count([]) == 1  # one stage has no attention pages at all


def test_tied_embeddings_are_on_the_last_stage_too(tiny_checkpoint):
    """Mamba ties its LM head to the embedding: the last stage loads the embedding's tensor as its head."""
    directory, _ = tiny_checkpoint("mamba")
    llm = LLM(directory, dtype="float32", pipeline_parallel_size=2)
    try:
        ranks = llm.engine.runner.describe()
    finally:
        llm.engine.shutdown()
    assert "backbone.embeddings.weight" in ranks[0]["parameters"]
    assert "backbone.embeddings.weight" in ranks[1]["parameters"]
    assert not any(n.startswith("backbone.layers.1.") for n in ranks[0]["parameters"])
    assert not any(n.startswith("backbone.layers.0.") for n in ranks[1]["parameters"])


def test_prompt_logprobs_and_parallel_samples_equal_one_device(tiny_checkpoint):
    """The logits of prompt rows and of n > 1 samples come back to rank 0 from the last stage unchanged."""
    directory, _ = tiny_checkpoint("bamba")
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=6, logprobs=2, prompt_logprobs=2)
    runs = []
    for pp in (2, 1):
        llm = LLM(directory, dtype="float32", pipeline_parallel_size=pp, max_num_batched_tokens=STEP_TOKENS)
        try:
            runs.append(llm.generate(PROMPTS[:2], params, use_tqdm=False))
        finally:
            llm.engine.shutdown()
    for pp2, pp1 in zip(*runs):
        assert [o.token_ids for o in pp2.outputs] == [o.token_ids for o in pp1.outputs]
        assert_close(pp2.prompt_logprobs, pp1.prompt_logprobs)
        for a, b in zip(pp2.outputs, pp1.outputs):
            assert_close(a.logprobs, b.logprobs)


def assert_close(ours, theirs):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


@pytest.mark.proves("BambaForCausalLM", "pipeline parallel")
def test_prefix_caching_snapshots_per_stage(tiny_checkpoint):
    """Prefix caching at PP=2: a prompt sharing a cached prefix resumes from each stage's own copies of the
    cached states and pages, and gives the tokens of one device."""
    directory, _ = tiny_checkpoint("bamba")
    shared = PROMPTS[3]
    prompts = [shared + " First", shared + " Second one"]
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    results = {}
    for pp in (1, 2):
        llm = LLM(directory, dtype="float32", pipeline_parallel_size=pp, enable_prefix_caching=True,
                  max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=STEP_TOKENS)
        try:
            first = llm.generate(prompts[:1], greedy, use_tqdm=False)[0]
            second = llm.generate(prompts[1:], greedy, use_tqdm=False)[0]
            results[pp] = (list(first.outputs[0].token_ids), list(second.outputs[0].token_ids),
                           second.num_cached_tokens)
        finally:
            llm.engine.shutdown()
    assert results[2] == results[1]
    assert results[2][2] > 0  # the second prompt resumed from the cache
