"""What LoRA adds to a decode step: 32 sequences through 4 distinct adapters against the base model's step, and one
sequence with one adapter against the base model's.

    python bench/lora.py --dtype float32                 # the bench's hybrid (bench/throughput.py's checkpoint)
    python bench/lora.py --model path/to/checkpoint --seqs 8 --steps 4

Adapters of rank --rank on every linear PEFT can target are made with `peft` (random weights) next to the
checkpoint. Each case runs --repeats times, base and LoRA in turns: a run adds its requests, prefills them in one
step, then times --steps decode steps (captured ones included, as the engine runs by default); a run's figure is
its median step, and the table holds the median of the runs. Base and LoRA runs use the same engine
(enable_lora=True), whose base rows skip the adapters entirely.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))


def make_adapters(model_dir: Path, count: int, rank: int) -> list[Path]:
    """`count` random PEFT adapters of rank `rank` on the model's linears, made once and kept beside it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = [model_dir.parent / f"{model_dir.name}-lora-r{rank}-{i}" for i in range(count)]
    missing = [p for p in paths if not (p / "adapter_model.safetensors").is_file()]
    if not missing:
        return paths
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names = sorted({name.rsplit(".", 1)[-1] for name, module in base.named_modules()
                    if isinstance(module, torch.nn.Linear) and name != "lm_head" and ".experts." not in name})
    for i, path in enumerate(paths):
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=names,
                                                init_lora_weights=False))
        with torch.no_grad():
            generator = torch.Generator().manual_seed(i)
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(0.05 * torch.randn(param.shape, generator=generator))
        model.save_pretrained(path)
        base = model.unload()
    return paths


def decode_step_ms(llm, loras: list, steps: int) -> float:
    """The median decode step of one run: len(loras) requests, adapter i for request i (None: the base model)."""
    from runtime import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for i, lora in enumerate(loras):
        engine.add_request({"prompt_token_ids": [5 + (i * 7 + j) % 300 for j in range(16)]}, params,
                           lora_request=lora)
    engine.step()  # the prefill
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def measure(llm, base: list, adapted: list, steps: int, repeats: int) -> tuple[float, float]:
    """Medians of the base and the LoRA runs, taken in turns (A B A B ...), so that a machine whose load changes
    slows both alike."""
    for loras in (base, adapted):
        decode_step_ms(llm, loras, steps)  # a warm-up run: graphs are captured the second time a batch size runs
    runs = [(decode_step_ms(llm, base, steps), decode_step_ms(llm, adapted, steps)) for _ in range(repeats)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="hybrid", help="hybrid or llama (the bench's checkpoints), or a directory")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "tandem-bench")
    args = parser.parse_args(argv)

    from runtime import LLM, LoRARequest  # noqa: I001  (before torch: it sets OpenMP's wait policy)

    if args.model in ("hybrid", "llama"):
        from bench.throughput import build_checkpoint

        model_dir = build_checkpoint(args.model, args.cache)
    else:
        model_dir = Path(args.model)
    paths = make_adapters(model_dir, args.adapters, args.rank)
    loras = [LoRARequest(f"adapter{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    llm = LLM(model_dir, dtype=args.dtype, threads=args.threads, enable_lora=True, max_loras=args.adapters,
              max_lora_rank=args.rank, max_num_seqs=args.seqs, max_model_len=256)
    cases = [(f"{args.seqs} seqs, {args.adapters} adapters", [None] * args.seqs,
              [loras[i % len(loras)] for i in range(args.seqs)]),
             ("1 seq, 1 adapter", [None], [loras[0]])]
    print(f"decode step (ms), {model_dir.name} {args.dtype}, rank {args.rank}, median of {args.repeats} runs of "
          f"{args.steps} steps")
    print(f"machine before: {load()}")
    print("| case | base | LoRA | ratio |")
    print("| --- | --- | --- | --- |")
    for label, base, adapted in cases:
        base_ms, lora_ms = measure(llm, base, adapted, args.steps, args.repeats)
        print(f"| {label} | {base_ms:.2f} | {lora_ms:.2f} | {lora_ms / base_ms:.2f}x |")
    print(f"machine after: {load()}")
    return 0


def load() -> str:
    """How busy the machine was: the figures mean little on a loaded one."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPUs"


if __name__ == "__main__":
    sys.exit(main())
