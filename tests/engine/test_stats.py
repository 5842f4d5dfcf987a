"""`Engine.stats()`: the one surface the server reads, with vLLM's meanings."""

from runtime import LLM, SamplingParams
from runtime.config import EngineConfig

PROMPTS = ["The page pool", "A hybrid model mixes attention with", "Numbers like 1, 2, 3", "Each layer"]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def test_stats_count_tokens_requests_latencies_and_batches(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("bamba")[0], dtype="float32")
    before = llm.engine.stats()
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    after = llm.engine.stats()
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert after.generated_tokens - before.generated_tokens == generated == 20 * len(PROMPTS)
    assert after.prompt_tokens - before.prompt_tokens == sum(len(o.prompt_token_ids) for o in outputs)
    assert after.finished.get("length", 0) - before.finished.get("length", 0) == len(PROMPTS)
    # One first token per request, every later token an inter-token gap, one end-to-end latency per request.
    assert after.time_to_first_token.minus(before.time_to_first_token).count == len(PROMPTS)
    assert after.inter_token_latency.minus(before.inter_token_latency).count == generated - len(PROMPTS)
    assert after.e2e_request_latency.minus(before.e2e_request_latency).count == len(PROMPTS)
    steps = after.batch_size.minus(before.batch_size)
    assert steps.count > 0 and steps.cumulative[0] < steps.count  # some steps ran several requests
    assert steps.sum >= len(PROMPTS) * 20  # each request is in at least one step per token
    assert after.num_running == after.num_waiting == after.num_pages_used == 0 and after.kv_cache_usage == 0.0
    assert after.num_pages_total == llm.engine.cache.num_pages


def test_preemptions_are_counted(tiny_checkpoint):
    checkpoint = tiny_checkpoint("llama")[0]
    layout = EngineConfig(str(checkpoint), dtype="float32").cache
    small = LLM(checkpoint, dtype="float32", max_model_len=128, num_pages=2 * layout.pages_per_sequence(128))
    outputs = small.generate(PROMPTS * 2, GREEDY, use_tqdm=False)
    preemptions = sum(o.num_preemptions for o in outputs)
    assert preemptions > 0 and small.engine.stats().num_preemptions == preemptions
