"""Bad input that used to get through `tandem serve` (issue 31): a 500 for a tiny repetition_penalty or for
constraints that ban every token, `n` without bound and not counted against --max-waiting, a chunked body
read after its 413, and an OpenAPI schema and responses that said otherwise than what is sent."""

import socket
import time
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from server_helpers import MODEL, serve

LONG = 4000  # tokens: the running request outlasts the test


@pytest.fixture(scope="module")
def queue_server(tiny_checkpoint, tmp_path_factory):
    """One running request at most, four waiting sequences, eight choices per prompt; a pure Mamba-2
    checkpoint, whose context is long enough for a request that outlasts the test."""
    args = ("--dtype", "float32", "--max-model-len", str(LONG + 64), "--served-model-name", MODEL,
            "--max-num-seqs", "1", "--max-waiting", "4", "--max-n", "8", "--enable-openapi")
    with serve(tiny_checkpoint("mamba2")[0], tmp_path_factory.mktemp("logs") / "queue_server.log", *args) as running:
        yield running


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("penalty", [1e-38, 1e-45])
def test_a_tiny_repetition_penalty_is_sampled_not_a_500(server, client, stream, penalty):
    before = server.wait_idle()
    response = client.completions.create(model=MODEL, prompt="The page pool", max_tokens=8, temperature=1.0, seed=4,
                                         stream=stream, extra_body={"repetition_penalty": penalty, "ignore_eos": True})
    choices = [chunk.choices[0] for chunk in response if chunk.choices] if stream else response.choices
    assert choices[-1].finish_reason == "length"
    after = server.wait_idle()
    assert after["tandem_requests_failed_total"] == before["tandem_requests_failed_total"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("stream", [False, True])
def test_constraints_that_ban_every_token_are_a_400(client, tokenizer, temperature, stream):
    # The only allowed token is EOS, which min_tokens bans: greedy emitted a token outside allowed_token_ids,
    # sampling failed with a 500.
    with pytest.raises(openai.BadRequestError, match="are all end-of-sequence or stop tokens") as raised:
        client.completions.create(model=MODEL, prompt="The page pool", max_tokens=4, temperature=temperature,
                                  stream=stream,
                                  extra_body={"allowed_token_ids": [tokenizer.eos_token_id], "min_tokens": 1})
    assert raised.value.body["param"] == "allowed_token_ids"


@pytest.mark.parametrize("n", [129, 10_000])
def test_n_above_the_default_max_n_is_a_400(client, n):
    with pytest.raises(openai.BadRequestError, match=f"n: {n} choices, more than the server's limit of 128 "
                                                     r"\(--max-n\)") as raised:
        client.completions.create(model=MODEL, prompt="The page pool", max_tokens=2, n=n)
    assert raised.value.body["param"] == "n"


def test_each_choice_counts_against_max_waiting(queue_server):
    client = queue_server.client()
    with pytest.raises(openai.BadRequestError, match=r"n: 9 choices, more than the server's limit of 8 \(--max-n\)"):
        client.completions.create(model=MODEL, prompt="The page pool", max_tokens=2, n=9)
    with pytest.raises(openai.BadRequestError, match="n: 5 choices, more sequences than may ever wait at once"):
        client.completions.create(model=MODEL, prompt="The page pool", max_tokens=2, n=5)
    request = dict(model=MODEL, prompt="The page pool", max_tokens=LONG, stream=True, extra_body={"ignore_eos": True})
    running = client.completions.create(**request)
    next(iter(running))  # it holds the one running slot
    waiting = client.completions.create(**{**request, "n": 3})  # three sequences wait
    try:
        with pytest.raises(openai.APIStatusError, match=r"waiting queue is full \(4 sequences") as raised:
            client.completions.create(model=MODEL, prompt="The page pool", max_tokens=2, n=2)
        assert raised.value.status_code == 503
        assert queue_server.metrics()["tandem_num_requests_waiting"] == 3
    finally:
        running.close()
        waiting.close()
    assert queue_server.wait_idle()["tandem_cache_pages_used"] == 0


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (or resets it)."""
    received = b""
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            return received
        if not data:
            return received
        received += data


def test_a_chunked_body_over_the_limit_gets_its_413_and_the_connection_closes(server):
    # The body never ends: the server used to read and discard it until the 30 s read deadline.
    url = urlsplit(server.url)
    start = time.monotonic()
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: tandem\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 2**20
        try:
            for _ in range(12):  # past the 8 MiB limit
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except OSError:
            pass  # closed by the server
        received = read_until_closed(sock)
    assert received.startswith(b"HTTP/1.1 413 ") and b"larger than the server's limit" in received
    assert b"connection: close" in received.lower()
    assert time.monotonic() - start < 10


def test_a_wrong_method_gets_405_with_allow(server):
    response = httpx.get(f"{server.url}/v1/completions", timeout=30)
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["error"]["message"] == "Method Not Allowed: GET /v1/completions"


def test_reset_prefix_cache_answers_json(server):
    response = httpx.post(f"{server.url}/reset_prefix_cache", timeout=30)
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    assert response.json() == {"status": "ok"}


def test_the_openapi_schema_says_what_is_sent(queue_server):
    schema = httpx.get(f"{queue_server.url}/openapi.json", timeout=30).json()
    paths = schema["paths"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = paths[path]["post"]["responses"]
        assert "422" not in responses
        assert responses["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    # What the schema says of a bad body is what a bad body gets.
    response = httpx.post(f"{queue_server.url}/v1/completions", json={"model": MODEL}, timeout=30)
    assert response.status_code == 400


def test_a_body_over_the_limit_still_being_sent_gets_its_413_not_a_reset(server):
    # The 413 is answered on the headers alone while the body is still arriving. A socket closed with bytes
    # unread sends a reset at once, and drops what it had not sent yet: the 413's body, often. A race, so
    # several tries.
    url = urlsplit(server.url)
    for _ in range(6):
        with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: tandem\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % (50 * 2**20))
            try:
                for _ in range(8):
                    sock.sendall(b"x" * 2**20)
            except OSError:
                pass  # the server stopped reading
            time.sleep(0.2)  # the 413 has been written and the connection closed by now
            received = read_until_closed(sock)
        assert received.startswith(b"HTTP/1.1 413 "), received[:200]
        assert b"larger than the server's limit" in received, received


def test_a_client_that_keeps_sending_after_its_413_is_cut_off(server):
    # The server drains a refused body only for a while (LINGER_S), so a client cannot hold the socket for ever.
    from runtime.server.connections import LINGER_S

    url = urlsplit(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: tandem\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % (2**40))
        start = time.monotonic()
        with pytest.raises(OSError):
            while time.monotonic() - start < LINGER_S + 20:
                sock.sendall(b"x" * 2**16)
                time.sleep(0.001)
