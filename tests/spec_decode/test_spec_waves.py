"""A verify step's rows (runtime/waves.py): decode rows in waves, each sequence's rows sampled in order."""

from runtime import SamplingParams
from runtime.runner import plan_step
from runtime.scheduler import Batch
from runtime.sequence import Sequence
from runtime.waves import decode_waves, row_sequences, wave_rows


def test_waves_hold_the_sequences_that_have_a_row_there():
    assert decode_waves([3, 2, 1]) == [3, 2, 1]
    assert decode_waves([4, 1, 1]) == [3, 1, 1, 1]
    assert decode_waves([1, 1]) == [2]
    assert decode_waves([]) == []
    assert wave_rows([3, 2, 1]) == [[0, 3, 5], [1, 4], [2]]
    assert row_sequences([3, 2, 1]) == [0, 1, 2, 0, 1, 0]


def _decoding(request_id: str, prompt: list[int], output: list[int], drafts: list[int]) -> Sequence:
    seq = Sequence(request_id, prompt, SamplingParams(max_tokens=100))
    seq.output_token_ids = list(output)
    seq.num_computed_tokens = seq.num_tokens - 1
    seq.spec_token_ids = list(drafts)
    seq.state_pages = [50 + int(request_id)]
    seq.checkpoint_pages = [60 + 10 * int(request_id) + i for i in range(len(drafts))]
    seq.block_tables = [[int(request_id)]]
    return seq


def test_a_step_of_verifies_decodes_and_a_prompt_is_laid_out_in_waves():
    short = _decoding("1", [1, 2], [3], [4])  # last token 3, one draft
    plain = _decoding("2", [5, 6], [7], [])  # a decode
    long = _decoding("3", [8], [9, 10], [11, 12])  # last token 10, two drafts
    prompt = Sequence("4", [20, 21, 22], SamplingParams(max_tokens=5))
    prompt.state_pages, prompt.block_tables = [54], [[4]]
    batch = Batch([short, plain, prompt, long], [2, 1, 3, 3])
    plan, sampled, _ = plan_step(batch, num_attention_groups=1, num_state_groups=1)
    assert plan.counts == [3, 2, 1, 3] and plan.num_decodes == 3  # the longest verify first; the prompt last
    # Wave 0: each decode sequence's last token; wave 1: the first drafts; wave 2: the long one's second draft.
    assert plan.input_ids == [10, 3, 7, 11, 4, 12, 20, 21, 22]
    assert plan.positions == [2, 2, 2, 3, 3, 4, 0, 1, 2]
    assert sampled == [long, short, plain, prompt]
    assert plan.logits_indices == [0, 3, 5, 1, 4, 2, 8]  # each sequence's rows in order, then the prompt's last
    assert plan.row_sequences() == [0, 1, 2, 0, 1, 0, 3, 3, 3]
    assert plan.sequence_major_rows() == [0, 3, 5, 1, 4, 2, 6, 7, 8]
    # Each wave reads a sequence's state from one row and writes it to the next: the state after each wave but
    # a sequence's last is kept in the pages it borrowed; its last wave writes its own page.
    assert plan.wave_state_pages == [[[53, 51, 52], [90, 70, 52], [91, 51, 52], [53, 51, 52]]]
