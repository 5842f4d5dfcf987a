"""`tandem plan` names each model's per-sequence state by what it is, not "mamba state" for every kind."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

CONFIGS = Path(__file__).parents[2] / "docs" / "configs"


def plan(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "runtime", "plan", *args], capture_output=True, text=True,
                          check=True).stdout


@pytest.mark.parametrize("config, name, state", [
    # LFM2-700M: one conv state of (conv_L_cache - 1, hidden_size) = (2, 1536), bfloat16.
    ("LiquidAI__LFM2-700M", "short-conv state", "(2, 1536) bfloat16 = 6,144 B"),
    ("ibm-ai-platform__Bamba-9B", "mamba state", "(3, 8448) bfloat16 + (128, 64, 128) bfloat16"),
])
def test_plan_names_the_state_of_each_family(config, name, state):
    args = [str(CONFIGS / config), "--dtype", "bfloat16"]
    lines = [line for line in plan(*args).splitlines() if state in line]
    assert len(lines) == 1 and lines[0].startswith(f"state          {name.removesuffix(' state')}: ")
    assert json.loads(plan(*args, "--json"))["mamba"]["name"] == name
