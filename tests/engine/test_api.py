"""The user-facing surface: prompts as text or token ids, clear errors, nothing leaked."""

import subprocess
import sys

import pytest

from runtime import LLM, RequestOutput, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("bamba")[0], dtype="float32", max_model_len=100)


def test_text_and_token_id_prompts_agree(llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = llm.get_tokenizer().encode("The page pool")
    by_text, by_ids = llm.generate(["The page pool", {"prompt_token_ids": ids}], params, use_tqdm=False)
    assert isinstance(by_text, RequestOutput) and by_text.finished
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids == ids
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.prompt == "The page pool" and by_ids.prompt is None


def test_outputs_come_back_in_prompt_order(llm):
    prompts = [f"Numbers like {i}" for i in range(6)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts


def test_a_prompt_longer_than_the_context_is_refused_before_anything_runs(llm):
    too_long = {"prompt_token_ids": [5] * 100}
    with pytest.raises(ValueError, match="100 tokens, more than fits in max_model_len=100"):
        llm.generate(["The page pool", too_long], use_tqdm=False)
    assert llm.engine.cache.num_free_pages == llm.engine.cache.num_pages
    assert not llm.engine.has_unfinished()


def test_generation_stops_at_max_model_len(llm):
    out = llm.generate({"prompt_token_ids": [5] * 95}, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_bad_prompts(llm):
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([{"prompt_token_ids": [1, 10**6]}], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([{"text": "x"}], use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids: token id 100000 is outside the vocabulary"):
        llm.generate(["The"], SamplingParams(stop_token_ids=[100000]), use_tqdm=False)
    assert llm.engine.cache.num_free_pages == llm.engine.cache.num_pages


def test_unknown_engine_option_is_refused(tiny_checkpoint):
    with pytest.raises(TypeError, match="gpu_memory_utilisation"):
        LLM(tiny_checkpoint("bamba")[0], gpu_memory_utilisation=0.5)


def test_a_pool_too_small_for_one_sequence_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match=r"cannot hold one sequence of 512 tokens \(max_model_len=512\)"):
        LLM(tiny_checkpoint("llama")[0], max_model_len=512, num_pages=4)


def test_an_unsupported_feature_is_refused_with_the_declarations_note(tiny_checkpoint, monkeypatch):
    # Prefix caching (issue 15) and tensor parallelism (issue 16) are supported now: a declaration that
    # still plans tensor parallelism is refused before any worker process starts, with its note.
    from runtime.models.bamba.declaration import BambaForCausalLM
    from runtime.models.common import ON_ENGINE, capabilities
    from runtime.models.interface import supported

    monkeypatch.setattr(BambaForCausalLM, "capabilities", capabilities(ON_ENGINE, chunked_prefill=supported()))
    with pytest.raises(ValueError, match="does not support tensor parallelism .*not split over ranks yet"):
        LLM(tiny_checkpoint("bamba")[0], tensor_parallel_size=2)


def test_generate_command(tiny_checkpoint):
    directory = tiny_checkpoint("llama")[0]
    result = subprocess.run([sys.executable, "-m", "runtime", "generate", str(directory), "The page", "--max-tokens",
                             "5"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    # The command prints the prompt and then exactly the greedy completion the Python API gives.
    expected = LLM(directory).generate(["The page"], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    completion = expected[0].outputs[0]
    assert len(completion.token_ids) == 5 or completion.finish_reason == "stop"
    assert result.stdout == "The page" + completion.text + "\n"


def test_generate_command_error_is_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "runtime", "generate", str(tmp_path), "hi"], capture_output=True,
                            text=True)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "no config.json" in result.stderr
