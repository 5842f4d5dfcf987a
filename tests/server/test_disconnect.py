"""Clients that leave mid-request have their requests aborted and every page freed at once."""

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_helpers import MAX_MODEL_LEN, MODEL

NUM_CLIENTS = 4
LONG = MAX_MODEL_LEN - 32  # tokens a request would generate if nobody stopped it
CHUNKS_READ = 3


def read_a_little_then_leave(client) -> int:
    stream = client.completions.create(model=MODEL, prompt="The page pool", temperature=0, max_tokens=LONG,
                                       stream=True, extra_body={"ignore_eos": True})
    received = [chunk for chunk, _ in zip(stream, range(CHUNKS_READ))]
    stream.close()  # closes the connection: the server sees the client go
    return len(received)


def assert_idle_with_every_page_free(server, before, num_aborted):
    after = server.wait_idle(timeout=30)
    assert after["tandem_cache_pages_used"] == 0
    assert after["tandem_requests_finished_total:abort"] - before["tandem_requests_finished_total:abort"] == num_aborted
    generated = after["tandem_generation_tokens_total"] - before["tandem_generation_tokens_total"]
    # Had the requests not been aborted, they would have run to LONG tokens each.
    assert generated < num_aborted * LONG, f"{generated} tokens generated: the requests ran to the end"


def greedy_completion(server):
    return server.client().completions.create(model=MODEL, prompt="The", max_tokens=4, temperature=0,
                                              extra_body={"ignore_eos": True})


def test_streaming_clients_that_disconnect_free_their_pages(server):
    reference = greedy_completion(server)
    before = server.wait_idle()
    client = server.client()
    with ThreadPoolExecutor(NUM_CLIENTS) as pool:
        received = list(pool.map(read_a_little_then_leave, [client] * NUM_CLIENTS, timeout=120))
    assert received == [CHUNKS_READ] * NUM_CLIENTS
    assert_idle_with_every_page_free(server, before, NUM_CLIENTS)
    # The server still answers, and the aborted requests left nothing behind that changes an answer.
    after = greedy_completion(server)
    assert after.usage.completion_tokens == 4 and after.choices[0].finish_reason == "length"
    assert after.choices[0].text == reference.choices[0].text


def test_a_non_streaming_client_that_times_out_is_aborted(server):
    body = {"model": MODEL, "prompt": "The page pool", "max_tokens": LONG, "temperature": 0, "ignore_eos": True}
    # The whole completion, timed: the client below gives up after a tenth of it. (A fixed timeout let the
    # request finish first once decode steps were replayed: the shipped model's LONG tokens took under 0.25 s.)
    start = time.perf_counter()
    httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).raise_for_status()
    whole = time.perf_counter() - start
    before = server.wait_idle()
    with pytest.raises(httpx.ReadTimeout):
        # The client gives up long before LONG tokens, and closes its connection.
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=whole / 10))
    assert_idle_with_every_page_free(server, before, 1)
