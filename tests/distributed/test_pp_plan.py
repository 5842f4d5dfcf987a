"""`tandem plan --pp N`: each stage's layers, weight bytes and pages, from the config alone (no weights)."""

import json
import subprocess
import sys
from pathlib import Path

CONFIGS = Path(__file__).parents[2] / "docs" / "configs"


def plan(*args):
    return subprocess.run([sys.executable, "-m", "runtime", "plan", *map(str, args)], capture_output=True, text=True)


def test_stages_cover_the_layers_in_order_and_share_the_weights():
    one = plan(CONFIGS / "ibm-ai-platform__Bamba-9B", "--pp", "4", "--json")
    assert one.returncode == 0, one.stderr
    report = json.loads(one.stdout)
    stages = report["stages"]
    assert [s["first"] for s in stages] == [0] + [s["last"] + 1 for s in stages[:-1]]
    assert stages[-1]["last"] == report["num_layers"] - 1
    attention = [run["first"] for run in report["layers"] if run["kind"] == "attention"]
    assert sum(s["attention_pages"] > 0 for s in stages) == len(attention) == 3  # one attention layer a stage
    weights = [s["weight_bytes"] for s in stages]
    assert max(weights) < 1.5 * min(weights)
    # Per rank with -tp: about half.
    halves = json.loads(plan(CONFIGS / "ibm-ai-platform__Bamba-9B", "--pp", "4", "--tp", "2", "--json").stdout)
    assert abs(sum(s["weight_bytes"] for s in halves["stages"]) * 2 / sum(weights) - 1) < 0.01


def test_text_names_each_stage():
    result = plan(CONFIGS / "nvidia__Nemotron-H-8B-Base-8K", "-pp", "2")
    assert result.returncode == 0, result.stderr
    assert "pipeline parallel 2" in result.stdout
    assert "stage 0      layers 0-" in result.stdout and "stage 1      layers " in result.stdout


def test_more_stages_than_layers_exit_2():
    result = plan(CONFIGS / "state-spaces__mamba-130m-hf", "--pp", "25")
    assert result.returncode == 2
    assert "--pipeline-parallel-size 25 needs at least one decoder layer per stage" in result.stderr


def test_the_docs_show_what_the_command_prints():
    """docs/features/pipeline_parallel.md's plan is the command's own output (it is not a generated region:
    those render without torch, and the planner weighs the layers built on the meta device)."""
    page = (Path(__file__).parents[2] / "docs" / "features" / "pipeline_parallel.md").read_text()
    block = page.split("$ .venv/bin/tandem plan ", 1)[1].split("\n```", 1)[0]
    command, _, shown = block.partition("\n")
    result = plan(*command.split())
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n") == shown
