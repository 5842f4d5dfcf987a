"""`tandem plan --enable-prefix-caching` explains the prefix block and the memory of a state snapshot."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parents[2] / "docs" / "configs"


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime", "plan", *args], capture_output=True, text=True)


@pytest.mark.parametrize("fixture, args, block, snapshot_ids, snapshot_bytes", [
    # Bamba-9B bf16: 768-token blocks; 29 Mamba layers in groups of 3 -> 10 state groups x 9 MiB page ids
    ("ibm-ai-platform__Bamba-9B", ["--dtype", "bfloat16"], 768, 10, 10 * 3 * 3_145_728),
    # Mamba-2 130M: no attention, so the block is the chunk size (256); 24 layers in one group
    ("state-spaces__mamba2-130m", [], 256, 1, 24 * 807_936),
    # Mamba-1: no chunk size, so the block is the attention alignment (16)
    ("state-spaces__mamba-130m-hf", [], 16, 1, None),
    # Llama: the attention block, no state to snapshot
    ("meta-llama__Llama-3.2-1B", [], 16, 0, 0),
])
def test_plan_explains_prefix_caching(fixture, args, block, snapshot_ids, snapshot_bytes):
    result = plan(str(FIXTURES / fixture), *args, "--enable-prefix-caching", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    cache = report["prefix_cache"]
    assert (cache["block_size"], cache["snapshot_page_ids"]) == (block, snapshot_ids)
    assert cache["snapshot_bytes"] == snapshot_ids * report["bytes_per_page_id"]
    if snapshot_bytes is not None:
        assert cache["snapshot_bytes"] == snapshot_bytes
    text = plan(str(FIXTURES / fixture), *args, "--enable-prefix-caching").stdout
    assert f"prefix cache   blocks of {block} tokens" in text
    assert ("snapshot" in text) == bool(snapshot_ids)


def test_without_prefix_caching_the_plan_says_nothing_of_it():
    result = plan(str(FIXTURES / "ibm-ai-platform__Bamba-9B"), "--json")
    assert "prefix_cache" not in json.loads(result.stdout)
