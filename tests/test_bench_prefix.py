"""bench/prefix.py runs end to end at toy sizes: its tables, and its own check that caching changes no token."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_prefix_benchmark_prints_both_tables(tmp_path):
    command = [sys.executable, str(ROOT / "bench" / "prefix.py"), "--requests", "3", "--prefix-len", "256",
               "--suffix-len", "16", "--output-len", "3", "--runs", "1", "--cache", str(tmp_path)]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OMP_NUM_THREADS": "1",
           "TANDEM_CPU_COMPILE": "0"}
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    shared, _, distinct = out.stdout.partition("nothing shared")
    rows = {line.split("|")[1].strip(): line for line in shared.splitlines() if line.startswith("| o")}
    assert set(rows) == {"off", "on", "on, every block"}
    # 3 requests x 272 prompt tokens with caching off; with it, the second wave resumes after the prefix.
    assert "| 816 |" in rows["off"] and "| 816 |" not in rows["on"]
    assert {line.split("|")[1].strip() for line in distinct.splitlines() if line.startswith("| o")} == {"off", "on"}
