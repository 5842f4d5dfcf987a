"""A sharding that cannot work is refused before any worker process starts, naming the size and the
tensor-parallel sizes that would divide it (a ValueError; on the command line one line and exit 2)."""

import subprocess
import sys

import pytest
import torch
from tiny_models import build_deltanet_model
from tp_helpers import my_descendants

from runtime import LLM


@pytest.mark.parametrize("overrides, tp, message", [
    # The declaration's per-rank cache shapes (what `tandem plan --tp N` computes) refuse it.
    ({}, 3, "num_attention_heads=4 is not divisible by tensor_parallel_size=3; tensor-parallel sizes that divide "
            "it: 1, 2, 4"),
    # The sharding itself, run on the model built on the meta device, refuses what the cache does not see.
    (dict(intermediate_size=95), 2, "intermediate_size=95 is not divisible by tensor_parallel_size=2; "
                                    "tensor-parallel sizes that divide it: 1, 5, 19, 95"),
    (dict(vocab_size=321), 2, "vocab_size=321 is not divisible by tensor_parallel_size=2; "
                              "tensor-parallel sizes that divide it: 1, 3, 107, 321"),
    # Three KV heads cannot be split over two ranks.
    (dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3), 2,
     "num_key_value_heads=3 is not divisible by tensor_parallel_size=2; tensor-parallel sizes that divide it: 1, 3"),
], ids=["heads", "intermediate", "vocabulary", "kv-heads"])
def test_impossible_sharding_is_refused_before_any_process_starts(tiny_checkpoint, overrides, tp, message):
    directory, _ = tiny_checkpoint("llama", **overrides)
    before = my_descendants()
    with pytest.raises(ValueError) as refused:
        LLM(directory, tensor_parallel_size=tp)
    assert message in str(refused.value)
    assert my_descendants() == before


def test_cli_refuses_in_one_line_with_exit_2(tiny_checkpoint):
    directory, _ = tiny_checkpoint("llama")
    result = subprocess.run([sys.executable, "-m", "runtime", "generate", str(directory), "The", "-tp", "3"],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "num_attention_heads=4 is not divisible by --tensor-parallel-size 3" in result.stderr
    assert "1, 2, 4" in result.stderr


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has a GPU per rank")
def test_more_ranks_than_gpus_is_refused_before_any_process_starts(tiny_checkpoint):
    directory, _ = tiny_checkpoint("llama")
    before = my_descendants()
    with pytest.raises(ValueError, match=f"tensor_parallel_size=2 needs 2 GPUs .* has {torch.cuda.device_count()}"):
        LLM(directory, tensor_parallel_size=2, device="cuda")
    assert my_descendants() == before


def test_gated_deltanet_key_heads_that_do_not_divide_are_refused(tmp_path, tokenizer_dir):
    """One Gated DeltaNet key head (its two value heads would split, the key head cannot): the declaration's
    per-rank state shapes refuse it before any worker starts."""
    build_deltanet_model("qwen3_5", tmp_path, tokenizer_dir, linear_num_key_heads=1, linear_num_value_heads=2)
    before = my_descendants()
    with pytest.raises(ValueError) as refused:
        LLM(tmp_path, tensor_parallel_size=2)
    assert ("linear_num_key_heads=1 is not divisible by tensor_parallel_size=2; tensor-parallel sizes that divide "
            "it: 1") in str(refused.value)
    assert my_descendants() == before
