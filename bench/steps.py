"""Tandem's own prefill and decode-step times, for before/after comparisons of one change.

    python bench/steps.py --model hybrid --dtype float32
    TANDEM_CPU_COMPILE=0 python bench/steps.py      # the references run eagerly

Uses the checkpoints bench/throughput.py builds (same cache). Prefill: the best of three
one-step prefills of 32 prompts x 128 tokens. Decode: the median step of 32 sequences over
40 steps (--seqs changes the 32; --quantization int8 or int4 quantizes the weights). Quicker and
steadier than the full table, and without HF.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from bench.throughput import build_checkpoint, prompts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="hybrid", choices=["hybrid", "llama"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "tandem-bench")
    parser.add_argument("--seqs", type=int, default=32, help="sequences per step (1: the single-sequence decode)")
    parser.add_argument("--quantization", default=None, help="int8 or int4: the engine option")
    args = parser.parse_args()

    # runtime before torch, as a user's import would be: it sets OpenMP's wait policy.
    from runtime import LLM, SamplingParams  # noqa: I001
    import torch

    torch.set_num_threads(args.threads)
    llm = LLM(build_checkpoint(args.model, args.cache), dtype=args.dtype, max_num_seqs=args.seqs,
              threads=args.threads, max_num_batched_tokens=4096, max_model_len=256, quantization=args.quantization)
    engine, ids = llm.engine, prompts(args.seqs, 128)
    prefill = []
    for _ in range(3):
        for p in ids:
            engine.add_request({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=1))
        start = time.perf_counter()
        engine.step()
        prefill.append(time.perf_counter() - start)
    for p in ids:
        engine.add_request({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.step()
    steps = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    decode = 1000 * statistics.median(steps)
    scheme = f" {args.quantization}" if args.quantization else ""
    print(f"{args.model} {args.dtype}{scheme}, {args.seqs} seqs: prefill {min(prefill):.2f} s, "
          f"decode step {decode:.1f} ms")


if __name__ == "__main__":
    main()
