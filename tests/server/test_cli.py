"""`tandem serve` on the command line: option errors exit 2 with one line before anything loads, and
SIGTERM shuts the server down cleanly, finishing or aborting what is in flight."""

import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from server_helpers import ROOT, serve, serve_command

from runtime.config import EngineConfig


def run_serve(model_dir, port, *args):
    return subprocess.run(serve_command(model_dir, port, *args), cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_a_bad_block_size_exits_2_naming_the_minimum(tiny_checkpoint):
    model_dir = tiny_checkpoint("bamba")[0]
    smallest = EngineConfig(str(model_dir)).cache.block_size  # automatic: the smallest valid size
    result = run_serve(model_dir, 0, "--block-size", "8")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert "--block-size 8 is invalid" in result.stderr
    assert f"the smallest valid value is {smallest}" in result.stderr


def test_a_busy_port_exits_2_before_the_model_loads(tiny_checkpoint):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = run_serve(tiny_checkpoint("llama")[0], taken.getsockname()[1])
    assert result.returncode == 2
    assert "cannot listen on 127.0.0.1" in result.stderr and "--port" in result.stderr


def test_a_missing_model_exits_2(tmp_path):
    result = run_serve(tmp_path / "nothing", 0)
    assert result.returncode == 2 and "no config.json" in result.stderr


def test_sigterm_finishes_short_requests_and_aborts_long_ones(tiny_checkpoint, tmp_path):
    model_dir = tiny_checkpoint("mamba2")[0]
    args = ("--dtype", "float32", "--max-model-len", "8192", "--shutdown-timeout", "3")
    with serve(model_dir, tmp_path / "server.log", *args) as server:
        client = server.client()
        name = client.models.list().data[0].id
        short = client.completions.create(model=name, prompt="The page", max_tokens=8, stream=True,
                                          extra_body={"ignore_eos": True})
        long = client.completions.create(model=name, prompt="The page", max_tokens=8000, stream=True,
                                         extra_body={"ignore_eos": True})
        next(iter(long))
        server.proc.send_signal(signal.SIGTERM)
        # Both are read at once: a stream nobody reads cannot end, and would hold the shutdown up.
        with ThreadPoolExecutor(2) as pool:
            short_end, long_end = pool.map(drain, [short, long], timeout=60)
        assert server.proc.wait(timeout=60) == 0
    assert short_end == "length"
    assert isinstance(long_end, openai.APIError) and "shutting down" in str(long_end)
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log, log


def drain(stream):
    """The finish reason of the last chunk, or the error the stream ended with."""
    reason = None
    try:
        for chunk in stream:
            reason = chunk.choices[0].finish_reason if chunk.choices else reason
    except openai.APIError as err:
        return err
    return reason


@pytest.mark.parametrize("option, value", [("--max-waiting", "-1"), ("--port", "70000"), ("--max-stop-strings", "0"),
                                           ("--request-read-timeout", "0"), ("--max-prompt-chars", "-5")])
def test_bad_server_options_exit_2(tiny_checkpoint, option, value):
    result = subprocess.run([sys.executable, "-m", "runtime", "serve", str(tiny_checkpoint("llama")[0]), option, value],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and option in result.stderr
