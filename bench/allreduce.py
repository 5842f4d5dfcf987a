"""Tensor-parallel communication per decode step (issue 16): all-reduce count, bytes and time at TP=2 here,
and what the same bytes would cost at TP=2/4/8 over NVLink and over Ethernet.

    OMP_NUM_THREADS=1 python bench/allreduce.py --hidden-size 1024 --layers 8 --batch 8 --steps 32

Builds a random Bamba checkpoint (tests/tiny_models.py: Mamba-2 layers, one attention layer, float32),
starts a 2-rank gloo group on this machine, prefills `--batch` prompts, then counts the collectives
of rank 0 over `--steps` decode steps (runtime.distributed.state.record). Per step, every layer
all-reduces its mixer's and its MLP's output (batch x hidden values each), the vocabulary-parallel
embedding one more, and the LM head all-gathers the logits.

The projection is the ring all-reduce model, t = n x 2 (p-1) x hop latency + 2 (p-1)/p x bytes / bandwidth
for n collectives of `bytes` in all among p ranks, with per-link figures that are assumptions, not
measurements: NVLink 4 (H100 SXM), 450 GB/s per direction and 1 us per hop; 100 Gb/s Ethernet,
12.5 GB/s and 10 us per hop (TCP). --project scales the counts and bytes to bfloat16 and a 9B hybrid's dimensions.

Measured times include each collective's wait for the other rank to arrive; on a shared 2-core
machine that wait dominates. Figures: docs/features/tensor_parallel.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

LINKS = {"NVLink 4": (450e9, 1e-6), "100 Gb/s Ethernet": (12.5e9, 10e-6)}  # bytes/s, seconds per hop


def projected_seconds(count: float, nbytes: float, tp: int, bandwidth: float, hop_latency: float) -> float:
    return count * 2 * (tp - 1) * hop_latency + 2 * (tp - 1) / tp * nbytes / bandwidth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="sequences decoding together")
    parser.add_argument("--steps", type=int, default=32, help="decode steps measured")
    parser.add_argument("--project", type=int, nargs=3, metavar=("HIDDEN", "LAYERS", "VOCAB"),
                        default=(4096, 32, 128256),
                        help="also project a model of this width, depth and vocabulary, bfloat16 (default: Bamba-9B)")
    args = parser.parse_args()

    from tiny_models import build_model, build_tokenizer

    from runtime import LLM, SamplingParams
    from runtime.distributed import state

    work = Path(tempfile.mkdtemp(prefix="tandem-allreduce-"))
    build_tokenizer(work / "tok")
    heads = max(2, args.hidden_size // 64)  # of 64 channels, as Bamba-9B's
    build_model("bamba", work / "model", work / "tok", hidden_size=args.hidden_size, num_hidden_layers=args.layers,
                intermediate_size=2 * args.hidden_size, mamba_n_heads=2 * args.hidden_size // 64, mamba_d_head=64,
                num_attention_heads=heads, num_key_value_heads=max(2, heads // 4))
    llm = LLM(work / "model", dtype="float32", tensor_parallel_size=2, max_model_len=512)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.steps + 2, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request({"prompt_token_ids": [5 + i, 17, 42, 9]}, params)
    engine.step()  # the prefills: every sequence decodes from here on
    per_step = []
    for _ in range(args.steps):
        with state.record() as stats:
            start = time.perf_counter()
            engine.step()
            step_seconds = time.perf_counter() - start
        per_step.append((stats, step_seconds))
    report(args, per_step)


def report(args, per_step) -> None:
    stats = per_step[0][0]
    ops = sorted(stats.counts)
    print(f"TP=2 over gloo, hidden {args.hidden_size}, {args.layers} layers, batch {args.batch}, float32; "
          f"per decode step (mean of {len(per_step)}):")
    for op in ops:
        count = stats.counts[op]
        nbytes = stats.bytes[op]
        seconds = statistics.mean(s.seconds[op] for s, _ in per_step)
        print(f"  {op:10s} {count:4d} calls  {nbytes / 1024:9.1f} KiB  {seconds * 1e3:8.2f} ms "
              f"({seconds / count * 1e6:.0f} us per call)")
    step = statistics.mean(t for _, t in per_step)
    comm = statistics.mean(sum(s.seconds.values()) for s, _ in per_step)
    print(f"  step {step * 1e3:.2f} ms, of which collectives {comm * 1e3:.2f} ms ({comm / step:.0%})")
    hidden, layers, vocab = args.project
    reduces, gathers = stats.counts.get("all_reduce", 0), stats.counts.get("all_gather", 0)
    # Every all-reduce moves batch x hidden values: 2 per layer (mixer, MLP) and 1 for the embedding.
    print(f"  check: all-reduce bytes = {reduces} x batch {args.batch} x hidden {args.hidden_size} x 4 B: "
          f"{stats.bytes.get('all_reduce', 0) == reduces * args.batch * args.hidden_size * 4}")
    big_reduces = (reduces - 1) / args.layers * layers + 1
    big = {"all_reduce": (big_reduces, big_reduces * args.batch * hidden * 2),
           "all_gather": (gathers, gathers * args.batch * vocab * 4 / 2)}  # float32 logits, one rank's half
    small = {op: (stats.counts[op], stats.bytes[op]) for op in stats.counts}
    print(f"\nprojection (ring model; link figures assumed, see the docstring), per decode step of batch {args.batch}:")
    print(f"  {'model':40s} {'link':18s} " + " ".join(f"{'TP=' + str(tp):>9s}" for tp in (2, 4, 8)))
    for name, ops in ((f"this one ({sum(stats.counts.values())} collectives)", small),
                      (f"hidden {hidden}, {layers} layers, bf16 ({big_reduces + gathers:.0f})", big)):
        for link, (bandwidth, latency) in LINKS.items():
            times = [sum(projected_seconds(n, nbytes, tp, bandwidth, latency) for n, nbytes in ops.values())
                     for tp in (2, 4, 8)]
            print(f"  {name:40s} {link:18s} " + " ".join(f"{t * 1e3:7.3f}ms" for t in times))


if __name__ == "__main__":
    main()
