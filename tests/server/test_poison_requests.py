"""One request must never hurt another (issue 13): beside each poison request a victim stream runs, and it
gets exactly its solo tokens; each poison gets its own status code and message; every page comes back."""

import json

import httpx
import pytest
from server_helpers import MAX_MODEL_LEN, MODEL

from runtime import SamplingParams

VICTIM_PROMPT = "A hybrid model mixes attention layers"
VICTIM_TOKENS = 40
COMPLETION = {"model": MODEL, "prompt": "The page pool", "max_tokens": 8}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "What does the page pool hold?"}], "max_tokens": 8}

POISONS = [
    # (id, path, body (a str is sent as it is), status, words the message must contain, param)
    ("temperature 1e-40 is greedy", "/v1/completions", {**COMPLETION, "temperature": 1e-40}, 200, None, None),
    ("top_p 1e-300 keeps the top token", "/v1/completions", {**COMPLETION, "temperature": 1.0, "top_p": 1e-300},
     200, None, None),
    ("min_tokens on a float32 model", "/v1/completions", {**COMPLETION, "min_tokens": 4}, 200, None, None),
    ("min_tokens, chat", "/v1/chat/completions", {**CHAT, "min_tokens": 4, "stream": True}, 200, None, None),
    ("logprobs 5000", "/v1/completions", {**COMPLETION, "logprobs": 5000}, 400,
     "logprobs must be between 0 and 20", "logprobs"),
    ("100,000 stop strings", "/v1/completions", {**COMPLETION, "stop": [f"s{i}" for i in range(100_000)]}, 400,
     "stop: 100000 stop strings, more than the server's limit of 64", "stop"),
    ("a stop string too long", "/v1/completions", {**COMPLETION, "stop": ["x" * 5000]}, 400,
     "stop: a stop string of 5000 characters", "stop"),
    ("a 5 MB prompt", "/v1/completions", {**COMPLETION, "prompt": "page " * 1_000_000}, 400,
     f"prompt: 5000000 characters, more than the {MAX_MODEL_LEN * 16} that can fit", "prompt"),
    ("a 5 MB chat message", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": "page " * 1_000_000}]}, 400,
     "messages: 5000000 characters", "messages"),
    ("a 50 MB body", "/v1/completions", {**COMPLETION, "prompt": "page " * 10_000_000}, 413,
     "larger than the server's limit of 8388608 bytes", None),
    ("2,000 chat messages", "/v1/chat/completions", {**CHAT, "messages": CHAT["messages"] * 2000}, 400,
     "messages: 2000 messages, more than the server's limit of 1024", "messages"),
    ("a lone surrogate in the prompt", "/v1/completions",
     '{"model": "tiny-bamba", "prompt": "The page \\ud800 pool", "max_tokens": 2}', 400,
     "prompt: the text is not valid Unicode", "prompt"),
    ("a lone surrogate in a chat message", "/v1/chat/completions",
     '{"model": "tiny-bamba", "messages": [{"role": "user", "content": "hi \\udc80"}], "max_tokens": 2}', 400,
     "messages.0.content: the text is not valid Unicode", "messages"),
    ("a lone surrogate in a stop string", "/v1/completions",
     '{"model": "tiny-bamba", "prompt": "The page", "stop": ["\\ud83d"], "max_tokens": 2}', 400,
     "stop.0: the text is not valid Unicode", "stop"),
]


def post(server, path, body) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    with httpx.stream("POST", f"{server.url}{path}", content=content, headers={"Content-Type": "application/json"},
                      timeout=120) as response:
        response.read()
    return response


@pytest.fixture(scope="module")
def victim_solo(offline):
    params = SamplingParams(temperature=0, max_tokens=VICTIM_TOKENS, ignore_eos=True)
    return offline.generate(VICTIM_PROMPT, params, use_tqdm=False)[0].outputs[0].text


@pytest.mark.parametrize("path, body, status, words, param", [case[1:] for case in POISONS],
                         ids=[case[0] for case in POISONS])
def test_a_victim_stream_beside_a_poison_request_gets_its_solo_output(server, client, victim_solo, path, body,
                                                                     status, words, param):
    before = server.wait_idle()
    victim = client.completions.create(model=MODEL, prompt=VICTIM_PROMPT, temperature=0, max_tokens=VICTIM_TOKENS,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = iter(victim)
    first = next(chunks).choices[0].text  # the victim is running when the poison arrives
    response = post(server, path, body)
    text = first + "".join(chunk.choices[0].text for chunk in chunks)
    assert text == victim_solo
    assert response.status_code == status, response.text
    if status != 200:
        error = response.json()["error"]
        assert words in error["message"] and error["param"] == param
    after = server.wait_idle()
    assert after["tandem_cache_pages_used"] == 0
    assert after["tandem_requests_failed_total"] == before["tandem_requests_failed_total"]


def test_min_tokens_holds_back_the_stop_token_served(client, offline):
    free = offline.generate("The page pool", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    stop = free.token_ids[0]
    request = dict(model=MODEL, prompt="The page pool", temperature=0, max_tokens=8,
                   extra_body={"ignore_eos": True, "stop_token_ids": [stop]})
    assert client.completions.create(**request).usage.completion_tokens == 1
    banned = client.completions.create(**{**request, "extra_body": {**request["extra_body"], "min_tokens": 4}})
    assert banned.usage.completion_tokens >= 4


def test_temperature_1e_40_gives_the_greedy_tokens(client):
    greedy, tiny = (client.completions.create(model=MODEL, prompt="The page pool", temperature=t, max_tokens=8,
                                              extra_body={"ignore_eos": True}).choices[0].text for t in (0, 1e-40))
    assert tiny == greedy


def test_a_body_without_a_length_is_cut_at_the_limit(server):
    def chunks():
        yield b'{"model": "tiny-bamba", "prompt": "'
        for _ in range(9):
            yield b"x" * 2**20
        yield b'"}'

    response = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=120,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and "larger than the server's limit" in response.json()["error"]["message"]
