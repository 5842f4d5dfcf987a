"""A split into stages that cannot work is refused before any process starts (a ValueError; on the command
line one line and exit 2): more stages than decoder layers, or a torchrun group of the wrong size."""

import os
import subprocess
import sys

import pytest
from tp_helpers import my_descendants

from runtime import LLM
from runtime.distributed.stages import LayerCost, plan_stages


def test_more_stages_than_layers_is_refused_before_any_process_starts(tiny_checkpoint):
    directory, _ = tiny_checkpoint("llama")  # two decoder layers
    before = my_descendants()
    with pytest.raises(ValueError) as refused:
        LLM(directory, pipeline_parallel_size=3)
    assert ("pipeline_parallel_size=3 needs at least one decoder layer per stage, but LlamaForCausalLM has 2; use "
            "pipeline_parallel_size=2 or fewer stages") in str(refused.value)
    assert my_descendants() == before


def test_cli_refuses_in_one_line_with_exit_2(tiny_checkpoint):
    directory, _ = tiny_checkpoint("llama")
    result = subprocess.run([sys.executable, "-m", "runtime", "generate", str(directory), "The", "-pp", "3"],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "--pipeline-parallel-size 3 needs at least one decoder layer per stage" in result.stderr
    assert "use --pipeline-parallel-size 2 or fewer stages" in result.stderr


def test_torchrun_group_of_the_wrong_size_is_refused(tiny_checkpoint):
    """torchrun started 3 processes; -pp 2 x -tp 1 needs 2: refused before joining the group."""
    directory, _ = tiny_checkpoint("llama")
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    result = subprocess.run([sys.executable, "-m", "runtime", "generate", str(directory), "The", "-pp", "2"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "torchrun started 3 processes but the engine needs 2 (--tensor-parallel-size x " \
           "--pipeline-parallel-size)" in result.stderr


def cost(kind, weights, attention=0, state=0):
    return LayerCost(kind, weights, attention, state)


def test_planner_balances_weights_and_pages():
    """Eight Mamba layers (heavy weights, one page each) and two attention layers (light weights, eight pages
    a sequence each): an even split by layer count would put both attention layers' pages on one stage."""
    layers = [cost("mamba2", 100, state=1)] * 4 + [cost("attention", 40, attention=8)] * 2 + \
        [cost("mamba2", 100, state=1)] * 4
    stages = plan_stages(layers, 2)
    assert [s.layers for s in stages] == [range(0, 5), range(5, 10)]  # one attention layer on each stage
    assert [s.attention_pages for s in stages] == [8, 8]
    assert sum(s.weight_bytes for s in stages) == 880
    # The embedding on the first stage and the head on the last move the cut.
    heavy_head = plan_stages([cost("mamba2", 100, state=1)] * 4, 2, head_bytes=300)
    assert [len(s.layers) for s in heavy_head] == [1, 3]


def test_a_stage_of_state_layers_only_has_no_attention_pages():
    layers = [cost("attention", 10, attention=8)] + [cost("mamba2", 100, state=1)] * 3
    stages = plan_stages(layers, 2)
    assert stages[0].attention_pages == 8 and stages[1].attention_pages == 0
    assert stages[1].kinds == ("mamba2",) * len(stages[1].layers)
