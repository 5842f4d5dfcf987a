"""The throughput benchmarks run end to end (at toy sizes here; the real sizes are for bench runs)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_throughput_child_measures_tandem(tmp_path):
    command = [sys.executable, str(ROOT / "bench" / "throughput.py"), "--child", "--engine", "tandem", "--models",
               "hybrid", "--dtypes", "float32", "--prompts", "2", "--input-len", "8", "--output-len", "3",
               "--cache", str(tmp_path), "--threads", "1"]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TANDEM_CPU_COMPILE": "0"}
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result) == {"total_s", "ttft_s", "itl_s", "generated_tokens", "peak_rss_mib"}
    # It measured the workload it was asked for: 2 prompts x 3 tokens, EOS ignored.
    assert result["generated_tokens"] == 2 * 3
    assert 0 < result["ttft_s"] <= result["total_s"] and result["itl_s"] >= 0
    # ru_maxrss is in KiB on Linux: a process that imported torch holds well over 100 MiB, and under 64 GiB.
    assert 100 < result["peak_rss_mib"] < 64 * 1024
