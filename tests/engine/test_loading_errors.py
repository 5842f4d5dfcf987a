"""What users get wrong when pointing Tandem at a model: one line on stderr naming the fix, exit code 2."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def tandem(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def generate(*args: str) -> subprocess.CompletedProcess:
    return tandem("generate", *args, "--max-tokens", "2")


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.fixture
def llama(tmp_path, tiny_checkpoint):
    target = tmp_path / "llama"
    shutil.copytree(tiny_checkpoint("llama")[0], target)
    return target


def test_a_directory_without_tokenizer_files_names_them(llama):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (llama / name).unlink(missing_ok=True)
    line = one_line_error(generate(str(llama), "The page"))
    assert f"no tokenizer in {llama}" in line
    assert "tokenizer.json, tokenizer.model, vocab.json, tokenizer.tiktoken" in line
    assert "sentencepiece" not in line


@pytest.mark.parametrize("command", [["plan"], ["serve", "--port", "0"]])
def test_a_hugging_face_id_says_how_to_fetch_a_directory(tmp_path, command):
    line = one_line_error(tandem(command[0], "ibm-granite/granite-4.0-h-tiny", *command[1:], cwd=tmp_path))
    assert "Tandem reads local directories only" in line
    # `hf` is the command huggingface_hub installs today; `huggingface-cli` is its deprecated name.
    assert "`hf download ibm-granite/granite-4.0-h-tiny --local-dir DIR` and pass DIR" in line
    assert "huggingface-cli" not in line


def test_max_model_len_above_max_position_embeddings_is_refused(llama):
    assert json.loads((llama / "config.json").read_text())["max_position_embeddings"] == 512
    line = one_line_error(generate(str(llama), "The page", "--max-model-len", "1024"))
    assert "--max-model-len 1024 is more than the model was built for (max_position_embeddings=512" in line
    assert "pass --max-model-len 512 or less" in line


def test_a_missing_weight_file_is_one_line(llama):
    (llama / "model.safetensors").unlink()
    line = one_line_error(generate(str(llama), "The page"))
    assert "no weights in" in line and "*.safetensors (or pytorch_model.bin)" in line
