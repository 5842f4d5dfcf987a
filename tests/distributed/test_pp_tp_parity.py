"""Pipeline and tensor parallelism together: PP=2 x TP=2 (four ranks: two stages of two) gives PP=1's and
HF's greedy tokens, with the same batching, chunking and preemption as test_pp_parity.py.

Every architecture on the engine: 94 s for the 18 on a shared two-core machine (four gloo processes;
the module's one group is started once)."""

import pytest
from pp_helpers import LAST_RUN, NEW_TOKENS, STEP_TOKENS, cases, checkpoint, one_device_run_that_preempts, \
    run  # noqa: F401 (checkpoint is a fixture)
from tiny_models import hf_greedy

from runtime.distributed import group, state


@pytest.mark.parametrize("name, family", cases())
def test_pp2_tp2_tokens_equal_pp1_and_transformers(name, family, checkpoint):
    directory, hf = checkpoint(name, family)
    pp1, preemptions_pp1, ids, pages, layout = one_device_run_that_preempts(directory)
    both, preemptions, _ = run(directory, pages, pipeline_parallel_size=2, tensor_parallel_size=2)
    assert state.world_size() == 2  # rank 0's layers all-reduce within its stage of two
    assert both == pp1
    assert pp1 == [hf_greedy(hf, prompt, NEW_TOKENS) for prompt in ids]
    if layout.block_size:
        # attention pages ran out mid-run: requests were recomputed (micro-batches preempt otherwise than one
        # step at a time does, so the counts may differ)
        assert preemptions > 0 and preemptions_pp1 > 0
    # The two stages overlapped micro-batches (a pool without attention pages holds one sequence here).
    assert LAST_RUN["most_in_flight"] == (2 if layout.block_size else 1)
    assert max(len(i) for i in ids) > STEP_TOKENS
