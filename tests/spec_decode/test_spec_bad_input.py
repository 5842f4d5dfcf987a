"""speculative_config errors: one line naming the problem in the spelling used, and `tandem plan`'s lines."""

import json
import os
import subprocess
import sys

import pytest

from runtime import LLM
from runtime.config import EngineConfig
from runtime.config import DEFAULT_MODEL

BAMBA_9B = "docs/configs/ibm-ai-platform__Bamba-9B"
LLAMA_1B = "docs/configs/meta-llama__Llama-3.2-1B"


@pytest.mark.parametrize("value, message", [
    ({"method": "ngram", "num_speculative_tokens": 0}, '"num_speculative_tokens" must be a positive integer, got 0'),
    ({"method": "ngram"}, '"num_speculative_tokens" is required'),
    ({"method": "eagle", "num_speculative_tokens": 2}, "unknown method 'eagle'; the methods are ngram"),
    ({"model": "some/draft", "num_speculative_tokens": 2}, "the draft model some/draft does not exist"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     '"prompt_lookup_min" 4 is more than "prompt_lookup_max" 2'),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown key 'lookahead'"),
    ({"method": "ngram", "num_speculative_tokens": 64}, "leaves no room in max_model_len=64; use at most 63"),
    ("{not json", "not valid JSON"),
    ([1, 2], "must be a JSON object (a dict), got list"),
])
def test_bad_config_is_one_value_error_naming_the_keyword(value, message):
    with pytest.raises(ValueError) as err:
        EngineConfig(str(DEFAULT_MODEL), max_model_len=64, speculative_config=value)
    assert str(err.value).startswith("speculative_config: ")
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_dict_and_its_json_are_the_same_config():
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    a = EngineConfig(str(DEFAULT_MODEL), speculative_config=spec)
    b = EngineConfig(str(DEFAULT_MODEL), speculative_config=json.dumps(spec))
    assert a.speculative == b.speculative
    assert (a.speculative.prompt_lookup_min, a.speculative.prompt_lookup_max) == (1, 5)  # vLLM's defaults


def test_a_pool_without_room_for_the_kept_states_is_refused_at_start_up():
    layout = EngineConfig(str(DEFAULT_MODEL)).cache
    pages = layout.pages_per_sequence(1)
    LLM(num_pages=pages)  # one sequence fits without speculation
    groups = layout.num_state_groups
    with pytest.raises(ValueError, match=rf"the page pool \({pages} pages\) cannot hold a sequence .* and the state "
                                         rf".* keeps after a draft .*\({groups} pages, one per state group; 2 drafts "
                                         rf"keep {2 * groups}\): raise kv_cache_memory or num_pages"):
        LLM(num_pages=pages, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    # Room for one draft's state: a verify drafts what the free pages keep states for.
    LLM(num_pages=pages + groups, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], capture_output=True, text=True, env=env)


def test_cli_error_is_one_line_and_exit_2():
    result = _cli("plan", LLAMA_1B, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": -1}')
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        'tandem plan: error: --speculative-config: "num_speculative_tokens" must be a positive integer, got -1']


def test_generate_refuses_an_unknown_method_in_one_line():
    result = _cli("generate", "--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}', "Hi")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "--speculative-config: unknown method 'medusa'" in result.stderr


def test_plan_prints_the_pages_of_the_kept_states():
    spec = '{"method": "ngram", "num_speculative_tokens": 4}'
    hybrid = _cli("plan", BAMBA_9B, "--speculative-config", spec, "--kv-cache-memory", "8GiB", "--max-model-len", "4096")
    assert hybrid.returncode == 0, hybrid.stderr
    assert "verified as 5 positions in one step" in hybrid.stdout
    # The state after each of the 4 drafts, in each of the 10 state groups.
    assert "40 page ids = 519,045,120 B (495.00 MiB) per verifying sequence (one per state group per draft)" \
        in hybrid.stdout
    # Each sequence counts its kept states: 661 page ids / (18 + 40) = 11 sequences (27 without speculation).
    assert "a sequence of 4,096 tokens needs 58: 11 sequences fit" in hybrid.stdout
    report = json.loads(_cli("plan", BAMBA_9B, "--speculative-config", spec, "--json").stdout)
    assert report["speculative"]["checkpoint_page_ids_per_sequence"] == 40
    attention = _cli("plan", LLAMA_1B, "--speculative-config", spec)
    assert "none: attention alone, a rejected draft's KV is dropped by length" in attention.stdout
