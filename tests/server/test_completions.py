"""/v1/completions through the openai client: the same tokens as offline `LLM.generate`, whole or streamed."""

import httpx
import pytest
from server_helpers import MODEL

from runtime import SamplingParams

PROMPTS = ["The page pool", "A hybrid model mixes attention layers", "Numbers like 1, 2, 3"]


def offline_completion(offline, prompt, **params):
    return offline.generate(prompt, SamplingParams(temperature=0, **params), use_tqdm=False)[0]


@pytest.mark.proves("BambaForCausalLM", "engine")
@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_equals_offline(client, offline, prompt):
    expected = offline_completion(offline, prompt, max_tokens=12)
    response = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12)
    choice = response.choices[0]
    assert choice.text == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert response.model == MODEL and response.object == "text_completion"
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_streamed_deltas_concatenate_to_the_offline_text(client, offline):
    expected = offline_completion(offline, PROMPTS[1], max_tokens=16, ignore_eos=True)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[1], temperature=0, max_tokens=16, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == expected.outputs[0].text
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * (len(text_chunks) - 1) + ["length"]
    assert len(text_chunks) > 1, "the completion came in one piece: it was not streamed"
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 16
    assert all(c.usage is None for c in text_chunks)


def test_the_event_stream_is_sse_and_ends_with_done(server):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]" and len(events) >= 3


def test_token_id_prompt_equals_text_prompt(client, offline, tokenizer):
    ids = tokenizer.encode(PROMPTS[0])
    expected = offline_completion(offline, PROMPTS[0], max_tokens=8, ignore_eos=True)
    response = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=8,
                                         extra_body={"ignore_eos": True})
    assert response.choices[0].text == expected.outputs[0].text
    assert response.usage.prompt_tokens == len(ids)


def test_stop_string_cuts_the_text_whole_and_streamed(client, offline):
    full = offline_completion(offline, PROMPTS[2], max_tokens=16, ignore_eos=True).outputs[0].text
    stop = full[6:8]
    expected = offline_completion(offline, PROMPTS[2], max_tokens=16, ignore_eos=True, stop=[stop]).outputs[0]
    assert expected.finish_reason == "stop" and len(expected.text) < len(full)
    request = dict(model=MODEL, prompt=PROMPTS[2], temperature=0, max_tokens=16, stop=[stop],
                   extra_body={"ignore_eos": True})
    whole = client.completions.create(**request).choices[0]
    streamed = list(client.completions.create(**request, stream=True))
    assert whole.text == expected.text and whole.finish_reason == "stop"
    # Text that might begin the stop string is held back, so nothing streamed is cut later.
    assert "".join(c.choices[0].text for c in streamed) == expected.text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_logprobs_match_the_offline_ones(client, offline):
    expected = offline_completion(offline, PROMPTS[0], max_tokens=6, ignore_eos=True, logprobs=2).outputs[0]
    choice = client.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0, max_tokens=6, logprobs=2,
                                       extra_body={"ignore_eos": True}).choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    for token_id, step, served, top in zip(expected.token_ids, expected.logprobs, logprobs.token_logprobs,
                                           logprobs.top_logprobs):
        assert served == pytest.approx(step[token_id].logprob, abs=1e-4)
        assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(served, abs=1e-4)  # greedy: the top one
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]


def test_sampling_with_a_seed_repeats(client):
    request = dict(model=MODEL, prompt=PROMPTS[0], temperature=1.0, top_p=0.9, max_tokens=8, seed=1234,
                   extra_body={"top_k": 50})
    first, second = (client.completions.create(**request).choices[0].text for _ in range(2))
    assert first == second
