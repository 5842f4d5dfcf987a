"""Tensor parallelism: for every architecture on the engine, greedy tokens at TP=2 equal TP=1 and HF.

One 2-rank group (gloo, this process and one spawned worker) serves the whole module: the first
TP=2 engine starts it and every later one reuses it. Each run batches four prompts of different
lengths (continuous batching), computes at most 16 tokens a step (chunked prefill: the longer
prompts resume over several steps) and has a pool of about one full-length sequence's pages, so
that models with attention preempt requests and recompute them. Scheduling is pure Python and does
not depend on the tokens (no request stops early), so the TP=1 run that preempts fixes the pool size
of the TP=2 run, which then preempts the same requests.
"""

import pytest
import torch
from tiny_models import build_deltanet_model, build_family_model, hf_greedy

from runtime import LLM, SamplingParams
from runtime.config import EngineConfig
from runtime.distributed import group, state

# The prompts and limits the pipeline-parallel tests use too (one workload that batches, chunks and preempts).
from pp_helpers import DELTANET, GREEDY, MAX_MODEL_LEN, NEW_TOKENS, PROMPTS, STEP_TOKENS  # noqa: E402


CASES = [
    pytest.param("llama", False, {}, id="llama",
                 marks=pytest.mark.proves("LlamaForCausalLM", "tensor parallel")),
    # One KV head for two ranks: each rank keeps a copy (vLLM's replication).
    pytest.param("llama", False, dict(num_key_value_heads=1, tie_word_embeddings=True), id="llama-one-kv-head-tied",
                 marks=pytest.mark.proves("LlamaForCausalLM", "tensor parallel")),
    pytest.param("granite", False, dict(attention_bias=True, mlp_bias=True), id="granite-biases",
                 marks=pytest.mark.proves("GraniteForCausalLM", "tensor parallel")),
    pytest.param("mamba2", False, {}, id="mamba2",
                 marks=pytest.mark.proves("Mamba2ForCausalLM", "tensor parallel")),
    # One Mamba-2 group: replicated on both ranks, and the gated norm's RMS spans them.
    pytest.param("mamba2", False, dict(n_groups=1, use_bias=True, use_conv_bias=True), id="mamba2-one-group-biases",
                 marks=pytest.mark.proves("Mamba2ForCausalLM", "tensor parallel")),
    pytest.param("bamba", False, dict(mamba_proj_bias=True, attention_bias=True, mlp_bias=True), id="bamba-biases",
                 marks=pytest.mark.proves("BambaForCausalLM", "tensor parallel")),
    pytest.param("bamba", False, dict(mamba_n_groups=1), id="bamba-one-group",
                 marks=pytest.mark.proves("BambaForCausalLM", "tensor parallel")),
    pytest.param("granitemoehybrid", False, {}, id="granitemoehybrid",
                 marks=pytest.mark.proves("GraniteMoeHybridForCausalLM", "tensor parallel")),
    pytest.param("granitemoehybrid-dense-nope", False, {}, id="granitemoehybrid-dense-nope",
                 marks=pytest.mark.proves("GraniteMoeHybridForCausalLM", "tensor parallel")),
    pytest.param("jamba", False, dict(mamba_proj_bias=True), id="jamba-biases",
                 marks=pytest.mark.proves("JambaForCausalLM", "tensor parallel")),
    pytest.param("mamba", False, dict(use_bias=True, use_conv_bias=True), id="mamba-biases",
                 marks=pytest.mark.proves("MambaForCausalLM", "tensor parallel")),
    pytest.param("falcon_h1", False, dict(projectors_bias=True, mlp_bias=True), id="falcon_h1-biases",
                 marks=pytest.mark.proves("FalconH1ForCausalLM", "tensor parallel")),
    pytest.param("falcon_h1_rms_norm", False, dict(mamba_n_groups=1), id="falcon_h1_rms_norm-one-group",
                 marks=pytest.mark.proves("FalconH1ForCausalLM", "tensor parallel")),
    pytest.param("nemotron_h", False, dict(use_bias=True, mlp_bias=True), id="nemotron_h-biases",
                 marks=pytest.mark.proves("NemotronHForCausalLM", "tensor parallel")),
    pytest.param("zamba2", False, {}, id="zamba2",
                 marks=pytest.mark.proves("Zamba2ForCausalLM", "tensor parallel")),
    pytest.param("lfm2", True, {}, id="lfm2",
                 marks=pytest.mark.proves("Lfm2ForCausalLM", "tensor parallel")),
    pytest.param("lfm2_bias", True, {}, id="lfm2_bias",
                 marks=pytest.mark.proves("Lfm2ForCausalLM", "tensor parallel")),
    pytest.param("lfm2_moe", True, {}, id="lfm2_moe",
                 marks=pytest.mark.proves("Lfm2MoeForCausalLM", "tensor parallel")),
    pytest.param("falcon_mamba", True, {}, id="falcon_mamba",
                 marks=pytest.mark.proves("FalconMambaForCausalLM", "tensor parallel")),
    # Gated DeltaNet: one key head per rank, its two value heads with it; the fused projections split by key
    # head; experts and the gated shared expert split along their inner dimension.
    pytest.param("qwen3_next", DELTANET, {}, id="qwen3_next",
                 marks=pytest.mark.proves("Qwen3NextForCausalLM", "tensor parallel")),
    pytest.param("qwen3_5", DELTANET, {}, id="qwen3_5",
                 marks=pytest.mark.proves("Qwen3_5ForCausalLM", "tensor parallel")),
    pytest.param("qwen3_5_moe", DELTANET, {}, id="qwen3_5_moe",
                 marks=pytest.mark.proves("Qwen3_5MoeForCausalLM", "tensor parallel")),
    # Whole-projection q and k norms: their RMS is all-reduced over the ranks.
    pytest.param("olmo_hybrid", DELTANET, {}, id="olmo_hybrid",
                 marks=pytest.mark.proves("OlmoHybridForCausalLM", "tensor parallel")),
]


@pytest.fixture(scope="session")
def checkpoint(tiny_checkpoint, tmp_path_factory, tokenizer_dir):
    built = {}

    def make(name, family, overrides):
        if not family:
            return tiny_checkpoint(name, **overrides)
        key = (name, tuple(sorted(overrides.items())))
        if key not in built:
            directory = tmp_path_factory.mktemp(name)
            build = build_deltanet_model if family == DELTANET else build_family_model
            built[key] = (directory, build(name, directory, tokenizer_dir, **overrides))
        return built[key]

    return make


def run(directory, tp, pages):
    llm = LLM(directory, dtype="float32", tensor_parallel_size=tp, max_model_len=MAX_MODEL_LEN, num_pages=pages,
              max_num_batched_tokens=STEP_TOKENS)
    try:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        cache = llm.engine.cache
        assert cache.num_free_pages == cache.num_pages  # every page back, on every rank's identical plan
        ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
        return [list(o.outputs[0].token_ids) for o in outputs], sum(o.num_preemptions for o in outputs), ids
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("name, family, overrides", CASES)
def test_tp2_tokens_equal_tp1_and_transformers(name, family, overrides, checkpoint):
    directory, hf = checkpoint(name, family, overrides)
    layout = EngineConfig(str(directory), max_model_len=MAX_MODEL_LEN).cache
    pages = layout.pages_per_sequence(MAX_MODEL_LEN)
    for pages in range(pages, pages + 4 if layout.block_size else pages + 1):
        tp1, preemptions_tp1, ids = run(directory, 1, pages)
        if preemptions_tp1:
            break
    tp2, preemptions, _ = run(directory, 2, pages)
    assert state.world_size() == 2
    assert tp2 == tp1
    assert tp1 == [hf_greedy(hf, prompt, NEW_TOKENS) for prompt in ids]
    if layout.block_size:
        assert preemptions == preemptions_tp1 > 0  # attention pages ran out mid-run: requests were recomputed
    assert max(len(i) for i in ids) > STEP_TOKENS  # and prefill was chunked


def test_each_rank_holds_its_shard(tiny_checkpoint):
    """Rank 0's parameters are the checkpoint's, cut along the dimensions the sharding names."""
    directory, hf = tiny_checkpoint("bamba")
    llm = LLM(directory, dtype="float32", tensor_parallel_size=2)
    try:
        model, theirs = llm.engine.runner.model, dict(hf.named_parameters())

        def ours(name):  # a packed linear keeps its weight in oneDNN's layout
            module, _, attribute = name.rpartition(".")
            weight = getattr(model.get_submodule(module), attribute)
            return weight.to_dense() if weight.is_mkldnn else weight

        q, down = "model.layers.1.self_attn.q_proj.weight", "model.layers.0.feed_forward.down_proj.weight"
        assert torch.equal(ours(q), theirs[q][: theirs[q].shape[0] // 2])  # column-parallel: rows
        assert torch.equal(ours(down), theirs[down][:, : theirs[down].shape[1] // 2])  # row-parallel: columns
        embed = "model.embed_tokens.weight"
        assert torch.equal(ours(embed), theirs[embed][: theirs[embed].shape[0] // 2])  # the vocabulary's first half
        # Mamba heads: dt_bias, A_log and D hold this rank's 4 of 8 heads.
        assert torch.equal(ours("model.layers.0.mamba.dt_bias"), theirs["model.layers.0.mamba.dt_bias"][:4])
        # The page pool is laid out from the per-rank shapes `tandem plan --tp 2` prints.
        layout = EngineConfig(str(directory), tensor_parallel_size=2).cache
        assert llm.engine.runner.layout == layout
        assert layout.mamba.shapes != EngineConfig(str(directory)).cache.mamba.shapes
    finally:
        llm.engine.shutdown()


def logprob_table(entries):
    """{token: logprob} per position (None stays None), for comparing within float tolerance."""
    return [None if e is None else {t: lp.logprob for t, lp in e.items()} for e in entries]


def assert_close_tables(ours, theirs):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_prompt_logprobs_and_parallel_samples_equal_one_device(tiny_checkpoint):
    """The step plan's prompt rows and n > 1 samples come back the same from a TP=2 step."""
    directory, _ = tiny_checkpoint("bamba")
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=6, logprobs=2, prompt_logprobs=2)
    runs = []
    for tp in (2, 1):
        llm = LLM(directory, dtype="float32", tensor_parallel_size=tp, max_num_batched_tokens=STEP_TOKENS)
        try:
            runs.append(llm.generate(PROMPTS[:2], params, use_tqdm=False))
        finally:
            llm.engine.shutdown()
    for tp2, tp1 in zip(*runs):
        assert [o.token_ids for o in tp2.outputs] == [o.token_ids for o in tp1.outputs]
        assert_close_tables(logprob_table(tp2.prompt_logprobs), logprob_table(tp1.prompt_logprobs))
        for a, b in zip(tp2.outputs, tp1.outputs):
            assert_close_tables(logprob_table(a.logprobs), logprob_table(b.logprobs))


@pytest.mark.proves("OlmoHybridForCausalLM", "tensor parallel")
def test_olmo_hybrid_one_kv_head_copied_on_both_ranks(checkpoint):
    """OLMo-Hybrid's k norm spans the whole k projection: with its one KV head on both ranks, the all-reduce
    adds its squares twice and the divisor counts them twice. (A pool of its own: the state per rank halves
    while the KV head does not, so TP=1's page count does not carry over.)"""
    directory, hf = checkpoint("olmo_hybrid", DELTANET, dict(num_key_value_heads=1))
    tokens = {}
    for tp in (1, 2):
        llm = LLM(directory, dtype="float32", tensor_parallel_size=tp, max_model_len=MAX_MODEL_LEN,
                  max_num_batched_tokens=STEP_TOKENS)
        try:
            tokens[tp] = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)]
            ids = [llm.get_tokenizer().encode(p) for p in PROMPTS[:2]]
        finally:
            llm.engine.shutdown()
    assert tokens[2] == tokens[1] == [hf_greedy(hf, prompt, NEW_TOKENS) for prompt in ids]
