"""bench/structured.py runs end to end (at toy sizes here; the real sizes are for bench runs): the decode-step
table and the time-to-first-token table through a real `tandem serve`."""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))

from bench import structured  # noqa: E402
from runtime import StructuredOutputsParams  # noqa: E402


def test_structured_bench_prints_both_tables(tmp_path):
    command = [sys.executable, str(ROOT / "bench" / "structured.py"), "--requests", "2", "--input-len", "8",
               "--steps", "3", "--repeats", "2", "--large-fields", "20", "--threads", "1", "--dtype", "float32",
               "--cache", str(tmp_path)]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TANDEM_CPU_COMPILE": "0"}
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert re.search(r"before: load average [\d.]+, [\d.]+, [\d.]+ on \d+ CPUs", text), text
    assert "| dtype | requests | run | decode step ms | each round ms | constrained/unconstrained |" in text
    # Two rounds: each run's median and each round's figure, and the ratio on the constrained row.
    assert re.search(r"\| float32 \| 2 \| unconstrained \| [\d.]+ \| [\d.]+, [\d.]+ \|  \|", text), text
    assert re.search(r"\| float32 \| 2 \| constrained \| [\d.]+ \| [\d.]+, [\d.]+ \| [\d.]+x \|", text), text
    assert re.search(r"each round's ratio \(its median over steps side by side\): [\d.]+x, [\d.]+x", text), text
    # The constraint held: the random model's output starts a JSON object with the schema's first property.
    sample = ast.literal_eval(re.search(r"a constrained output's first 4 tokens: (.*)", text).group(1))
    assert sample.startswith("{") and '{"name":'.startswith("".join(sample.split())), sample
    assert "| request | time to first token ms | each round ms |" in text
    for row in structured.TTFT_ROWS:
        label = "large schema new (20 fields)" if row == "large schema new" else row
        assert re.search(rf"\| {re.escape(label)} \| [\d.]+ \| [\d.]+, [\d.]+ \|", text), (row, text)
    assert "off the critical path: an unconstrained request sent while a 20-field schema compiles" in text
    assert re.search(r"after: load average .*; total benchmark time \d+ s", text), text


def test_each_new_schema_is_a_grammar_no_cache_holds():
    """The "schema new" row pays a compilation: its schema's cache key differs from every other's, and it is
    as large as the benchmark's schema."""
    keys = {StructuredOutputsParams(json=schema).key
            for schema in (structured.SCHEMA, structured.fresh_schema("a"), structured.fresh_schema("b"))}
    assert len(keys) == 3
    fresh = structured.fresh_schema("a")
    assert len(fresh["properties"]) == len(structured.SCHEMA["properties"]) == 8
    assert fresh["required"] == list(fresh["properties"])
    assert len(structured.large_schema("a", 30)["properties"]) == 30
