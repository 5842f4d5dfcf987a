"""Throughput of Tandem against HF transformers `generate`, measured in the same run.

    python bench/throughput.py                      # 32 prompts x 128 in x 64 out, fp32 and bf16
    python bench/throughput.py --models hybrid --dtypes float32 --prompts 8

Builds (once, cached under --cache) ~100M-parameter random checkpoints: a Bamba-style
hybrid (hidden 768, 12 layers of which 2 attention, Mamba-2 24 heads x 64, d_state 128,
1 group, vocab 32000) and a Llama-style model of similar size. Each (engine, model,
dtype) runs in its own subprocess, so peak memory is that run's alone. Every request
generates exactly `--output-len` tokens (ignore_eos / min_new_tokens). It also measures
the machine's copy bandwidth and the batch-1 decode floor: the bytes of weights one
decode step reads, over that bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
VOCAB = 32000
MODELS = {
    "hybrid": ("BambaConfig", "BambaForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=768, num_hidden_layers=12, attn_layer_indices=[4, 9], num_attention_heads=12,
        num_key_value_heads=4, intermediate_size=1024, mamba_n_heads=24, mamba_d_head=64, mamba_n_groups=1,
        mamba_d_state=128, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, max_position_embeddings=4096,
        tie_word_embeddings=False)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
        intermediate_size=2048, max_position_embeddings=4096, tie_word_embeddings=False)),
}


def build_checkpoint(name: str, cache: Path) -> Path:
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = cache / name
    if (directory / "model.safetensors").is_file():
        return directory
    config_class, model_class, kwargs = MODELS[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**kwargs))
    model.save_pretrained(directory)
    # A byte-level tokenizer: prompts are token ids, it only has to load.
    vocab = {chr(i): i for i in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="\x00").save_pretrained(directory)
    return directory


def prompts(num: int, length: int) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(1)
    return torch.randint(10, VOCAB, (num, length), generator=generator).tolist()


def run_tandem(directory: Path, dtype: str, ids: list[list[int]], output_len: int) -> dict:
    from runtime import LLM, SamplingParams

    llm = LLM(directory, dtype=dtype, max_num_seqs=len(ids), max_num_batched_tokens=max(2048, sum(map(len, ids))),
              max_model_len=len(ids[0]) + output_len + 16)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    # Warm-up on the whole batch, as for HF below: torch.compile specializes some sizes, so the
    # measured run must not be the first of its shape.
    llm.generate([{"prompt_token_ids": p} for p in ids], SamplingParams(temperature=0, max_tokens=3),
                 use_tqdm=False)
    engine = llm.engine
    start = time.perf_counter()
    for p in ids:
        engine.add_request({"prompt_token_ids": p}, params)
    step_times, first_token, generated = [], None, 0
    while engine.has_unfinished():
        generated += sum(len(out.outputs[0].token_ids) for out in engine.step() if out.finished)
        step_times.append(time.perf_counter())
        if first_token is None and any(seq.output_token_ids for seq in engine.scheduler.running):
            first_token = step_times[-1] - start
    total = step_times[-1] - start
    return {"total_s": total, "ttft_s": first_token if first_token is not None else total,
            "itl_s": (total - (first_token or total)) / max(1, output_len - 1), "generated_tokens": generated}


def run_hf(directory: Path, dtype: str, ids: list[list[int]], output_len: int) -> dict:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype)).eval()
    input_ids = torch.tensor(ids)
    mask = torch.ones_like(input_ids)

    def generate(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)
        return time.perf_counter() - start

    generate(2)  # warm-up
    ttft = generate(1)
    total = generate(output_len)
    return {"total_s": total, "ttft_s": ttft, "itl_s": (total - ttft) / max(1, output_len - 1)}


def child(args: argparse.Namespace) -> None:
    """One measurement in this process; prints one JSON line."""
    import torch

    torch.set_num_threads(args.threads)
    ids = prompts(args.prompts, args.input_len)
    directory = build_checkpoint(args.model, args.cache)
    result = (run_tandem if args.engine == "tandem" else run_hf)(directory, args.dtype, ids, args.output_len)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result), flush=True)


def measure(engine: str, model: str, dtype: str, args: argparse.Namespace, prompts_: int | None = None) -> dict:
    command = [sys.executable, __file__, "--child", "--engine", engine, "--models", model, "--dtypes", dtype,
               "--prompts", str(prompts_ or args.prompts), "--input-len", str(args.input_len),
               "--output-len", str(args.output_len), "--cache", str(args.cache), "--threads", str(args.threads)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRANSFORMERS_VERBOSITY="error")
    out = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        raise SystemExit(f"{engine} {model} {dtype} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def copy_bandwidth(threads: int) -> float:
    """Bytes per second of a large tensor copy (one read and one write per byte copied)."""
    import torch

    torch.set_num_threads(threads)
    src = torch.ones(256 * 1024**2 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best


def weight_bytes_per_step(model: str, dtype: str, cache: Path) -> int:
    """Every weight is read once per decode step, except the embedding (one row per token)."""
    from safetensors import safe_open

    size = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    total = 0
    with safe_open(build_checkpoint(model, cache) / "model.safetensors", framework="pt") as f:
        for name in f.keys():
            if "embed" not in name:
                total += _numel(f.get_slice(name).get_shape())
    return total * size


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="hybrid,llama")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "tandem-bench")
    parser.add_argument("--skip-floor", action="store_true", help="skip the batch-1 decode measurement")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", default="tandem", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.model, args.dtype = args.models, args.dtypes
        return child(args)
    report(args)


def report(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    bandwidth = copy_bandwidth(args.threads)
    print(f"workload: {args.prompts} prompts x {args.input_len} tokens in, {args.output_len} out (ignore_eos); "
          f"{args.threads} threads; copy bandwidth {bandwidth / 1e9:.1f} GB/s\n")
    header = ("| model | dtype | engine | gen tok/s | total tok/s | TTFT s | ITL ms | peak MiB | Tandem/HF |\n"
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows, floors = [header], []
    generated = args.prompts * args.output_len
    for model in args.models.split(","):
        for dtype in args.dtypes.split(","):
            results = {engine: measure(engine, model, dtype, args) for engine in ("hf", "tandem")}
            for engine in ("hf", "tandem"):
                r = results[engine]
                ratio = results["hf"]["total_s"] / r["total_s"] if engine == "tandem" else 1.0
                rows.append(f"| {model} | {dtype} | {engine} | {generated / r['total_s']:.1f} | "
                            f"{(generated + args.prompts * args.input_len) / r['total_s']:.1f} | {r['ttft_s']:.2f} | "
                            f"{1000 * r['itl_s']:.1f} | {r['peak_rss_mib']:.0f} | {ratio:.2f}x |")
            if not args.skip_floor:
                single = measure("tandem", model, dtype, args, prompts_=1)
                floor = weight_bytes_per_step(model, dtype, args.cache) / bandwidth
                floors.append(f"| {model} | {dtype} | {1000 * single['itl_s']:.1f} | {1000 * floor:.1f} | "
                              f"{single['itl_s'] / floor:.2f}x |")
    print("\n".join(rows))
    if floors:
        print("\nbatch-1 decode against the bandwidth floor (weights read per step / copy bandwidth)\n")
        print("| model | dtype | Tandem ms/token | floor ms/token | ratio |\n| --- | --- | ---: | ---: | ---: |")
        print("\n".join(floors))
    print(f"\n(total benchmark time {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
