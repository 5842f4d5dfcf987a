"""Scripts written the way vLLM's documentation writes offline inference (examples/vllm/), run as they are:
only their import line (`from runtime import ...`) and their model differ from a vLLM script."""

import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
EXAMPLES = ROOT / "examples" / "vllm"


def run(name: str, monkeypatch, capsys) -> str:
    monkeypatch.chdir(ROOT)  # the scripts name the shipped model by its path in the repository
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    return capsys.readouterr().out


def test_the_examples_import_only_the_public_surface():
    for path in sorted(EXAMPLES.glob("*.py")):
        imports = [line for line in path.read_text().splitlines() if re.match(r"(from|import) ", line)]
        assert imports == ["from runtime import LLM, SamplingParams"], path.name


def test_basic(monkeypatch, capsys):
    out = run("basic.py", monkeypatch, capsys)
    lines = out.splitlines()
    assert len(lines) == 4 and lines[1].startswith("Prompt: 'The page pool holds', Generated text: ")


def test_chat(monkeypatch, capsys):
    out = run("chat.py", monkeypatch, capsys)
    prompts = re.findall(r"^Prompt: (.*)$", out, flags=re.M)
    assert len(prompts) == 1 + 10 + 2
    # The shipped tokenizer's template, then the one the script passes.
    assert prompts[0].startswith("'system: You are a helpful assistant\\nuser: Hello\\n")
    assert prompts[-1].startswith("'<system> You are a helpful assistant\\n") and prompts[-1].endswith("<assistant>'")
    assert len(re.findall(r"^Generated text: ", out, flags=re.M)) == 13


def test_logprobs(monkeypatch, capsys):
    out = run("logprobs.py", monkeypatch, capsys)
    assert out.count("Prompt: ") == 2 and out.count("cumulative logprob: ") == 2
    assert len(re.findall(r"^  generated .*; top: ", out, flags=re.M)) == 16
    ranks = [int(r) for r in re.findall(r"^  prompt token .*, rank (\d+)$", out, flags=re.M)]
    assert ranks and all(r >= 1 for r in ranks)


@pytest.mark.parametrize("name", ["n_samples.py"])
def test_n_samples(monkeypatch, capsys, name):
    out = run(name, monkeypatch, capsys)
    samples = re.findall(r"^  sample (\d): ", out, flags=re.M)
    assert samples == ["0", "1", "2", "3"] * 2
