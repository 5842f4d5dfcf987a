"""Resident memory of the engine alone, offline, over rounds of requests of varied shapes (issue 13).

    OMP_NUM_THREADS=1 TANDEM_CPU_COMPILE=0 python bench/rss.py --rounds 6 --requests 200

Builds the soak test's tiny Bamba checkpoint (tests/tiny_models.py), then runs rounds of generate()
calls with random prompt lengths and batch sizes and prints VmRSS after each round. --no-pack keeps
the plain nn.Linear (no oneDNN packed weights), to tell which native cache grows.

Measured (5 rounds of ~150 requests, MiB after each): packed linears with unpadded rows 560, 630, 696,
737, 776 (still growing); --no-pack 487, 491, 490, 488, 491; rows bucketed as now 536, 571, 583, 599,
605, then 610, 614, 615, 616, 616 over rounds 6-10 (bounded: at most 48 row counts ever reach oneDNN).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS line")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=200, help="requests per round")
    parser.add_argument("--no-pack", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from tiny_models import build_model, build_tokenizer

    import runtime.runner
    from runtime import LLM, SamplingParams

    if args.no_pack:
        runtime.runner.pack_linears = lambda model: 0
    work = Path(tempfile.mkdtemp(prefix="tandem-rss-"))
    build_tokenizer(work / "tok")
    build_model("bamba", work / "model", work / "tok")
    llm = LLM(work / "model", dtype="float32", max_model_len=512)
    rng = random.Random(args.seed)
    words = "the page pool holds pages of state for every sequence".split()
    print(f"start: {rss_mib():.0f} MiB", flush=True)
    total = 0
    for round_ in range(args.rounds):
        done = 0
        while done < args.requests:
            batch = rng.randint(1, 24)
            prompts = [" ".join(rng.choices(words, k=rng.randint(2, 40))) for _ in range(batch)]
            params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 12), ignore_eos=True)
            llm.generate(prompts, params, use_tqdm=False)
            done += batch
        total += done
        print(f"round {round_ + 1}: {total} requests, RSS {rss_mib():.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
