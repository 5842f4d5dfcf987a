"""Pipeline-parallel communication per decode step (issue 37): messages and bytes at PP=2/4/8 for a
Bamba-9B-sized model, projected over NVLink and 100 Gb/s Ethernet beside tensor parallelism's, and the
step timings of PP=2 measured on this machine (the pipeline bubble as a fraction of the step).

    OMP_NUM_THREADS=1 python bench/pipeline.py --hidden-size 1024 --layers 8 --batch 16 --steps 16 --rounds 3

Per decode step of a batch of B sequences, each of the PP-1 stage boundaries sends one message of
B x hidden values (the hidden states; the model's dtype), and the last stage sends rank 0 the greedy token
ids it picked (B x 8 bytes) or, for a step with a request whose sampling reads the logits (logprobs,
temperature, penalties, ...), the logits (B x vocab float32), which rank 0 samples: PP messages, all on the step's critical path, each costing one hop's
latency plus its bytes over the link. Tensor parallelism all-reduces twice per layer plus once for the
embedding and gathers the logits (bench/allreduce.py's ring model, the same link figures, assumed:
NVLink 4 450 GB/s and 1 us per hop; 100 Gb/s Ethernet 12.5 GB/s and 10 us per hop). The step plan both
send from rank 0 (a few KiB of token and page ids) is left out of both.

The measured part builds a random Bamba checkpoint (tests/tiny_models.py, float32), starts a 2-stage gloo
group on this machine, prefills `--batch` prompts and times their decode steps on rank 0 (its own stage's
compute, and its wait for the token ids; runtime.distributed.state.record counts the sends and receives), in
`--rounds` alternated rounds of `--steps` steps of the whole batch one step at a time, and as many with two
micro-batches in flight (runtime/distributed/microbatch.py; each engine step then lands half the batch).
One step at a time, rank 0 waits while stage 1 computes: that wait over the step is the bubble, which
micro-batches in flight shrink. The load average is printed: the machine is shared.
Figures: docs/features/pipeline_parallel.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from allreduce import LINKS, projected_seconds  # noqa: E402

BAMBA_9B = (4096, 32, 128256)  # hidden, layers, vocabulary


def pipeline_traffic(pp: int, batch: int, hidden: int, vocab: int, dtype_bytes: int = 2,
                     logits: bool = False) -> tuple[int, int]:
    """(messages, bytes) one decode step sends between stages and back to rank 0: token ids (greedy), or
    the logits (`logits`: a request of the step reads them)."""
    if pp == 1:
        return 0, 0
    return pp, (pp - 1) * batch * hidden * dtype_bytes + batch * (vocab * 4 if logits else 8)


def pipeline_seconds(pp: int, batch: int, hidden: int, vocab: int, bandwidth: float, hop: float,
                     logits: bool = False) -> float:
    """Point to point, one after another: each message a hop's latency plus its bytes over the link."""
    messages, nbytes = pipeline_traffic(pp, batch, hidden, vocab, logits=logits)
    return messages * hop + nbytes / bandwidth


def tensor_seconds(tp: int, batch: int, hidden: int, layers: int, vocab: int, bandwidth: float, hop: float) -> float:
    reduces = 2 * layers + 1
    return (projected_seconds(reduces, reduces * batch * hidden * 2, tp, bandwidth, hop)
            + projected_seconds(1, batch * vocab * 4 / tp, tp, bandwidth, hop))


def projection(batch: int) -> list[str]:
    hidden, layers, vocab = BAMBA_9B
    lines = [f"projection, Bamba-9B-sized (hidden {hidden}, {layers} layers, vocabulary {vocab}, bfloat16), "
             f"per decode step of batch {batch} (links assumed, see the docstring):",
             f"  {'':24s} {'':18s} " + " ".join(f"{'N=' + str(n):>10s}" for n in (2, 4, 8))]
    for logits, label in ((False, "PP messages, bytes"), (True, "PP with logits")):
        traffic = [pipeline_traffic(n, batch, hidden, vocab, logits=logits) for n in (2, 4, 8)]
        lines.append(f"  {label:24s} {'':18s} " + " ".join(f"{m:3d} {b / 1024:5.0f}K" for m, b in traffic))
    reduces = 2 * layers + 2
    tp_bytes = [(2 * layers + 1) * batch * hidden * 2 + batch * vocab * 4 / n for n in (2, 4, 8)]
    lines.append(f"  {'TP collectives, bytes':24s} {'':18s} " + " ".join(f"{reduces:3d} {b / 1024:5.0f}K"
                                                                       for b in tp_bytes))
    for link, (bandwidth, hop) in LINKS.items():
        pp = [pipeline_seconds(n, batch, hidden, vocab, bandwidth, hop) for n in (2, 4, 8)]
        tp = [tensor_seconds(n, batch, hidden, layers, vocab, bandwidth, hop) for n in (2, 4, 8)]
        with_logits = [pipeline_seconds(n, batch, hidden, vocab, bandwidth, hop, logits=True) for n in (2, 4, 8)]
        lines.append(f"  {'PP':24s} {link:18s} " + " ".join(f"{t * 1e3:8.3f}ms" for t in pp))
        lines.append(f"  {'PP with logits':24s} {link:18s} " + " ".join(f"{t * 1e3:8.3f}ms" for t in with_logits))
        lines.append(f"  {'TP':24s} {link:18s} " + " ".join(f"{t * 1e3:8.3f}ms" for t in tp))
    return lines


def build(args) -> Path:
    from tiny_models import build_model, build_tokenizer

    work = Path(tempfile.mkdtemp(prefix="tandem-pipeline-"))
    build_tokenizer(work / "tok")
    heads = max(2, args.hidden_size // 64)
    build_model("bamba", work / "model", work / "tok", hidden_size=args.hidden_size, num_hidden_layers=args.layers,
                intermediate_size=2 * args.hidden_size, mamba_n_heads=2 * args.hidden_size // 64, mamba_d_head=64,
                num_attention_heads=heads, num_key_value_heads=max(2, heads // 4),
                attn_layer_indices=[args.layers // 2])
    return work / "model"


@dataclass
class Timing:
    """Rank 0 over the measured decode steps: seconds, seconds waiting for the last stage, tokens generated."""

    seconds: float = 0.0
    waiting: float = 0.0
    tokens: int = 0

    def per_batch(self, seconds: float, batch: int) -> float:
        """`seconds` per step of the whole batch (a token for every sequence)."""
        return seconds * batch / self.tokens


def time_decode(model: Path, args) -> tuple[dict[int, Timing], Any]:
    """Decode `args.batch` sequences at PP=2, in `args.rounds` rounds of one step at a time (depth 1) and of two
    micro-batches in flight (depth 2), alternated so that both see the machine's load alike; and the sends and
    receives of a step of the whole batch."""
    from runtime import LLM, SamplingParams
    from runtime.distributed import state

    engine = LLM(model, dtype="float32", pipeline_parallel_size=2, max_model_len=512).engine
    params = SamplingParams(temperature=0, max_tokens=args.rounds * 2 * (args.steps + 4) + 16, ignore_eos=True)
    seqs = [engine.add_request({"prompt_token_ids": [5 + i, 17, 42, 9]}, params) for i in range(args.batch)]
    while any(not engine._seqs[i].output_token_ids for i in seqs):  # the prefills, then one decode of each
        engine.step()
    timings, first = {1: Timing(), 2: Timing()}, None
    for _ in range(args.rounds):
        for depth, timing in timings.items():
            engine.microbatches.depth = depth
            for _ in range(2 * depth):  # into the new depth's steady state
                engine.step()
            tokens, start = engine.counters.generated_tokens, time.perf_counter()
            for _ in range(args.steps * depth):  # each step lands one micro-batch
                with state.record() as stats:
                    engine.step()
                timing.waiting += stats.seconds.get("recv", 0.0)
                first = first or stats
            timing.seconds += time.perf_counter() - start
            timing.tokens += engine.counters.generated_tokens - tokens
    engine.shutdown()
    return timings, first


def measure(args) -> list[str]:
    model = build(args)
    load = os.getloadavg()
    timings, stats = time_decode(model, args)
    after = os.getloadavg()
    lines = [
        f"PP=2 over gloo on this machine ({os.cpu_count()} CPUs, load average {load[0]:.1f} before and "
        f"{after[0]:.1f} after), hidden {args.hidden_size}, {args.layers} layers, batch {args.batch}, float32; "
        f"rank 0 per decode step of the batch ({args.rounds} x {args.steps} of them each way, alternated):",
        f"  sends    {stats.counts.get('send', 0)} ({stats.bytes.get('send', 0) / 1024:.1f} KiB, the hidden states)",
        f"  receives {stats.counts.get('recv', 0)} ({stats.bytes.get('recv', 0)} B, the greedy token ids)",
    ]
    for depth, label in ((1, "one step at a time"), (2, "2 micro-batches in flight")):
        timing = timings[depth]
        step, wait = timing.per_batch(timing.seconds, args.batch), timing.per_batch(timing.waiting, args.batch)
        lines.append(f"  {label:26s} step {step * 1e3:.2f} ms ({args.batch / step:.0f} tokens/s): rank 0 waits "
                     f"{wait * 1e3:.2f} ms for stage 1, the bubble is {timing.waiting / timing.seconds:.0%} of the "
                     "step")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="sequences decoding together")
    parser.add_argument("--steps", type=int, default=32, help="decode steps of the batch measured per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each way, alternated")
    args = parser.parse_args()
    if args.rounds * 2 * (args.steps + 4) + 16 > 500:
        parser.error("--rounds x --steps: the sequences would outgrow the model's 512 positions; use fewer")
    print("\n".join(measure(args)))
    print()
    print("\n".join(projection(args.batch)))


if __name__ == "__main__":
    main()
