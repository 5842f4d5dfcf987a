"""/v1/chat/completions: the messages go through the tokenizer's chat template, then the same engine."""

import pytest
from server_helpers import MODEL

from runtime import SamplingParams

MESSAGES = [
    {"role": "system", "content": "You explain caches."},
    {"role": "user", "content": "What does the page pool hold?"},
]


def offline_chat(offline, tokenizer, messages, **params):
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return offline.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, **params), use_tqdm=False)[0]


@pytest.mark.proves("BambaForCausalLM", "engine")
def test_chat_equals_offline_on_the_templated_prompt(client, offline, tokenizer):
    expected = offline_chat(offline, tokenizer, MESSAGES, max_tokens=10)
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=10)
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert response.object == "chat.completion"
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_streamed_chat_equals_offline(client, offline, tokenizer):
    expected = offline_chat(offline, tokenizer, MESSAGES, max_tokens=12, ignore_eos=True)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_completion_tokens=12,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    first, content_chunks, usage_chunk = chunks[0], chunks[1:-1], chunks[-1]
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in content_chunks) == expected.outputs[0].text
    assert content_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12


def test_content_parts_are_joined(client, offline, tokenizer):
    parts = [{"type": "text", "text": "What does the "}, {"type": "text", "text": "page pool hold?"}]
    expected = offline_chat(offline, tokenizer, MESSAGES, max_tokens=6)
    response = client.chat.completions.create(model=MODEL, messages=[MESSAGES[0], {"role": "user", "content": parts}],
                                              temperature=0, max_tokens=6)
    assert response.choices[0].message.content == expected.outputs[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs(client, offline, tokenizer, stream):
    expected = offline_chat(offline, tokenizer, MESSAGES, max_tokens=5, ignore_eos=True, logprobs=3).outputs[0]
    request = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3,
                   extra_body={"ignore_eos": True})
    if stream:
        content = [entry for chunk in client.chat.completions.create(**request, stream=True)
                   if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    else:
        content = client.chat.completions.create(**request).choices[0].logprobs.content
    assert len(content) == 5
    for entry, token_id, step in zip(content, expected.token_ids, expected.logprobs):
        assert entry.logprob == pytest.approx(step[token_id].logprob, abs=1e-4)
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert bytes(entry.bytes).decode("utf-8") == entry.token
