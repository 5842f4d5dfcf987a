"""The throughput benchmarks run end to end (at toy sizes here; the real sizes are for bench runs).

vLLM is not installed here: its column is exercised through the table and environment helpers only.
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))

from bench import throughput  # noqa: E402


def run_child(tmp_path, prompts: int) -> dict:
    """One Tandem measurement of the toy hybrid (prompts x 8 tokens in, 3 out), as the report runs it."""
    command = [sys.executable, str(ROOT / "bench" / "throughput.py"), "--child", "--engine", "tandem", "--models",
               "hybrid", "--dtypes", "float32", "--prompts", str(prompts), "--input-len", "8", "--output-len", "3",
               "--cache", str(tmp_path), "--threads", "1"]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TANDEM_CPU_COMPILE": "0"}
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_throughput_child_measures_tandem(tmp_path):
    result = run_child(tmp_path, prompts=2)
    assert set(result) == {"total_s", "prefill_s", "step_s", "generated_tokens", "peak_rss_mib", "model_bytes",
                           "pool_bytes"}
    # It measured the workload it was asked for: 2 prompts x 3 tokens, EOS ignored.
    assert result["generated_tokens"] == 2 * 3
    assert 0 < result["prefill_s"] and 0 < result["total_s"] and result["step_s"] >= 0
    # ru_maxrss is in KiB on Linux: a process that imported torch holds well over 100 MiB, and under 64 GiB.
    assert 100 < result["peak_rss_mib"] < 64 * 1024
    # The toy hybrid's tensors and its pool: some KiB to some MiB each, both held in the process's peak.
    assert 0 < result["model_bytes"] and 0 < result["pool_bytes"]
    assert result["model_bytes"] + result["pool_bytes"] < result["peak_rss_mib"] * 2**20


def test_memory_row_sets_the_peak_against_the_model_and_the_pool():
    result = {"peak_rss_mib": 1150.0, "model_bytes": 800 * 2**20, "pool_bytes": 200 * 2**20}
    assert throughput.memory_row("short", "hybrid-1b", "int8", result) == \
        "| short | hybrid-1b | int8 | 1150 | 800 | 200 | 1.15x |"


def figures(total_s):
    return {"total_s": total_s, "prefill_s": 1.0, "step_s": 0.05, "generated_tokens": 64, "peak_rss_mib": 900.0}


def test_table_compares_tandem_with_each_engine_that_ran():
    with_vllm = {"hf": figures(4.0), "tandem": figures(1.0), "vllm": figures(1.5)}
    row = throughput.table_row("short", "hybrid", "bfloat16", "tandem", with_vllm, 64)
    assert row.endswith("| 4.00x | 1.50x |")
    assert "| 64.0 | 1.00 | 50.0 | 900 |" in row  # gen tok/s, prefill s, decode step ms, peak MiB
    # Without vLLM its ratio cell stays empty, and only Tandem's row carries ratios.
    without = throughput.table_row("short", "hybrid", "bfloat16", "tandem", {"hf": figures(4.0),
                                                                             "tandem": figures(1.0)}, 64)
    assert without.endswith("| 4.00x |  |")
    assert throughput.table_row("short", "hybrid", "bfloat16", "hf", with_vllm, 64).endswith("|  |  |")


def test_vllm_runs_with_its_advised_cpu_settings(tmp_path):
    venv = tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    args = throughput.argparse.Namespace(vllm_python=venv / "bin" / "python", vllm_preload=None, threads=2)
    env = throughput.vllm_environment(args)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["LD_PRELOAD"].split(":")[-1] == str(venv / "lib" / "libiomp5.so")
    assert "PYTHONPATH" not in env  # vLLM imports nothing of ours
    args.vllm_preload = "/x/libtcmalloc_minimal.so.4"
    assert throughput.vllm_environment(args)["LD_PRELOAD"] == "/x/libtcmalloc_minimal.so.4"


def test_repeated_runs_report_each_figures_median_and_each_rounds_ratio():
    runs = [dict(figures(total), prefill_s=prefill, peak_rss_mib=peak)
            for total, prefill, peak in [(3.0, 0.5, 800.0), (1.0, 2.0, 950.0), (2.0, 1.0, 900.0)]]
    median = throughput.median_result(runs)
    # Each figure's own median (the slowest prefill is not in the slowest run), and the largest peak.
    assert median == {"total_s": 2.0, "prefill_s": 1.0, "step_s": 0.05, "peak_rss_mib": 950.0}
    vllm = [figures(3.0), figures(2.0), figures(2.0)]
    line = throughput.round_ratios("short hybrid float32", {"tandem": runs, "vllm": vllm})
    assert line == "- short hybrid float32: Tandem/vllm: 1.00x, 2.00x, 1.00x"


def test_the_report_says_what_vllm_preloads_and_what_it_lacks():
    both = "/x/libtcmalloc_minimal.so.4:/v/lib/libiomp5.so"
    assert throughput.vllm_preload_line(both) == f"vLLM preloads: {both}"
    assert "missing tcmalloc:" in throughput.vllm_preload_line("/v/lib/libiomp5.so")
    assert "missing tcmalloc, iomp5:" in throughput.vllm_preload_line("")


def test_batch1_floor_takes_each_runs_own_bandwidth():
    # 100 MB of weights; three runs at 20 ms a token, the machine's bandwidth dropping from 10 to 5 GB/s.
    runs = [dict(figures(3.0), step_s=0.020, copy_bandwidth=bandwidth) for bandwidth in (10e9, 8e9, 5e9)]
    row = throughput.floor_row("hybrid", "bfloat16", runs, 100 * 10**6)
    # Floors 10, 12.5 and 20 ms: ratios 2.00x, 1.60x, 1.00x, and their median (not the medians' ratio).
    assert row == "| hybrid | bfloat16 | 20.0 | 12.5 | 1.60x | 2.00x, 1.60x, 1.00x |"


def test_batch1_child_measures_bandwidth_after_its_decode(tmp_path):
    result = run_child(tmp_path, prompts=1)
    assert 1e8 < result["copy_bandwidth"] < 1e12  # bytes per second: 0.1 GB/s to 1 TB/s
    # The copy's 512 MiB of buffers came after the peak was read.
    assert result["peak_rss_mib"] < 4 * 1024


def test_llamacpp_rows_name_its_format_and_tandem_gets_the_ratio():
    results = {"tandem": figures(1.0), "llamacpp": figures(2.5)}
    others = ("hf", "vllm", "llamacpp")
    tandem = throughput.table_row("short", "llama-1b", "int8", "tandem", results, 64, others)
    assert tandem.startswith("| short | llama-1b | int8 | tandem |") and tandem.endswith("|  |  | 2.50x |")
    peer = throughput.table_row("short", "llama-1b", "int8", "llamacpp", results, 64, others)
    assert peer.startswith("| short | llama-1b | int8 | llama.cpp Q8_0 | 25.6 |") and peer.endswith("|  |  |  |")
    assert throughput.llamacpp_peer.FORMATS == {"float32": "F32", "bfloat16": "BF16", "int8": "Q8_0",
                                                "int4": "Q4_K_M"}
