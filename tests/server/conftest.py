"""The main test server: the tiny hybrid (Bamba) checkpoint with a chat template, served by a real
`tandem serve` subprocess; the official openai client pointed at it; the offline `LLM` on the same
checkpoint as the reference."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from server_helpers import CHAT_TEMPLATE, MAX_MODEL_LEN, SERVER_ARGS, Server, serve
from transformers import AutoTokenizer


@pytest.fixture(scope="session")
def chat_model_dir(tiny_checkpoint, tmp_path_factory) -> Path:
    """The tiny hybrid (Bamba) checkpoint, with a chat template added to its tokenizer."""
    directory = tmp_path_factory.mktemp("bamba-chat")
    shutil.copytree(tiny_checkpoint("bamba")[0], directory, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def server(chat_model_dir, tmp_path_factory) -> Iterator[Server]:
    with serve(chat_model_dir, tmp_path_factory.mktemp("logs") / "server.log", *SERVER_ARGS) as running:
        yield running


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="session")
def offline(chat_model_dir):
    from runtime import LLM

    return LLM(chat_model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="session")
def tokenizer(chat_model_dir):
    return AutoTokenizer.from_pretrained(chat_model_dir)
