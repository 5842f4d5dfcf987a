"""bench/pipeline.py runs end to end at toy sizes: the measured PP=2 step (one at a time and with micro-batches in
flight) and the projection beside TP's."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from pipeline import pipeline_traffic  # noqa: E402


def test_pipeline_benchmark_measures_and_projects(tmp_path):
    command = [sys.executable, str(ROOT / "bench" / "pipeline.py"), "--hidden-size", "64", "--layers", "2",
               "--batch", "2", "--steps", "2", "--rounds", "1"]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OMP_NUM_THREADS": "1",
           "TANDEM_CPU_COMPILE": "0"}
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    # Rank 0 sends the hidden states once (2 x 64 float32) and receives the greedy token ids once (2 x int64),
    # not the logits (2 x 320 float32).
    assert "sends    1 (0.5 KiB, the hidden states)" in out.stdout
    assert "receives 1 (16 B, the greedy token ids)" in out.stdout
    # The step timed one step at a time and with two micro-batches in flight, the bubble of each.
    for label in ("one step at a time", "2 micro-batches in flight"):
        assert re.search(label + r" +step \d+\.\d+ ms .* the bubble is \d+% of the step", out.stdout)
    assert re.search(r"load average \d+\.\d before", out.stdout)
    rows = [" ".join(line.split()[:2]) for line in out.stdout.splitlines() if re.search(r"\d+\.\d+ms", line)]
    assert rows == ["PP NVLink", "PP with", "TP NVLink", "PP 100", "PP with", "TP 100"]


def test_traffic_per_decode_step():
    # PP=4, batch 8, Bamba-9B: 3 boundaries of 8 x 4096 bfloat16, then 8 token ids (or 8 x 128256 float32
    # logits) to rank 0.
    assert pipeline_traffic(4, 8, 4096, 128256) == (4, 3 * 8 * 4096 * 2 + 8 * 8)
    assert pipeline_traffic(4, 8, 4096, 128256, logits=True) == (4, 3 * 8 * 4096 * 2 + 8 * 128256 * 4)
    assert pipeline_traffic(1, 8, 4096, 128256) == (0, 0)
