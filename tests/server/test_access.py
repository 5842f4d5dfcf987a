"""A server that asks for an API key, shows its OpenAPI pages only when told to, and closes connections that
do not send a whole request in time (idle, half the headers, half the body)."""

import argparse
import socket
import time

import httpx
import openai
import pytest
from server_helpers import MODEL, SERVER_ARGS, serve

from runtime import serve as serve_command_module

KEY = "flag-key"
ENV_KEY = "env-key"
BEARER = {"Authorization": f"Bearer {KEY}"}
READ_TIMEOUT_S = 1
BIG_PROMPT_CHARS = 1_000_000  # allowed here, so that it is tokenized (for seconds) before it is refused
WAIT_S = 60  # how long a test waits for the server to close a connection: far more than READ_TIMEOUT_S


@pytest.fixture(scope="module")
def guarded(chat_model_dir, tmp_path_factory):
    args = (*SERVER_ARGS, "--api-key", KEY, "--enable-openapi", "--request-read-timeout", str(READ_TIMEOUT_S),
            "--timeout-keep-alive", "1", "--max-prompt-chars", str(BIG_PROMPT_CHARS), "--max-request-bytes", "64MiB")
    # The flag wins over the environment variable.
    with serve(chat_model_dir, tmp_path_factory.mktemp("logs") / "guarded.log", *args,
               env={"TANDEM_API_KEY": ENV_KEY}) as running:
        yield running


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def test_v1_needs_the_api_key(guarded):
    for key in ("wrong", ENV_KEY):
        with pytest.raises(openai.AuthenticationError, match="a valid API key is required") as raised:
            client(guarded, key).completions.create(model=MODEL, prompt="The page pool", max_tokens=2)
        assert raised.value.status_code == 401 and raised.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(guarded, KEY.upper()).models.list()
    response = httpx.post(f"{guarded.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30)
    assert response.status_code == 401
    assert client(guarded, KEY).completions.create(model=MODEL, prompt="The page pool", max_tokens=2).usage
    # Resetting the prefix cache changes the server's state: guarded like /v1.
    assert httpx.post(f"{guarded.url}/reset_prefix_cache", timeout=30).status_code == 401
    assert httpx.post(f"{guarded.url}/reset_prefix_cache", headers=BEARER, timeout=30).status_code == 200


def test_only_the_whole_key_is_accepted(guarded):
    # A key that starts with the server's, or that the server's key starts with, is another key.
    for key in (f"{KEY}anything", f"{KEY}{KEY}", KEY[:-1], f"{KEY} {KEY}"):
        with pytest.raises(openai.AuthenticationError, match="a valid API key is required"):
            client(guarded, key).models.list()
    for header in (f"Bearer {KEY}anything", f"Bearer {KEY[:-1]}", f"Bearer {KEY}\t{KEY}", KEY, f"Basic {KEY}",
                   f"BearerX{KEY}", f"Bearer"):
        response = httpx.get(f"{guarded.url}/v1/models", headers={"Authorization": header}, timeout=30)
        assert response.status_code == 401, header
    assert httpx.get(f"{guarded.url}/v1/models", headers=BEARER, timeout=30).status_code == 200


def test_health_and_metrics_stay_open(guarded):
    assert httpx.get(f"{guarded.url}/health", timeout=30).status_code == 200
    metrics = guarded.metrics()
    assert metrics["http_requests_total:POST /v1/completions 401"] >= 1
    assert metrics["http_requests_total:GET /health 200"] >= 1


def test_the_environment_variable_sets_the_key_when_the_flag_is_absent(monkeypatch):
    monkeypatch.setenv("TANDEM_API_KEY", ENV_KEY)
    assert serve_command_module.api_key(argparse.Namespace(api_key=None)) == ENV_KEY
    assert serve_command_module.api_key(argparse.Namespace(api_key=KEY)) == KEY
    monkeypatch.setenv("TANDEM_API_KEY", " ")
    with pytest.raises(ValueError, match="the API key .* is empty"):
        serve_command_module.api_key(argparse.Namespace(api_key=None))


def test_openapi_pages_only_when_enabled(guarded, server):
    assert httpx.get(f"{guarded.url}/openapi.json", timeout=30).status_code == 401
    assert httpx.get(f"{guarded.url}/openapi.json", headers=BEARER, timeout=30).status_code == 200
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert httpx.get(f"{server.url}{path}", timeout=30).status_code == 404


def test_no_response_shows_a_filesystem_path(server, chat_model_dir):
    for path in ("/v1/models", "/metrics", "/health", "/nothing"):
        text = httpx.get(f"{server.url}{path}", timeout=30).text
        assert str(chat_model_dir.parent) not in text and chat_model_dir.name not in text, (path, text)


def connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=WAIT_S)
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server closes the connection (recv returns b"" or the connection resets)."""
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    finally:
        sock.close()


HEADERS = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
           "Content-Type: application/json\r\nContent-Length: 200\r\n\r\n")


@pytest.mark.parametrize("sent", ["", "POST /v1/completions HTTP/1.1\r\nHost: x\r\n", HEADERS + '{"model": '],
                         ids=["idle", "partial headers", "partial body"])
def test_a_connection_that_does_not_send_its_request_in_time_is_closed(guarded, sent):
    sock = connect(guarded)
    sock.sendall(sent.encode())
    start = time.monotonic()
    assert closed_by_server(sock), f"the server kept the connection open for {WAIT_S} s"
    # (How long it took is not asserted: only that it closed while the test waited.)
    print(f"closed after {time.monotonic() - start:.1f} s")


def test_an_idle_keep_alive_connection_is_closed(guarded):
    sock = connect(guarded)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    assert closed_by_server(sock)


def test_a_slow_stream_that_was_fully_requested_is_not_cut(guarded):
    # A request that arrived whole is being answered: the read deadline does not apply to its response.
    stream = client(guarded, KEY).completions.create(model=MODEL, prompt="The page pool", max_tokens=12, stream=True,
                                                     extra_body={"ignore_eos": True})
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        time.sleep(0.2)  # reads slowly: the whole stream takes longer than the read deadline
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_long_tokenization_stalls_neither_the_streams_nor_the_event_loop(guarded):
    from concurrent.futures import ThreadPoolExecutor

    keyed = client(guarded, KEY)
    victim = keyed.completions.create(model=MODEL, prompt="The page pool", temperature=0, max_tokens=30, stream=True,
                                      extra_body={"ignore_eos": True})
    chunks = iter(victim)
    next(chunks)
    events = []
    with ThreadPoolExecutor(1) as pool:
        # "page " is one token: 1,000,000 of them are far more than max_model_len, found only by tokenizing.
        big = pool.submit(lambda: httpx.post(f"{guarded.url}/v1/completions", timeout=300,
                                             headers={"Authorization": f"Bearer {KEY}"},
                                             json={"model": MODEL, "prompt": "page " * (BIG_PROMPT_CHARS // 5)}))
        assert httpx.get(f"{guarded.url}/health", timeout=300).status_code == 200
        events.append(("health", big.done()))
        finish = [c.choices[0].finish_reason for c in chunks][-1]
        events.append(("victim finished", big.done()))
        response = big.result()
    assert finish == "length"
    assert response.status_code == 400 and "more than fits in max_model_len" in response.json()["error"]["message"]
    # Both answered while the big prompt was still being tokenized.
    assert events == [("health", False), ("victim finished", False)]
