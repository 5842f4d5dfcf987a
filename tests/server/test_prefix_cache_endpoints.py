"""A server with --enable-prefix-caching: vLLM's prefix-cache counters on /metrics, and POST /reset_prefix_cache."""

import httpx
import pytest
from server_helpers import MODEL, SERVER_ARGS, serve


@pytest.fixture(scope="module")
def caching_server(chat_model_dir, tmp_path_factory):
    with serve(chat_model_dir, tmp_path_factory.mktemp("logs") / "server.log", *SERVER_ARGS,
               "--enable-prefix-caching") as running:
        yield running


def complete(server, prompt: list[int]):
    return server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                              extra_body={"ignore_eos": True})


def test_prefix_cache_counters_and_reset(caching_server):
    server = caching_server
    prompt = list(range(3, 3 + 160))  # a few blocks of the tiny hybrid's 48 tokens
    before = server.wait_idle()
    first = complete(server, prompt)
    second = complete(server, prompt)
    after = server.wait_idle()
    assert second.choices[0].text == first.choices[0].text
    queries = after["tandem_prefix_cache_queries_total"] - before["tandem_prefix_cache_queries_total"]
    hits = after["tandem_prefix_cache_hits_total"] - before["tandem_prefix_cache_hits_total"]
    assert queries == 2 * len(prompt)
    assert hits == 144  # the second request resumed from the last block boundary before its last token

    response = httpx.post(f"{server.url}/reset_prefix_cache", timeout=30)
    assert response.status_code == 200
    complete(server, prompt)
    final = server.wait_idle()
    assert final["tandem_prefix_cache_hits_total"] == after["tandem_prefix_cache_hits_total"]
    assert final["tandem_prefix_cache_queries_total"] - after["tandem_prefix_cache_queries_total"] == len(prompt)
