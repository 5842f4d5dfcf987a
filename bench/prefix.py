"""Prefix caching on a hybrid model: what a shared prompt prefix saves, and what caching costs when nothing is shared.

    python bench/prefix.py                 # 32 requests x (1,024 shared + 64 own) tokens, 32 out; 3 runs
    python bench/prefix.py --runs 1 --requests 8

Builds (once, cached under --cache) a small random Bamba-style hybrid (hidden 256, 4 layers of
which 1 attention with 4 KV heads, Mamba-2 8 heads x 64, d_state 64, chunk 64, vocab 1024), float32 on the CPU.

- shared: two waves of `--requests` requests, each wave added at once. Every prompt is the
  same `--prefix-len` tokens followed by `--suffix-len` tokens of its own (new ones in the second
  wave); `--output-len` tokens out each. Reported for the second wave: the prompt tokens computed
  (prompt tokens less RequestOutput.num_cached_tokens; no request is preempted) and the median
  time to first token, with caching off, on, and on with a snapshot at every block boundary
  (whose cost shows in the first wave).
- nothing shared: one wave of distinct prompts of the same total length; output tokens per second
  of wall time, and of the process's CPU time (one thread: on a shared machine the CPU time is the
  steadier figure).

Each figure is the median of `--runs` runs; each run builds fresh engines, modes alternating.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
VOCAB = 1024
CONFIG = dict(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, attn_layer_indices=[2], num_attention_heads=4,
              num_key_value_heads=4, intermediate_size=512, mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1,
              mamba_d_state=64, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64, max_position_embeddings=4096,
              tie_word_embeddings=False)
MODES = {"off": dict(enable_prefix_caching=False), "on": dict(enable_prefix_caching=True),
         "on, every block": dict(enable_prefix_caching=True)}


def build_checkpoint(cache: Path) -> Path:
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = cache / "prefix-hybrid"
    if (directory / "model.safetensors").is_file():
        return directory
    torch.manual_seed(0)
    transformers.BambaForCausalLM(transformers.BambaConfig(**CONFIG)).save_pretrained(directory)
    # A byte-level tokenizer: prompts are token ids, it only has to load.
    tokenizer = Tokenizer(models.BPE({chr(i): i for i in range(256)}, [], unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="\x00").save_pretrained(directory)
    return directory


def random_ids(generator, n: int) -> list[int]:
    import torch

    return torch.randint(10, VOCAB, (n,), generator=generator).tolist()


def make_engine(directory: Path, mode: str, args: argparse.Namespace):
    from runtime import LLM

    llm = LLM(directory, dtype="float32", max_num_seqs=args.requests, threads=args.threads,
              max_model_len=args.prefix_len + args.suffix_len + args.output_len + 16, **MODES[mode])
    if mode == "on, every block":
        llm.engine.cache.prefix.every_block = True  # the alternative policy, measured only here
    return llm.engine


def run_wave(engine, prompts: list[list[int]], output_len: int) -> dict:
    """Add every prompt at once and step to the end; per-request time to first token, and totals."""
    from runtime import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    ids = [engine.add_request({"prompt_token_ids": p}, params, stream=True) for p in prompts]
    first, final = {}, {}
    while engine.has_unfinished():
        for output in engine.step():
            now = time.perf_counter() - start
            first.setdefault(output.request_id, now)
            if output.finished:
                final[output.request_id] = output
    total, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    outputs = [final[i] for i in ids]
    assert not any(o.num_preemptions for o in outputs), "a request was preempted: computed tokens would be off"
    return {"ttft_s": statistics.median(first[i] for i in ids), "total_s": total, "cpu_s": cpu,
            "computed": sum(len(p) - o.num_cached_tokens for p, o in zip(prompts, outputs)),
            "tokens": [o.outputs[0].token_ids for o in outputs]}


def shared_case(directory: Path, mode: str, args: argparse.Namespace, seed: int) -> dict:
    import torch

    generator = torch.Generator().manual_seed(seed)
    prefix = random_ids(generator, args.prefix_len)
    waves = [[prefix + random_ids(generator, args.suffix_len) for _ in range(args.requests)] for _ in range(2)]
    engine = make_engine(directory, mode, args)
    first = run_wave(engine, waves[0], args.output_len)
    return {**run_wave(engine, waves[1], args.output_len), "first_wave_s": first["total_s"]}


def distinct_case(directory: Path, mode: str, args: argparse.Namespace, seed: int) -> dict:
    import torch

    generator = torch.Generator().manual_seed(seed)
    prompts = [random_ids(generator, args.prefix_len + args.suffix_len) for _ in range(args.requests)]
    engine = make_engine(directory, mode, args)
    run_wave(engine, prompts[:2], 2)  # warm-up, on prompts of the same length
    return run_wave(engine, prompts, args.output_len)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "tandem-bench")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    directory = build_checkpoint(args.cache)
    print(f"workload: {args.requests} requests x ({args.prefix_len} shared + {args.suffix_len} own) tokens, "
          f"{args.output_len} out; median of {args.runs} runs; {args.threads} threads\n")
    # Modes alternate within each run, so that a busy neighbour on a shared machine slows all of them alike.
    shared = {mode: [] for mode in MODES}
    for seed in range(args.runs):
        for mode in MODES:
            shared[mode].append(shared_case(directory, mode, args, seed))
    for mode in MODES:  # caching changes what is computed, not the tokens
        assert [r["tokens"] for r in shared[mode]] == [r["tokens"] for r in shared["off"]], f"{mode}: tokens differ"
    print("second wave (shared prefix)\n")
    print("| prefix caching | prompt tokens computed | median TTFT s | wave s | vs off: computed | vs off: TTFT "
          "| first wave s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    keys = ("computed", "ttft_s", "total_s", "first_wave_s")
    off = {key: statistics.median(r[key] for r in shared["off"]) for key in keys}
    for mode in MODES:
        m = {key: statistics.median(r[key] for r in shared[mode]) for key in keys}
        print(f"| {mode} | {m['computed']:,.0f} | {m['ttft_s']:.2f} | {m['total_s']:.2f} | "
              f"{off['computed'] / m['computed']:.1f}x | {off['ttft_s'] / m['ttft_s']:.1f}x | "
              f"{m['first_wave_s']:.2f} |")
    print("\nnothing shared\n")
    print("| prefix caching | output tok/s | wave s | output tok/CPU-s | CPU s | vs off (CPU) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    distinct = {mode: [] for mode in ("off", "on")}
    for seed in range(args.runs):
        for mode in distinct:
            distinct[mode].append(distinct_case(directory, mode, args, 100 + seed))
    generated = args.requests * args.output_len
    base = statistics.median(r["cpu_s"] for r in distinct["off"])
    for mode, results in distinct.items():
        wall, cpu = (statistics.median(r[key] for r in results) for key in ("total_s", "cpu_s"))
        print(f"| {mode} | {generated / wall:.1f} | {wall:.2f} | {generated / cpu:.1f} | {cpu:.2f} | "
              f"{100 * (base / cpu - 1):+.1f} % |")
    print(f"\n(total benchmark time {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
