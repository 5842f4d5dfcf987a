"""lm-evaluation-harness end to end: its `local-completions` model, run as its own command line, against a real
`tandem serve`, on three small tasks this test writes (local JSONL, nothing from a hub): multiple-choice
loglikelihood with --batch_size 4 (several prompts per request, echo, logprobs), loglikelihood_rolling
(perplexity) and generate_until. Every loglikelihood lm-eval logs equals the one HF transformers computes for
the same model and text within 1e-4 (float32), and the generated text is HF's greedy text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sampling_oracle import generate, hf_logits
from server_helpers import MAX_MODEL_LEN, MODEL

from runtime import SamplingParams

MC = [
    {"question": "The page pool holds", "choices": ["attention blocks", "the lazy dog", "numbers like 42"],
     "answer": 0},
    {"question": "A hybrid model mixes attention layers", "choices": ["with state-space layers", "again and again"],
     "answer": 0},
    {"question": "The scheduler batches", "choices": ["prefills and decodes", "Mamba states", "the cache layout",
                                                      "over several steps"], "answer": 0},
    {"question": "Chunked prefill processes", "choices": ["a long prompt", "the small model"], "answer": 1},
]
ROLLING = [
    {"text": "Every model class declares what it supports and what it caches."},
    {"text": "Tandem generates text from the small model that ships with it, again and again."},
]
GENERATE = [
    {"question": "The quick brown fox", "answer": "jumps"},
    {"question": "Numbers like 1, 2, 3", "answer": "42"},
    {"question": "The page pool", "answer": "holds"},
]
MAX_GEN_TOKS = 8

TASKS = {
    "tandem_mc": (MC, """
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
"""),
    "tandem_rolling": (ROLLING, """
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
"""),
    "tandem_generate": (GENERATE, f"""
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {MAX_GEN_TOKS}
  do_sample: false
metric_list:
  - metric: exact_match
"""),
}


def write_tasks(directory: Path) -> None:
    for name, (docs, spec) in TASKS.items():
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
        head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        (directory / f"{name}.yaml").write_text(head + spec)


@pytest.fixture(scope="module")
def samples(server, chat_model_dir, tmp_path_factory) -> dict[str, list[dict]]:
    """lm-eval's logged samples of each task, from one run of its command line."""
    work = tmp_path_factory.mktemp("lm-eval")
    write_tasks(work)
    model_args = ",".join([f"model={MODEL}", f"base_url={server.url}/v1/completions", f"tokenizer={chat_model_dir}",
                           "tokenizer_backend=huggingface", "tokenized_requests=True", f"max_length={MAX_MODEL_LEN}",
                           "num_concurrent=1", "max_retries=1"])
    # Nothing may come from a hub: the datasets are local JSON files and the tokenizer a local directory.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(work / "hf"),
           "TOKENIZERS_PARALLELISM": "false"}
    command = [str(Path(sys.executable).with_name("lm_eval")), "--model", "local-completions",
               "--model_args", model_args, "--tasks", ",".join(TASKS), "--include_path", str(work),
               "--batch_size", "4", "--output_path", str(work / "out"), "--log_samples"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    found = {}
    for name in TASKS:
        [path] = (work / "out").rglob(f"samples_{name}_*.jsonl")
        found[name] = [json.loads(line) for line in path.read_text().splitlines()]
    return found


def encode(tokenizer, text: str) -> list[int]:
    # lm-eval's huggingface backend encodes without special tokens (add_bos_token is off).
    return tokenizer(text, add_special_tokens=False).input_ids


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's documented split: trailing spaces of the context move to the continuation; the whole is
    encoded and the context's tokens cut off its front."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = encode(tokenizer, context + continuation)
    return whole[: len(encode(tokenizer, context))], whole[len(encode(tokenizer, context)):]


def hf_loglikelihood(hf, context: list[int], continuation: list[int]) -> float:
    logprobs = hf_logits(hf, context + continuation).log_softmax(dim=-1)
    return sum(logprobs[len(context) - 1 + i, token].item() for i, token in enumerate(continuation))


@pytest.fixture(scope="module")
def hf(tiny_checkpoint):
    return tiny_checkpoint("bamba")[1]


def test_multiple_choice_loglikelihoods_are_hfs(samples, tokenizer, hf):
    logged = samples["tandem_mc"]
    assert len(logged) == len(MC)
    for sample in logged:
        choices = sample["doc"]["choices"]
        # Logged as {"gen_args_i": {"arg_0": context, "arg_1": continuation}} and [[loglikelihood, is_greedy]]
        # per choice, numbers written as strings.
        arguments = [sample["arguments"][f"gen_args_{i}"] for i in range(len(choices))]
        loglikelihoods = [float(response[0][0]) for response in sample["resps"]]
        assert len(loglikelihoods) == len(choices)
        for argument, loglikelihood in zip(arguments, loglikelihoods):
            context, continuation = argument["arg_0"], argument["arg_1"]
            expected = hf_loglikelihood(hf, *encode_pair(tokenizer, context, continuation))
            assert loglikelihood == pytest.approx(expected, abs=1e-4), (context, continuation)
        # acc is the argmax of those loglikelihoods, as lm-eval scores it.
        best = max(range(len(choices)), key=loglikelihoods.__getitem__)
        assert sample["acc"] == float(best == sample["doc"]["answer"])


def test_rolling_loglikelihoods_are_hfs(samples, tokenizer, hf):
    logged = samples["tandem_rolling"]
    assert len(logged) == len(ROLLING)
    for sample in logged:
        text = sample["doc"]["text"]
        # One window: the whole text, scored after the BOS token (lm-eval's prefix token).
        expected = hf_loglikelihood(hf, [tokenizer.bos_token_id], encode(tokenizer, text))
        assert float(sample["resps"][0][0]) == pytest.approx(expected, abs=1e-4), text


def test_generate_until_is_hfs_greedy_text(samples, tokenizer, hf):
    logged = samples["tandem_generate"]
    assert len(logged) == len(GENERATE)
    for sample in logged:
        context = sample["arguments"]["gen_args_0"]["arg_0"]
        tokens = generate(hf, encode(tokenizer, context), SamplingParams(temperature=0), MAX_GEN_TOKS)
        if tokenizer.eos_token_id in tokens:
            tokens = tokens[: tokens.index(tokenizer.eos_token_id)]
        expected = tokenizer.decode(tokens, skip_special_tokens=True).split("\n")[0]
        assert sample["resps"][0][0] == expected, context
