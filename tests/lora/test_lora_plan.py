"""`tandem plan --enable-lora --max-loras N --max-lora-rank R` prints the memory the slots take: the bytes the engine
allocates for them, per rank; bad values exit 2 with the option's spelling."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import LLM

ROOT = Path(__file__).parents[2]


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.cli", "plan", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_plan_prints_the_bytes_the_engine_allocates_for_the_slots(tiny_checkpoint):
    directory, _ = tiny_checkpoint("bamba")
    done = plan(str(directory), "--enable-lora", "--max-loras", "3", "--max-lora-rank", "8", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)["lora"]
    llm = LLM(directory, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8)
    manager = llm.engine.runner.lora
    assert report["num_linears"] == len(manager.layers) > 0
    assert report["total_bytes"] == manager.slot_bytes() * 4 == report["bytes_per_slot"] * report["slots"]
    text = plan(str(directory), "--enable-lora", "--max-loras", "3", "--max-lora-rank", "8").stdout
    assert f"lora slots     3 + 1 zero slot of rank 8 on {report['num_linears']} linears: " in text
    per_rank = json.loads(plan(str(directory), "--enable-lora", "--max-loras", "3", "--max-lora-rank", "8", "--tp",
                               "2", "--json").stdout)["lora"]
    assert per_rank["total_bytes"] < report["total_bytes"]
    assert "lora" not in json.loads(plan(str(directory), "--json").stdout)


@pytest.mark.parametrize("flag", ["--max-loras", "--max-lora-rank"])
def test_a_bad_slot_count_exits_2(tiny_checkpoint, flag):
    done = plan(str(tiny_checkpoint("llama")[0]), "--enable-lora", flag, "0")
    assert done.returncode == 2 and flag in done.stderr and "Traceback" not in done.stderr
