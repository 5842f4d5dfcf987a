"""What a captured decode step (runtime/decode_graph.py) spends outside its kernels.

    python bench/replay.py --dtype bfloat16 --batch 1,32
    PYTHONPATH=../before python bench/replay.py     # the same, for another checkout (a git worktree)

Captures a decode step of the bench's hybrid (bench/throughput.py's checkpoint) at each batch size, then
replays it: the wall time of a replay (median of --repeats), the ops in its program (native tandem::
operators and torch ops), and the time outside the ops: the wall time less the time inside every op, as
torch.profiler measures it (each op's CPU time, its dispatch included). The replay's own Python loop is
what is left.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

# Appended, not prepended: with PYTHONPATH=OTHER_CHECKOUT, that checkout's runtime is the one measured.
sys.path.append(str(Path(__file__).parents[1]))

from bench.throughput import build_checkpoint, prompts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="hybrid", choices=["hybrid", "llama"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", default="1,32")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "tandem-bench")
    args = parser.parse_args()

    from runtime import LLM, SamplingParams  # noqa: I001  (before torch: it sets OpenMP's wait policy)
    import torch

    print("| batch | ops (tandem / torch / ctypes) | replay ms | inside the ops ms | outside the ops us |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for batch in (int(b) for b in args.batch.split(",")):
        llm = LLM(build_checkpoint(args.model, args.cache), dtype=args.dtype, max_num_seqs=batch,
                  threads=args.threads, max_model_len=256)
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts(batch, 32)], params, use_tqdm=False)
        graph = llm.engine.runner.graphs.graphs[batch]
        kinds = Counter(kind(step) for step in graph.program)
        walls = []
        with torch.inference_mode():  # as the engine runs its steps
            for _ in range(args.repeats):
                start = time.perf_counter()
                graph.replay()
                walls.append(time.perf_counter() - start)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                for _ in range(args.repeats):
                    graph.replay()
        top_level = [e for e in profile.events() if e.cpu_parent is None]
        inside = sum(e.cpu_time_total for e in top_level) / args.repeats / 1e3  # ms per replay
        wall = 1e3 * statistics.median(walls)
        # A checkout from before the kernels were torch operators launches them through ctypes, which the
        # profiler does not see: its time inside the ops is unknown.
        outside = f"{1e3 * max(0.0, wall - inside):.0f}" if not kinds["ctypes"] else "n/a"
        print(f"| {batch} | {kinds['tandem']} / {kinds['torch']} / {kinds['ctypes']} | {wall:.2f} | "
              f"{inside if outside != 'n/a' else float('nan'):.2f} | {outside} |")


def kind(step) -> str:
    """A program step: a native operator, a torch op, or (before the operators) a ctypes launch."""
    func = getattr(step, "func", None)
    if getattr(func, "namespace", None) == "tandem":
        return "tandem"
    return "ctypes" if type(func).__module__ == "ctypes" or "CFuncPtr" in type(func).__name__ else "torch"


if __name__ == "__main__":
    main()
