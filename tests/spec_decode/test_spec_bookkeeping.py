"""Prompt lookup and acceptance, as plain Python (runtime/spec_decode/ngram.py and verify.py)."""

from runtime.spec_decode.ngram import PromptLookup, propose
from runtime.spec_decode.verify import SpecCounters, num_accepted


def test_propose_copies_what_followed_the_latest_match_of_the_longest_suffix():
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3]
    # The suffix [2, 3] last occurred before 5, 6, 7; the longer [x, 2, 3] never recurs.
    assert propose(tokens, 3, 1, 3) == [5, 6, 7]
    assert propose(tokens, 2, 1, 3) == [5, 6]
    # A longer suffix wins over a more recent shorter one.
    assert propose([7, 8, 9, 1, 5, 9, 2, 7, 8, 9], 2, 1, 3) == [1, 5]


def test_propose_finds_nothing_without_a_repeat_or_below_the_minimum():
    assert propose([1, 2, 3, 4, 5], 4, 1, 3) == []
    assert propose([1, 2, 9, 2], 4, 2, 3) == []  # only a 1-gram recurs
    assert propose([1, 2, 9, 2], 4, 1, 3) == [9, 2]
    assert propose([5], 4, 1, 3) == []


def test_propose_stops_at_the_end_of_the_sequence():
    assert propose([4, 4, 4], 5, 1, 2) == [4]  # [4, 4] recurs at 0, followed by one 4


def test_num_accepted_is_the_matching_prefix():
    assert num_accepted([5, 6, 7], [5, 6, 7, 8]) == 3
    assert num_accepted([5, 6, 7], [5, 9, 7, 8]) == 1
    assert num_accepted([5, 6, 7], [1, 6, 7, 8]) == 0


def test_counters_count_drafts_tokens_and_each_position():
    counters = SpecCounters()
    counters.observe(3, 2)
    counters.observe(2, 0)
    counters.observe(4, 4)
    assert (counters.num_drafts, counters.num_draft_tokens, counters.num_accepted_tokens) == (3, 9, 6)
    assert counters.accepted_per_pos == [2, 2, 1, 1]
    assert counters.acceptance_rate == 6 / 9


def brute_force(tokens, k, min_n, max_n):
    """The definition, by slicing: the longest recurring suffix, its latest earlier occurrence."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[len(tokens) - n:]:
                return tokens[start + n:start + n + k]
    return []


def test_propose_equals_the_definition_on_random_sequences():
    import random

    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(rng.randrange(1, 6)) for _ in range(rng.randrange(1, 40))]
        low = rng.randrange(1, 4)
        high, k = rng.randrange(low, 6), rng.randrange(1, 6)
        assert propose(tokens, k, low, high) == brute_force(tokens, k, low, high), (tokens, k, low, high)


def test_a_lookup_kept_between_steps_equals_the_definition_as_its_sequence_grows():
    import random

    rng = random.Random(1)
    for _ in range(200):
        lookup, vocab = PromptLookup(), rng.randrange(1, 8)
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 10))]
        for _ in range(30):  # a step: propose, then the sequence gains a token or a few (accepted drafts)
            low = rng.randrange(1, 4)
            high, k = rng.randrange(low, 6), rng.randrange(1, 6)
            assert lookup.propose(tokens, k, low, high) == brute_force(tokens, k, low, high), tokens
            tokens = tokens + [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]
        shorter = tokens[: len(tokens) // 3]  # not this sequence any more: the lookup starts over
        assert lookup.propose(shorter, 4, 1, 3) == brute_force(shorter, 4, 1, 3)


def test_drafts_that_failed_pause_then_only_the_longest_match_proposes():
    from runtime import SamplingParams
    from runtime.sequence import Sequence
    from runtime.spec_decode.config import SpeculativeConfig
    from runtime.spec_decode.speculator import FIRST_PAUSE, Speculator, _back_off

    config = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)
    speculator = Speculator(config, num_state_groups=0, max_model_len=1000)
    # "7 8" recurs (a 2-gram match); "1 2 3 7 8" does not recur whole
    seq = Sequence("r", [1, 2, 3, 7, 8, 9, 10, 11, 12, 4, 5, 6, 7, 8], SamplingParams(max_tokens=100))
    seq.num_computed_tokens = len(seq.prompt_token_ids)
    speculator.propose([seq])
    assert seq.spec_token_ids == [9, 10, 11, 12]
    _back_off(seq, accepted=0, num_drafts=4)  # the verify kept none
    for _ in range(FIRST_PAUSE):
        speculator.propose([seq])
        assert seq.spec_token_ids == []  # paused
    speculator.propose([seq])
    assert seq.spec_token_ids == []  # a 2-gram match no longer proposes after a failure
    seq.output_token_ids = [9, 10, 11, 12, 4, 5, 6, 7]  # now "5 6 7 8" ... "4 5 6 7" recurs: a 4-gram match
    seq.num_computed_tokens = seq.num_tokens - 1  # all but the last token computed, as after a decode
    speculator.propose([seq])
    assert seq.spec_token_ids == [8, 9, 10, 11]
    _back_off(seq, accepted=4, num_drafts=4)  # a verify that keeps all its drafts ends the probation
    seq.output_token_ids = []
    seq.num_computed_tokens = len(seq.prompt_token_ids)
    speculator.propose([seq])
    assert seq.spec_token_ids == [9, 10, 11, 12]


def test_a_sequence_still_computing_its_tokens_proposes_nothing():
    """After preemption a sequence computes its generated tokens again; drafts follow its last token only."""
    from runtime import SamplingParams
    from runtime.sequence import Sequence
    from runtime.spec_decode.config import SpeculativeConfig
    from runtime.spec_decode.speculator import Speculator

    config = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)
    speculator = Speculator(config, num_state_groups=1, max_model_len=1000)
    seq = Sequence("r", [1, 2, 3, 1, 2], SamplingParams(max_tokens=100))
    seq.output_token_ids = [3, 1, 2]
    seq.num_computed_tokens = 6  # two tokens to compute again
    speculator.propose([seq])
    assert seq.spec_token_ids == []
    seq.num_computed_tokens = 7
    speculator.propose([seq])
    assert seq.spec_token_ids == [3, 1, 2]
