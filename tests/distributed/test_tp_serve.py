"""`tandem serve MODEL -tp 2` answers the official openai client, and however it ends (SIGTERM, Ctrl-C,
an error at start-up, a normal exit of `tandem generate -tp 2`) no process it started outlives it.

The processes are read from /proc: the server's descendants while it runs (the worker, and
multiprocessing's resource tracker), and the worker ids the group logs at start (`-v`).
"""

import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tp_helpers import alive, descendants

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from server_helpers import ROOT, SERVER_ARGS, serve  # noqa: E402

from runtime import LLM, SamplingParams  # noqa: E402

TP_ARGS = (*SERVER_ARGS, "-tp", "2", "-v")
EXIT_WAIT_S = 30  # how long processes get to go once their parent is gone (no timing is asserted)


def gone(pids: set[int]) -> set[int]:
    """The ids among `pids` still alive once they had their time to exit."""
    deadline = time.monotonic() + EXIT_WAIT_S
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return {pid for pid in pids if alive(pid)}


def worker_pids(log: str) -> set[int]:
    match = re.search(r"tensor parallel: 2 ranks over gloo \(workers ([0-9, ]+)\)", log)
    assert match, log
    return {int(pid) for pid in match.group(1).split(", ")}


PROMPT = "The page pool holds"


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("bamba")[0]


@pytest.fixture(scope="module")
def expected(model_dir):
    """The TP=1 engine's greedy completion of PROMPT (8 tokens)."""
    outputs = LLM(model_dir, dtype="float32").generate([PROMPT], SamplingParams(temperature=0, max_tokens=8),
                                                       use_tqdm=False)
    return outputs[0].outputs[0].text


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_serve_tp2_answers_openai_and_leaves_no_process(model_dir, expected, tmp_path, sig):
    log = tmp_path / "server.log"
    with serve(model_dir, log, *TP_ARGS) as server:
        started = descendants(server.proc.pid)
        workers = worker_pids(log.read_text())
        assert workers <= started
        if sig == signal.SIGTERM:
            completion = server.client().completions.create(model="tiny-bamba", prompt=PROMPT, max_tokens=8,
                                                            temperature=0)
            assert completion.choices[0].text == expected
        assert server.stop(sig) == 0
    assert gone(started) == set()


def test_a_start_up_error_leaves_no_process(model_dir, tmp_path):
    # The pool is too small for one sequence: the engine fails after the worker has loaded its shard.
    result = subprocess.run([sys.executable, "-m", "runtime", "serve", str(model_dir), "--port", "0", *TP_ARGS,
                             "--num-pages", "2"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2
    assert "cannot hold one sequence" in result.stderr
    assert gone(worker_pids(result.stderr)) == set()


def test_generate_tp2_exits_normally_and_leaves_no_process(model_dir, expected):
    result = subprocess.run([sys.executable, "-m", "runtime", "generate", str(model_dir), PROMPT, "--max-tokens", "8",
                             "--dtype", "float32", "-tp", "2", "-v"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout == PROMPT + expected + "\n"
    assert gone(worker_pids(result.stderr)) == set()


def test_the_same_command_runs_under_torchrun(model_dir, expected):
    """torchrun starts both ranks (env://, MASTER_ADDR/MASTER_PORT); rank 0 prints, rank 1 only executes."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                             "127.0.0.1", "--master-port", str(port), "-m", "runtime", "generate", str(model_dir),
                             PROMPT, "--max-tokens", "8", "--dtype", "float32", "-tp", "2"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout == PROMPT + expected + "\n"
