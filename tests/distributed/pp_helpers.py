"""Helpers of the pipeline-parallel tests: the tiny checkpoints of every engine architecture, and one run
that batches, chunks and preempts (as the tensor-parallel parity tests do)."""

from __future__ import annotations

import pytest
from tiny_models import build_deltanet_model, build_family_model

from runtime import LLM, SamplingParams
from runtime.config import EngineConfig

PROMPTS = [
    "A hybrid model mixes attention",
    "The page pool holds attention blocks and Mamba states of equal size. The scheduler batches",
    "The",
    "Every model class declares what it supports and what it caches. Chunked prefill processes a long "
    "prompt over several steps, and the quick brown fox jumps over the lazy dog again and again and again.",
]
NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
MAX_MODEL_LEN = 128
STEP_TOKENS = 16
DELTANET = "deltanet"  # `family` for tiny_models.DELTANET_CONFIGS

# (tiny model, family, architecture): every architecture on the engine, at least once.
ARCHITECTURES = [
    ("llama", False, "LlamaForCausalLM"),
    ("granite", False, "GraniteForCausalLM"),
    ("mamba2", False, "Mamba2ForCausalLM"),
    ("bamba", False, "BambaForCausalLM"),
    ("granitemoehybrid", False, "GraniteMoeHybridForCausalLM"),
    ("granitemoehybrid-dense-nope", False, "GraniteMoeHybridForCausalLM"),  # tied embeddings
    ("jamba", False, "JambaForCausalLM"),
    ("mamba", False, "MambaForCausalLM"),
    ("falcon_h1", False, "FalconH1ForCausalLM"),
    ("nemotron_h", False, "NemotronHForCausalLM"),
    ("zamba2", False, "Zamba2ForCausalLM"),
    ("lfm2", True, "Lfm2ForCausalLM"),
    ("lfm2_moe", True, "Lfm2MoeForCausalLM"),
    ("falcon_mamba", True, "FalconMambaForCausalLM"),
    ("qwen3_next", DELTANET, "Qwen3NextForCausalLM"),
    ("qwen3_5", DELTANET, "Qwen3_5ForCausalLM"),
    ("qwen3_5_moe", DELTANET, "Qwen3_5MoeForCausalLM"),
    ("olmo_hybrid", DELTANET, "OlmoHybridForCausalLM"),
]


def cases() -> list:
    """ARCHITECTURES as test parameters (the `proves` markers are written out where a test claims them)."""
    return [pytest.param(name, family, id=name) for name, family, _ in ARCHITECTURES]


@pytest.fixture(scope="session")
def checkpoint(tiny_checkpoint, tmp_path_factory, tokenizer_dir):
    built = {}

    def make(name, family):
        if not family:
            return tiny_checkpoint(name)
        if name not in built:
            directory = tmp_path_factory.mktemp(name)
            build = build_deltanet_model if family == DELTANET else build_family_model
            built[name] = (directory, build(name, directory, tokenizer_dir))
        return built[name]

    return make


# The last `run`'s most micro-batches in flight at once (runtime.distributed.microbatch; 0 without stages).
LAST_RUN = {"most_in_flight": 0}


def run(directory, pages, microbatches=None, **sizes):
    """Greedy tokens of PROMPTS, the preemptions and the prompts' ids. `microbatches`: the most steps in flight
    through the stages (the engine's default: one per stage)."""
    llm = LLM(directory, dtype="float32", max_model_len=MAX_MODEL_LEN, num_pages=pages,
              max_num_batched_tokens=STEP_TOKENS, **sizes)
    try:
        if microbatches is not None:
            llm.engine.microbatches.depth = microbatches
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        mb = llm.engine.microbatches
        LAST_RUN["most_in_flight"] = mb.most_in_flight if mb is not None else 0
        cache = llm.engine.cache
        assert cache.num_free_pages == cache.num_pages  # every page back
        ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
        return [list(o.outputs[0].token_ids) for o in outputs], sum(o.num_preemptions for o in outputs), ids
    finally:
        llm.engine.shutdown()


def one_device_run_that_preempts(directory):
    """The PP=1 run of the smallest pool that preempts (models with attention), its tokens and the pool."""
    layout = EngineConfig(str(directory), max_model_len=MAX_MODEL_LEN).cache
    pages = layout.pages_per_sequence(MAX_MODEL_LEN)
    for pages in range(pages, pages + 4 if layout.block_size else pages + 1):
        tokens, preemptions, ids = run(directory, pages)
        if preemptions:
            break
    return tokens, preemptions, ids, pages, layout
