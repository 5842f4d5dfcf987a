"""One CPU op at the benchmark hybrid's sizes, this tree's version against another revision's, in one process.

    python bench/ops.py --against main                       # every op, bfloat16, 2 threads
    python bench/ops.py --against main --ops decode_attention,state_update --dtype float32

The machine is shared and noisy, so the two versions run alternately in the same process and the
table gives the median of `--repeats` calls of each. The other revision's kernel module is read
with `git show` and imported beside ours (it imports this tree's helpers). Sizes follow the
hybrid of bench/throughput.py: Mamba-2 24 heads x 64, d_state 128, 1 group; attention 12 query
heads, 4 KV heads of 64 with 400-token pages; a decode batch of 32 sequences of ~160 tokens and a
prefill of 16 fresh prompts x 128 tokens (one step of 2048 tokens).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from runtime.kernels import cpu_compile  # noqa: E402
from runtime.kernels.metadata import build_attention_metadata, build_mamba_prefill_metadata  # noqa: E402

HEADS, HEAD_DIM, D_STATE, GROUPS, CHUNK = 24, 64, 128, 1, 256
Q_HEADS, KV_HEADS, ATTN_DIM, PAGE = 12, 4, 64, 400
DECODES, CONTEXT = 32, 160
PREFILLS, PROMPT = 16, 128


def load(module: str, revision: str | None):
    """runtime.<module> ("kernels.ssd_scan") from this tree (revision None) or from `git show revision:...`."""
    if revision is None:
        return importlib.import_module(f"runtime.{module}")
    source = subprocess.run(["git", "show", f"{revision}:runtime/{module.replace('.', '/')}.py"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / f"{module.replace('.', '_')}_{revision.replace('/', '_')}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def decode_attention(module, dtype: torch.dtype) -> Callable[[], object]:
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(DECODES + 4, PAGE, KV_HEADS, ATTN_DIM, generator=gen).to(dtype)
    v_cache = torch.randn_like(k_cache)
    lens = (torch.arange(DECODES) % 9 + CONTEXT - 4).tolist()
    block_table = torch.randperm(DECODES + 4, generator=gen)[:DECODES].int()[:, None]
    meta = build_attention_metadata([1] * DECODES, lens, "cpu")
    q = torch.randn(DECODES, Q_HEADS, ATTN_DIM, generator=gen).to(dtype)
    out = torch.empty_like(q)
    return lambda: module.paged_attention_ref(q, k_cache, v_cache, block_table, meta, 0.125, out)


def state_update(module, dtype: torch.dtype) -> Callable[[], object]:
    gen = torch.Generator().manual_seed(0)
    states = torch.randn(DECODES + 4, HEADS, HEAD_DIM, D_STATE, generator=gen).to(dtype)
    x = torch.randn(DECODES, HEADS, HEAD_DIM, generator=gen).to(dtype)
    dt = torch.randn(DECODES, HEADS, generator=gen).to(dtype)
    B, C = (torch.randn(DECODES, GROUPS, D_STATE, generator=gen).to(dtype) for _ in range(2))
    A, D, dt_bias = -torch.rand(HEADS, generator=gen), torch.ones(HEADS), torch.zeros(HEADS)
    slots = torch.randperm(DECODES + 4, generator=gen)[:DECODES]
    out = torch.empty_like(x)
    return lambda: module.selective_state_update_ref(states, x, dt, A, B, C, D, dt_bias, (0.0, float("inf")), slots,
                                                     out)


def prefill_scan(module, dtype: torch.dtype) -> Callable[[], object]:
    gen = torch.Generator().manual_seed(0)
    tokens = PREFILLS * PROMPT
    states = torch.randn(PREFILLS + 4, HEADS, HEAD_DIM, D_STATE, generator=gen).to(dtype)
    x = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen).to(dtype)
    dt = (torch.randn(tokens, HEADS, generator=gen) - 2).to(dtype)
    B, C = (torch.randn(tokens, GROUPS, D_STATE, generator=gen).to(dtype) for _ in range(2))
    A, D, dt_bias = -torch.rand(HEADS, generator=gen) * 8, torch.ones(HEADS), torch.zeros(HEADS)
    slots = torch.randperm(PREFILLS + 4, generator=gen)[:PREFILLS]
    meta = build_mamba_prefill_metadata([PROMPT] * PREFILLS, [0] * PREFILLS, CHUNK, "cpu")
    out = torch.empty_like(x)
    return lambda: module.ssd_scan_ref(x, dt, A, B, C, D, dt_bias, (0.0, float("inf")), states, slots, meta, out)


def linears(module, dtype: torch.dtype, rows: int) -> Callable[[], object]:
    """Every linear of the hybrid's Mamba layer, MLP and LM head once, as pack_linears leaves them."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(768, 3352), (1536, 768), (768, 2048), (1024, 768), (768, 32000)]
    model = torch.nn.Sequential(*(torch.nn.Linear(k, n, bias=False) for k, n in shapes)).to(dtype)
    module.pack_linears(model)
    inputs = [torch.randn(rows, k, generator=gen).to(dtype) for k, _ in shapes]
    return lambda: [layer(x) for layer, x in zip(model, inputs)]


OPS = {
    "decode_attention": ("kernels.paged_attention", decode_attention),
    "state_update": ("kernels.ssm_state_update", state_update),
    "prefill_scan": ("kernels.ssd_scan", prefill_scan),
    "decode_linears": ("layers.linear", lambda module, dtype: linears(module, dtype, DECODES)),
    "prefill_linears": ("layers.linear", lambda module, dtype: linears(module, dtype, PREFILLS * PROMPT)),
}


def median_ms(fn: Callable[[], object], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return times


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", default="main", help="git revision to compare with (default: main)")
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--no-compile", action="store_true", help="run the references eagerly")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu_compile.enable(not args.no_compile)
    dtype = getattr(torch, args.dtype)
    print(f"{args.dtype}, {args.threads} threads, compiled: {not args.no_compile}; ms, median of {args.repeats}\n")
    print(f"| op | {args.against} | this tree | ratio |\n| --- | ---: | ---: | ---: |")
    for name in args.ops.split(","):
        module_name, make = OPS[name]
        fns = [make(load(module_name, rev), dtype) for rev in (args.against, None)]
        for fn in fns:  # warm-up (and compile)
            fn(), fn()
        times: list[list[float]] = [[], []]
        for _ in range(args.repeats):
            for i, fn in enumerate(fns):
                times[i] += median_ms(fn, 1)
        before, after = (statistics.median(t) for t in times)
        print(f"| {name} | {before:.2f} | {after:.2f} | {before / after:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
