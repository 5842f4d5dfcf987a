"""Micro-batches in flight through the stages (runtime/distributed/microbatch.py): at PP=2 rank 0 keeps two
steps in flight, on disjoint halves of the sequences, and the tokens equal one device's; one step at a time
(depth 1) gives the same tokens; a request aborted while its step is in flight is dropped when the step lands,
its pages already serving another request; a stage that dies with a micro-batch in flight ends the engine
with an error naming it. (test_pp_parity.py and test_pp_tp_parity.py run every
architecture with micro-batches in flight, batching, chunking and preempting.)"""

import os
import signal
import time
from pathlib import Path

import pytest
from pp_helpers import GREEDY, LAST_RUN, MAX_MODEL_LEN, PROMPTS, STEP_TOKENS, checkpoint, \
    one_device_run_that_preempts, run  # noqa: F401 (checkpoint is a fixture)
from test_tp_serve import gone
from tp_helpers import alive, my_descendants

from runtime import LLM, SamplingParams
from runtime.distributed import group


def engine(directory, pp, **options):
    llm = LLM(directory, dtype="float32", pipeline_parallel_size=pp, max_model_len=MAX_MODEL_LEN,
              max_num_batched_tokens=STEP_TOKENS, **options)
    return llm.engine


@pytest.mark.parametrize("name", ["bamba", "llama"])
def test_one_step_at_a_time_gives_the_same_tokens(name, tiny_checkpoint):
    directory, _ = tiny_checkpoint(name)
    pp1, _, _, pages, _ = one_device_run_that_preempts(directory)
    assert run(directory, pages, microbatches=1, pipeline_parallel_size=2)[0] == pp1
    assert LAST_RUN["most_in_flight"] == 1
    assert run(directory, pages, pipeline_parallel_size=2)[0] == pp1
    assert LAST_RUN["most_in_flight"] == 2


def test_a_mamba_only_model_overlaps_when_its_pool_holds_the_sequences(tiny_checkpoint):
    """Mamba (a state page per sequence, no attention): with pages for every prompt, the four sequences split
    into two micro-batches of two, always disjoint, and give one device's tokens."""
    directory, _ = tiny_checkpoint("mamba")
    expected = [list(o.outputs[0].token_ids) for o in
                LLM(directory, dtype="float32", max_model_len=MAX_MODEL_LEN,
                    max_num_batched_tokens=STEP_TOKENS).generate(PROMPTS, GREEDY, use_tqdm=False)]
    pp2 = engine(directory, 2)
    try:
        ids = [pp2.add_request(p, GREEDY) for p in PROMPTS]
        outputs, in_flight = {}, []
        while pp2.has_unfinished():
            outputs.update((o.request_id, o) for o in pp2.step())
            in_flight.append([seq.request_id for batch, _ in pp2.microbatches.flights for seq in batch.seqs])
        assert [list(outputs[i].outputs[0].token_ids) for i in ids] == expected
        assert pp2.microbatches.most_in_flight == 2
        # Between steps one micro-batch is in flight: half the sequences while all four decode.
        assert max(len(busy) for busy in in_flight) == 2
        assert pp2.cache.num_free_pages == pp2.cache.num_pages
    finally:
        pp2.shutdown()


def test_a_request_aborted_in_flight_is_dropped_when_its_step_lands(tiny_checkpoint):
    """Abort a request whose step is in flight, and add one that takes its freed pages in the next micro-batch
    while that step is still in flight: the aborted one gets no token and no output, the others give one
    device's tokens, and every page comes back."""
    directory, _ = tiny_checkpoint("bamba")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = ["A hybrid model mixes attention", "The", "Every model class", "A late request takes the pages"]
    reference = LLM(directory, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=STEP_TOKENS)
    expected = [list(o.outputs[0].token_ids) for o in reference.generate(prompts, params, use_tqdm=False)]
    pp2 = engine(directory, 2)
    try:
        ids = [pp2.add_request(p, params) for p in prompts[:3]]
        outputs, flights = {}, pp2.microbatches.flights

        def decoding_pair_in_flight():  # two of the three in flight, the third decoding
            return (flights and len(flights[0][0].seqs) == 2
                    and all(s.output_token_ids for s in pp2.scheduler.running))

        while not decoding_pair_in_flight():
            outputs.update((o.request_id, o) for o in pp2.step())
        victim = flights[0][0].seqs[0]
        generated = list(victim.output_token_ids)
        pages = {p for table in victim.block_tables for p in table} | set(victim.state_pages)
        pp2.abort(victim.request_id)
        ids.append(pp2.add_request(prompts[3], params))
        outputs.update((o.request_id, o) for o in pp2.step())  # the late request starts, then the victim's lands
        late = pp2._seqs[ids[-1]]
        assert pages & ({p for table in late.block_tables for p in table} | set(late.state_pages))
        while pp2.has_unfinished():
            outputs.update((o.request_id, o) for o in pp2.step())
        assert victim.request_id not in outputs and victim.output_token_ids == generated
        survivors = [i for i in ids if i != victim.request_id]
        want = [e for i, e in zip(ids, expected) if i != victim.request_id]
        assert [list(outputs[i].outputs[0].token_ids) for i in survivors] == want
        assert pp2.stats().finished == {"abort": 1, "length": 3}
        assert pp2.cache.num_free_pages == pp2.cache.num_pages
    finally:
        pp2.shutdown()


def test_a_stage_that_dies_with_micro_batches_in_flight_ends_the_engine(tiny_checkpoint):
    """Stage 1 killed while a micro-batch is in flight (and the next posted to it): the step that waits for its
    logits raises an error naming the rank, and no process of the group is left (run last: the group goes)."""
    directory, _ = tiny_checkpoint("bamba")
    before = my_descendants()
    pp2 = engine(directory, 2)
    for prompt in PROMPTS:
        pp2.add_request(prompt, GREEDY)
    while not pp2.microbatches.flights:
        pp2.step()
    worker = group.current().processes[0]
    os.kill(worker.pid, signal.SIGKILL)
    while alive(worker.pid):
        time.sleep(0.05)
    with pytest.raises(RuntimeError, match=rf"lost rank 1 \(stage 1, pid {worker.pid}, exit code -9\)"):
        while pp2.has_unfinished():
            pp2.step()
    assert group.current() is None
    pp2.shutdown()  # nothing left to do
    left = gone(my_descendants() - before)
    assert all(b"resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in left), left
