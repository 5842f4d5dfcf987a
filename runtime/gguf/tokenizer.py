"""The tokenizer a GGUF file describes (tokenizer.ggml.*), through transformers' GGUF tokenizer conversion."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_gguf_tokenizer(path: Path) -> Any:
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
