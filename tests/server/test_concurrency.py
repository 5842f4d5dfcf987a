"""Many clients at once share one engine loop (continuous batching) and each gets its offline tokens."""

import time
from concurrent.futures import ThreadPoolExecutor

from server_helpers import MODEL

from runtime import SamplingParams

NUM_CLIENTS = 32
MAX_TOKENS = 10
DEADLINE_S = 300


def stream_one(client, prompt: str) -> dict:
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS,
                                            stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    return {"text": "".join(c.choices[0].text for c in text_chunks),
            "finish_reason": text_chunks[-1].choices[0].finish_reason,
            "completion_tokens": chunks[-1].usage.completion_tokens}


def test_32_concurrent_streaming_clients_get_their_offline_tokens(server, offline):
    prompts = [f"Numbers like {i}, {i * 7} and {i * 13} appear in the table." for i in range(NUM_CLIENTS)]
    expected = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    client = server.client()
    before = server.wait_idle()
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=NUM_CLIENTS) as pool:
        futures = [pool.submit(stream_one, client, prompt) for prompt in prompts]
        results = [future.result(timeout=max(1.0, DEADLINE_S - (time.monotonic() - start))) for future in futures]
    elapsed = time.monotonic() - start
    for result, reference in zip(results, expected):
        completion = reference.outputs[0]
        assert result == {"text": completion.text, "finish_reason": completion.finish_reason,
                          "completion_tokens": len(completion.token_ids)}
    after = server.wait_idle()
    generated = after["tandem_generation_tokens_total"] - before["tandem_generation_tokens_total"]
    assert generated == sum(len(r.outputs[0].token_ids) for r in expected)
    assert after["tandem_cache_pages_used"] == 0
    # Every engine step records its batch size, so this sees a shared batch however briefly it lasted
    # (polling the running gauge missed it under load).
    steps = after["tandem_step_num_requests_count"] - before["tandem_step_num_requests_count"]
    shared = steps - (after["tandem_step_num_requests_bucket:1.0"] - before["tandem_step_num_requests_bucket:1.0"])
    assert shared > 0, "the requests never ran in one batch"
    print(f"\n{NUM_CLIENTS} streaming clients: {elapsed:.1f} s, {generated:.0f} tokens "
          f"({generated / elapsed:.0f} tokens/s), {shared:.0f} of {steps:.0f} steps ran several requests")
