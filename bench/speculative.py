"""One sequence decoding with and without n-gram speculation, on a workload whose output copies its input
and on one where nothing repeats.

    python bench/speculative.py                              # the shipped model, 256 new tokens, k=16, median of 3
    python bench/speculative.py --max-tokens 64 --repeats 1 --num-speculative-tokens 4

"fast apply" gives the model a passage of the docs it was trained on and asks for it again (the passage,
then its first sentence once more): a model that copies is what an editing request looks like, and prompt
lookup finds every next token in the prompt. "no repeats" gives it the docs' words shuffled, ending in a
word it has not seen twice, so lookup finds little. Each cell is the median of `--repeats` timed runs after
one warm-up run, greedy, one thread, in tokens per second of the process's CPU time (on a shared machine
wall time measures the neighbours); the acceptance rate is accepted draft tokens / draft tokens.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from runtime import LLM, SamplingParams  # noqa: E402
from runtime.config import DEFAULT_MODEL  # noqa: E402

DOC = Path(__file__).parents[1] / "docs" / "cache_layout.md"


def workloads(tokenizer, prompt_tokens: int) -> dict[str, list[int]]:
    text = DOC.read_text()
    passage = tokenizer.encode(text)[:prompt_tokens]
    words = text.split()
    random.Random(0).shuffle(words)
    shuffled = tokenizer.encode(" ".join(words))[:prompt_tokens + prompt_tokens // 4]
    return {"fast apply": passage + passage[: prompt_tokens // 4], "no repeats": shuffled}


def run_once(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, int]:
    start = time.process_time()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    tokens = len(out[0].outputs[0].token_ids)
    return tokens / (time.process_time() - start), tokens


def compare(plain: LLM, fast: LLM, prompt: list[int], params: SamplingParams, repeats: int) -> dict:
    """Median tokens/s of each engine, timed in turns (so that a busier moment slows both), and the
    acceptance rate over the timed runs."""
    for llm in (plain, fast):
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)  # warm-up: captures, first runs
    counters = fast.engine.speculator.counters
    before = (counters.num_draft_tokens, counters.num_accepted_tokens)
    without, with_spec = [], []
    for _ in range(repeats):
        rate, n_plain = run_once(plain, prompt, params)
        without.append(rate)
        rate, n_spec = run_once(fast, prompt, params)
        with_spec.append(rate)
        assert n_plain == n_spec
    drafted = counters.num_draft_tokens - before[0]
    accepted = counters.num_accepted_tokens - before[1]
    return {"without": statistics.median(without), "with": statistics.median(with_spec),
            "acceptance": accepted / drafted if drafted else 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-speculative-tokens", type=int, default=16)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=5)
    args = parser.parse_args(argv)
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}
    common = dict(threads=1, max_num_seqs=1)
    plain, fast = LLM(args.model, **common), LLM(args.model, speculative_config=spec, **common)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"{Path(args.model).name}, one sequence, {args.max_tokens} new tokens, greedy, {spec}, "
          f"median of {args.repeats}")
    print("| workload | prompt tokens | tokens/s without | tokens/s with | speedup | acceptance rate |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, prompt in workloads(plain.engine.tokenizer, args.prompt_tokens).items():
        r = compare(plain, fast, prompt, params, args.repeats)
        print(f"| {name} | {len(prompt)} | {r['without']:.0f} | {r['with']:.0f} | {r['with'] / r['without']:.2f}x | "
              f"{r['acceptance']:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
