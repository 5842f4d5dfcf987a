"""`tandem generate [MODEL] PROMPT...`: which first argument is the model, by one rule that --help and the
docs state the same way (runtime.generate.MODEL_RULE). Each case runs `tandem` in a subprocess."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.generate import MODEL_RULE

ROOT = Path(__file__).parents[2]


def generate(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime", "generate", *args, "--max-tokens", "1"], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("path", ["./no/such/model", "missing-dir/", "../no-such-model", "/no/such/model",
                                  "~/no-such-tandem-model"])
def test_a_path_that_is_no_directory_is_an_error_naming_it(tmp_path, path):
    result = generate(path, "Hi", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr == f"tandem generate: error: no model directory {path}: give an existing one, or pass the " \
                            "model with --model DIR to use this argument as a prompt\n"
    assert result.stdout == ""


@pytest.mark.parametrize("first", ["and/or", "input/output", "ibm-granite/granite-4.0-h-tiny"])
def test_anything_else_is_a_prompt_for_the_shipped_model(tmp_path, first):
    result = generate(first, "x", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(first) and "\n\nx" in result.stdout, result.stdout


def test_an_existing_directory_is_the_model_and_model_makes_every_argument_a_prompt(tmp_path):
    model = tmp_path / "model"
    model.mkdir()  # a directory, so the model: it has no config.json, which the engine says
    result = generate(str(model), "Hi")
    assert result.returncode == 2 and f"no config.json at {model / 'config.json'}" in result.stderr, result.stderr
    shipped = str(ROOT / "runtime/default_model")
    result = generate("--model", shipped, "./no/such/model", "/etc is where")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("./no/such/model") and "\n\n/etc is where" in result.stdout, result.stdout


def test_a_prompt_longer_than_a_file_name_is_a_prompt():
    result = generate("The page pool " * 40)
    assert result.returncode == 0, result.stderr


def words(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("`", ""))


def test_help_and_docs_state_the_same_rule_and_no_hugging_face_id():
    result = subprocess.run([sys.executable, "-m", "runtime", "generate", "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert MODEL_RULE in words(result.stdout)
    assert "Hugging Face" not in result.stdout
    for doc in ("docs/usage/offline_inference.md", "README.md"):
        assert MODEL_RULE in words((ROOT / doc).read_text()), doc
