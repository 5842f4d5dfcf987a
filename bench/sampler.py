"""The sampler's cost per step with each of vLLM's sampling parameters, on random logits (no model).

    python bench/sampler.py                        # batch 1 and 64, vocab 32,000, 512 prompt + 256 output tokens
    python bench/sampler.py --batch 8 --vocab 50000 --repeats 20

Each row times `Sampler.__call__` (runtime/sampler.py) on one step's float32 logits, every request in the
batch with the same parameters, one thread; the figure is the best of `--repeats` calls, as milliseconds
per step. Penalties read each request's prompt and output so far, so their cost grows with those lengths
(`--prompt-len`, `--output-len`), not with the vocabulary.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

import torch  # noqa: E402

from runtime.sampler import Sampler  # noqa: E402
from runtime.sampling_params import SamplingParams  # noqa: E402

CASES = {
    "greedy": dict(temperature=0),
    "greedy, logprobs=5": dict(temperature=0, logprobs=5),
    "greedy, repetition+frequency+presence": dict(temperature=0, repetition_penalty=1.2, frequency_penalty=0.3,
                                                  presence_penalty=0.5),
    "greedy, logit_bias (8 ids)": dict(temperature=0, logit_bias={i: 1.0 for i in range(8)}),
    "greedy, allowed_token_ids (1,000)": dict(temperature=0, allowed_token_ids=list(range(1000))),
    "temperature 0.8": dict(temperature=0.8),
    "temperature 0.8, min_p 0.05": dict(temperature=0.8, min_p=0.05),
    "temperature 0.8, top_p 0.9": dict(temperature=0.8, top_p=0.9),
}


def time_case(options: dict, batch: int, vocab: int, histories: list, repeats: int) -> float:
    logits = torch.randn(batch, vocab)
    params = [SamplingParams(**options)] * batch
    generators, banned = [None] * batch, [[] for _ in range(batch)]
    sampler = Sampler()
    sampler(logits, params, generators, banned, histories)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        sampler(logits, params, generators, banned, histories)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rng = random.Random(0)
    print(f"vocab {args.vocab}, {args.prompt_len} prompt + {args.output_len} output tokens per request, "
          f"best of {args.repeats}, ms per step")
    print("| parameters | " + " | ".join(f"batch {b}" for b in args.batch) + " |")
    print("| --- |" + " --- |" * len(args.batch))
    histories = {b: [([rng.randrange(args.vocab) for _ in range(args.prompt_len)],
                      [rng.randrange(args.vocab) for _ in range(args.output_len)]) for _ in range(b)]
                 for b in args.batch}
    for name, options in CASES.items():
        options = {k: v for k, v in options.items()
                   if k != "allowed_token_ids" or max(v) < args.vocab}
        times = [time_case(options, b, args.vocab, histories[b], args.repeats) for b in args.batch]
        print(f"| {name} | " + " | ".join(f"{t:.2f}" for t in times) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
