"""A second server, on a pure Mamba-2 checkpoint without a chat template, one running request at most and
one waiting: the chat endpoint refuses with 400 and a full waiting queue answers 503."""

import httpx
import openai
import pytest
from server_helpers import serve

LONG = 4000  # tokens: far more than the test takes to run, so the first request is still running at the end


@pytest.fixture(scope="module")
def small_server(tiny_checkpoint, tmp_path_factory):
    model_dir = tiny_checkpoint("mamba2")[0]
    args = ("--dtype", "float32", "--max-model-len", str(LONG + 64), "--max-num-seqs", "1", "--max-waiting", "1")
    with serve(model_dir, tmp_path_factory.mktemp("logs") / "small_server.log", *args) as running:
        yield running


def model_name(server) -> str:
    return httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]


def test_the_served_name_defaults_to_the_model_directory(small_server, tiny_checkpoint):
    assert model_name(small_server) == tiny_checkpoint("mamba2")[0].name


def test_chat_without_a_chat_template_is_a_400(small_server):
    with pytest.raises(openai.BadRequestError, match="has no chat template") as raised:
        small_server.client().chat.completions.create(model=model_name(small_server),
                                                      messages=[{"role": "user", "content": "hi"}])
    assert "--chat-template" in raised.value.message


def test_a_full_waiting_queue_is_a_503(small_server):
    client, name = small_server.client(), model_name(small_server)
    before = small_server.wait_idle()
    request = dict(model=name, prompt="The page pool", max_tokens=LONG, stream=True, extra_body={"ignore_eos": True})
    running = client.completions.create(**request)
    next(iter(running))  # it produced a token, so it holds the one running slot
    waiting = client.completions.create(**request)  # accepted: it waits for the slot
    try:
        with pytest.raises(openai.APIStatusError, match="waiting queue is full") as raised:
            client.completions.create(model=name, prompt="The page pool", max_tokens=2)
        assert raised.value.status_code == 503
        assert raised.value.body["code"] == "queue_full" and raised.value.body["type"] == "server_error"
        metrics = small_server.metrics()
        assert metrics["tandem_num_requests_running"] == 1 and metrics["tandem_num_requests_waiting"] == 1
        assert metrics["tandem_requests_rejected_total"] - before["tandem_requests_rejected_total"] == 1
    finally:
        running.close()
        waiting.close()
    after = small_server.wait_idle()
    assert after["tandem_cache_pages_used"] == 0
    assert client.completions.create(model=name, prompt="The page pool", max_tokens=2).usage.completion_tokens >= 1
