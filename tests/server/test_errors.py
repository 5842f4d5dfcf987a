"""Each bad request gets its status code and a message naming the problem, in OpenAI's error shape,
and none of them hurts the server."""

import httpx
import openai
import pytest
from server_helpers import MAX_MODEL_LEN, MODEL

COMPLETION = {"model": MODEL, "prompt": "The page pool", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

CASES = [
    # (id, path, body (a str is sent as it is), status, words the message must contain, param)
    ("invalid JSON", "/v1/completions", '{"model": "tiny-bamba", "prompt": ', 400, "not valid JSON", None),
    ("not an object", "/v1/completions", "[1, 2]", 400, "must be a JSON object", None),
    ("unknown model", "/v1/completions", {**COMPLETION, "model": "gpt-4"}, 404, "'gpt-4' does not exist", "model"),
    ("unknown model, chat", "/v1/chat/completions", {**CHAT, "model": "gpt-4"}, 404, "'gpt-4' does not exist", "model"),
    ("missing model", "/v1/completions", {"prompt": "x"}, 400, "model: Field required", "model"),
    ("prompt too long", "/v1/completions", {**COMPLETION, "prompt": [5] * MAX_MODEL_LEN}, 400,
     f"{MAX_MODEL_LEN} tokens, more than fits in max_model_len={MAX_MODEL_LEN}", None),
    ("empty prompt", "/v1/completions", {**COMPLETION, "prompt": ""}, 400, "the prompt is empty", None),
    ("token id outside the vocabulary", "/v1/completions", {**COMPLETION, "prompt": [1, 10**6]}, 400,
     "outside the vocabulary", None),
    ("negative max_tokens", "/v1/completions", {**COMPLETION, "max_tokens": -3}, 400,
     "max_tokens must be at least 1, got -3", "max_tokens"),
    ("max_tokens not a number", "/v1/completions", {**COMPLETION, "max_tokens": "many"}, 400,
     "max_tokens: Input should be a valid integer", "max_tokens"),
    ("top_p zero", "/v1/completions", {**COMPLETION, "top_p": 0}, 400, "top_p must be in (0, 1]", "top_p"),
    ("top_p above one", "/v1/completions", {**COMPLETION, "top_p": 1.5}, 400, "top_p must be in (0, 1]", "top_p"),
    ("negative temperature", "/v1/completions", {**COMPLETION, "temperature": -0.5}, 400,
     "temperature must be non-negative", "temperature"),
    ("temperature NaN", "/v1/completions", '{"model": "tiny-bamba", "prompt": "x", "temperature": NaN}', 400,
     "temperature: Input should be a finite number", "temperature"),
    ("seed out of range", "/v1/completions", {**COMPLETION, "seed": 2**70}, 400, "seed: Input should be less than",
     "seed"),
    ("stop token outside the vocabulary", "/v1/completions", {**COMPLETION, "stop_token_ids": [10**6]}, 400,
     "stop_token_ids: token id 1000000 is outside the vocabulary", "stop_token_ids"),
    ("negative top_k", "/v1/completions", {**COMPLETION, "top_k": -5}, 400, "top_k must be", "top_k"),
    ("n zero", "/v1/completions", {**COMPLETION, "n": 0}, 400, "n must be at least 1, got 0", "n"),
    ("chat n zero", "/v1/chat/completions", {**CHAT, "n": 0}, 400, "n must be at least 1, got 0", "n"),
    ("too many logprobs", "/v1/completions", {**COMPLETION, "logprobs": 50}, 400, "logprobs must be between 0 and 20",
     "logprobs"),
    ("too many prompt logprobs", "/v1/completions", {**COMPLETION, "prompt_logprobs": 21}, 400,
     "prompt_logprobs must be between 0 and 20", "prompt_logprobs"),
    ("an empty list of prompts", "/v1/completions", {**COMPLETION, "prompt": []}, 400, "prompt is an empty list",
     "prompt"),
    ("max_tokens 0 without echo", "/v1/completions", {**COMPLETION, "max_tokens": 0}, 400,
     "max_tokens must be at least 1, got 0", "max_tokens"),
    ("presence_penalty out of range", "/v1/completions", {**COMPLETION, "presence_penalty": 2.5}, 400,
     "presence_penalty must be in [-2, 2], got 2.5", "presence_penalty"),
    ("chat frequency_penalty out of range", "/v1/chat/completions", {**CHAT, "frequency_penalty": -3}, 400,
     "frequency_penalty must be in [-2, 2]", "frequency_penalty"),
    ("repetition_penalty zero", "/v1/completions", {**COMPLETION, "repetition_penalty": 0}, 400,
     "repetition_penalty must be greater than zero", "repetition_penalty"),
    ("min_p above one", "/v1/chat/completions", {**CHAT, "min_p": 1.5}, 400, "min_p must be in [0, 1]", "min_p"),
    ("min_tokens above max_tokens", "/v1/completions", {**COMPLETION, "min_tokens": 5}, 400,
     "min_tokens must be less than or equal to max_tokens=2", "min_tokens"),
    ("logit_bias outside the vocabulary", "/v1/completions", {**COMPLETION, "logit_bias": {"1000000": 5}}, 400,
     "logit_bias: token id 1000000 is outside the vocabulary", "logit_bias"),
    ("logit_bias key not a token id", "/v1/chat/completions", {**CHAT, "logit_bias": {"hello": 5}}, 400,
     "logit_bias: 'hello' is not a token id", "logit_bias"),
    ("empty allowed_token_ids", "/v1/completions", {**COMPLETION, "allowed_token_ids": []}, 400,
     "allowed_token_ids must not be empty", "allowed_token_ids"),
    ("allowed_token_ids outside the vocabulary", "/v1/chat/completions", {**CHAT, "allowed_token_ids": [3, 10**6]},
     400, "allowed_token_ids: token id 1000000 is outside the vocabulary", "allowed_token_ids"),
    ("stop of the wrong type", "/v1/completions", {**COMPLETION, "stop": 5}, 400, "stop: invalid value 5", "stop"),
    ("chat negative max_completion_tokens", "/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, 400,
     "max_completion_tokens must be at least 1", "max_completion_tokens"),
    ("chat top_logprobs without logprobs", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400,
     "top_logprobs needs logprobs: true", "top_logprobs"),
    ("chat with no messages", "/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages: List should have",
     "messages"),
    ("chat with an unknown role", "/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]},
     400, "messages.0.role", "messages"),
    ("chat prompt too long", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": "The page pool " * MAX_MODEL_LEN}]}, 400,
     "more than fits in max_model_len", None),
    ("unknown path", "/v1/embeddings", COMPLETION, 404, "Not Found: POST /v1/embeddings", None),
]


def post(server, path, body):
    if isinstance(body, str):
        return httpx.post(f"{server.url}{path}", content=body, headers={"Content-Type": "application/json"}, timeout=60)
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


@pytest.mark.parametrize("path, body, status, words, param", [case[1:] for case in CASES],
                         ids=[case[0] for case in CASES])
def test_bad_request(server, path, body, status, words, param):
    response = post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_the_openai_client_raises_with_the_message(client):
    with pytest.raises(openai.NotFoundError, match="does not exist") as raised:
        client.completions.create(model="gpt-4", prompt="x")
    assert raised.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="top_p must be in"):
        client.chat.completions.create(model=MODEL, messages=CHAT["messages"], top_p=2, stream=True)


def test_a_streamed_request_that_is_refused_gets_a_plain_error_not_a_stream(server):
    body = {**COMPLETION, "stream": True, "temperature": -1}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        response.read()
    assert response.status_code == 400 and response.headers["content-type"] == "application/json"


def test_the_server_is_unharmed_by_bad_requests(server, client):
    for _, path, body, *_ in CASES:
        post(server, path, body)
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert client.completions.create(model=MODEL, prompt="The page pool", max_tokens=3).usage.completion_tokens >= 1
    assert server.wait_idle()["tandem_cache_pages_used"] == 0
