"""`tandem serve MODEL -pp 2` answers the official openai client (streaming too); however it ends (SIGTERM,
Ctrl-C, an error at start-up) no process it started outlives it; a stage that dies mid-run ends the engine
with an error naming it, and the other ranks are stopped."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_tp_serve import gone, worker_pids
from tp_helpers import alive, descendants, my_descendants

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from server_helpers import ROOT, SERVER_ARGS, serve  # noqa: E402

from runtime import LLM, SamplingParams  # noqa: E402
from runtime.distributed import group  # noqa: E402

PP_ARGS = (*SERVER_ARGS, "-pp", "2", "-v")
PROMPT = "The page pool holds"


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("bamba")[0]


@pytest.fixture(scope="module")
def expected(model_dir):
    """One device's greedy completion of PROMPT (8 tokens)."""
    outputs = LLM(model_dir, dtype="float32").generate([PROMPT], SamplingParams(temperature=0, max_tokens=8),
                                                       use_tqdm=False)
    return outputs[0].outputs[0].text


@pytest.mark.proves("BambaForCausalLM", "pipeline parallel")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_serve_pp2_answers_openai_and_leaves_no_process(model_dir, expected, tmp_path, sig):
    log = tmp_path / "server.log"
    with serve(model_dir, log, *PP_ARGS) as server:
        started = descendants(server.proc.pid)
        workers = worker_pids(log.read_text())
        assert workers <= started
        if sig == signal.SIGTERM:
            client = server.client()
            completion = client.completions.create(model="tiny-bamba", prompt=PROMPT, max_tokens=8, temperature=0)
            assert completion.choices[0].text == expected
            stream = client.completions.create(model="tiny-bamba", prompt=PROMPT, max_tokens=8, temperature=0,
                                               stream=True)
            pieces = [chunk.choices[0].text for chunk in stream if chunk.choices]
            assert len(pieces) > 1 and "".join(pieces) == expected
        assert server.stop(sig) == 0
    assert gone(started) == set()


def test_a_start_up_error_leaves_no_process(model_dir):
    # The pool is too small for one sequence: the engine fails after the worker has loaded its stage.
    result = subprocess.run([sys.executable, "-m", "runtime", "serve", str(model_dir), "--port", "0", *PP_ARGS,
                             "--num-pages", "2"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2
    assert "cannot hold one sequence" in result.stderr
    assert gone(worker_pids(result.stderr)) == set()


def test_a_stage_that_dies_ends_the_engine_with_a_clear_error(model_dir):
    before = my_descendants()
    llm = LLM(model_dir, dtype="float32", pipeline_parallel_size=2)
    worker = group.current().processes[0]
    os.kill(worker.pid, signal.SIGKILL)
    while alive(worker.pid):
        time.sleep(0.05)
    with pytest.raises(RuntimeError, match=rf"lost rank 1 \(stage 1, pid {worker.pid}, exit code -9\)"):
        llm.generate([PROMPT], SamplingParams(max_tokens=4), use_tqdm=False)
    assert group.current() is None  # the group is stopped: nothing of it is left running
    llm.engine.shutdown()  # and the engine's own shutdown has nothing left to do
    left = gone(my_descendants() - before)
    # multiprocessing's resource tracker, started with the first spawned process, stays for this one's life.
    assert all(b"resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in left), left
