"""Train the small hybrid model that ships with Tandem, on Tandem's own documentation.

    python runtime/default_model/train.py            # writes the checkpoint beside this file

The model is a Bamba (Mamba-2 layers with two attention layers) of about 1.5M
parameters, trained with HF transformers on the project's README and docs/, text
we may redistribute. It memorises phrases of the docs, enough for `tandem generate`
to produce recognizable text offline; it knows nothing else. The run is seeded and
takes about ten minutes on two CPU cores.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import re
import time
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
VOCAB_SIZE = 1024
SEQ_LEN = 128
BATCH = 16


def corpus_text() -> str:
    """README, every docs page and the code's docstrings, in a fixed order.

    HTML comments and table rows (mostly glyphs and numbers) are left out.
    """
    pages = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = re.sub(r"<!--.*?-->", "", path.read_text(encoding="utf-8"), flags=re.S)
        lines = [line for line in text.splitlines() if not line.lstrip().startswith("|")]
        pages.append("\n".join(lines).strip())
    for path in sorted([*(ROOT / "runtime").rglob("*.py"), *(ROOT / "matrix").rglob("*.py")]):
        pages.extend(docstrings(path))
    return "\n\n".join(pages) + "\n"


def docstrings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef)))]
    return [doc for doc in map(ast.get_docstring, nodes) if doc]


def train_tokenizer(text: str) -> transformers.PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(text.split("\n\n"), trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>")


def model_config(vocab_size: int) -> transformers.BambaConfig:
    return transformers.BambaConfig(
        vocab_size=vocab_size, hidden_size=128, num_hidden_layers=6, attn_layer_indices=[2, 5],
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=384, mamba_n_heads=8, mamba_d_head=32,
        mamba_n_groups=1, mamba_d_state=32, mamba_chunk_size=64, mamba_expand=2, max_position_embeddings=2048,
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def batches(ids: torch.Tensor, steps: int, generator: torch.Generator):
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - SEQ_LEN - 1, (BATCH,), generator=generator)
        yield torch.stack([ids[s : s + SEQ_LEN] for s in starts])


def train(steps: int, out: Path) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    text = corpus_text()
    tokenizer = train_tokenizer(text)
    ids = torch.tensor(tokenizer.encode(text))
    model = transformers.BambaForCausalLM(model_config(len(tokenizer)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, step / 100) * 0.5 * (1 + math.cos(math.pi * step / steps)))
    start, loss = time.time(), float("nan")
    for step, batch in enumerate(batches(ids, steps, torch.Generator().manual_seed(0))):
        loss = model(batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  {time.time() - start:.0f}s", flush=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    record = {"corpus_sha256": hashlib.sha256(text.encode()).hexdigest(), "corpus_tokens": len(ids),
              "steps": steps, "batch": BATCH, "seq_len": SEQ_LEN, "final_loss": round(loss.item(), 3),
              "parameters": sum(p.numel() for p in model.parameters())}
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()
    print(json.dumps(train(args.steps, args.out), indent=2))
