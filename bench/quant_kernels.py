"""Times the quantized linears (runtime/kernels/quant_linear.py's quant_linear) against unquantized ones of the
same shape on this CPU: batch-1 decode as the bandwidth of weight bytes read, and prefill batches.

    python bench/quant_kernels.py                       # N = K = 2048, prefill M = 128 and 512, 2 threads
    python bench/quant_kernels.py --quick               # the smallest settings, to see that it runs
    python bench/quant_kernels.py --shapes 2048x2048 8192x2048 2048x8192 --decode-rows 1 4 16 --rows
                                                        # decode of a ~1B model's shapes (N x K), no prefill

Decode cycles through enough distinct weights to exceed the last-level cache (--stream-mb of each format), so
the weights come from memory as in a model's step; the copy bandwidth is a torch copy of a buffer of that size
(bytes read per second, the same count). bfloat16 decode runs on tandem::gemv (what a bfloat16 model's decode
linear runs); where quant_linear runs int4 on integer activations (--activations bfloat16 on a CPU without AVX-512
BF16: quant_linear.x16_runs), `weight-only` beside it is tandem::quant_gemm on the same weights; prefill baselines
are torch's nn.functional.linear in float32 and bfloat16. The best of --repeats
runs (see best_seconds); with one thread, that thread's CPU time. Besides the on-the-fly formats, the GGUF
block layouts' group sizes: Q8_0 (int8, groups of 32), Q6_K (int8, 16), Q4_K (int4, 32, with offsets).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from runtime.kernels import cpu_native  # noqa: E402
from runtime.kernels.quant_linear import quant_linear, quantize, x16_runs  # noqa: E402


CLOCK = time.perf_counter  # main() takes this thread's CPU time instead where one thread runs everything


def best_seconds(fn, repeats: int) -> float:
    """The fastest of `repeats` runs after a warm-up: on a machine shared with other work the slower runs
    measure the others."""
    fn()
    times = []
    for _ in range(repeats):
        start = CLOCK()
        fn()
        times.append(CLOCK() - start)
    return min(times)


def fp8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-output-channel FP8 e4m3 (compressed-tensors' FP8_DYNAMIC weights): scale = max|w| / 448."""
    scales = weight.abs().amax(dim=1, keepdim=True) / 448
    return (weight / scales).to(torch.float8_e4m3fn), scales.float(), weight.shape[1]


def grouped(qweight: torch.Tensor, n: int, k: int, group_size: int, offsets: bool) -> tuple:
    """qweight with scales (and offsets) per group of group_size: the GGUF block layouts' cost."""
    groups = -(-k // group_size)
    return qweight, torch.rand(n, groups) * 1e-2, group_size, torch.randn(n, groups) * 1e-3 if offsets else None


def formats(weight: torch.Tensor) -> dict[str, tuple]:
    int4, int8 = quantize(weight, "int4"), quantize(weight, "int8")
    n, k = weight.shape
    return {"int8": (*int8, None), "int4": (*int4, None),
            "int4+offsets": (*int4, torch.randn_like(int4[1]) * 1e-3), "fp8": (*fp8_weight(weight), None),
            "int8 g32 (Q8_0)": grouped(int8[0], n, k, 32, False), "int8 g16 (Q6_K)": grouped(int8[0], n, k, 16, False),
            "int4 g32+off (Q4_K)": grouped(int4[0], n, k, 32, True)}


def weight_bytes(parts: tuple) -> int:
    return sum(t.numel() * t.element_size() for t in parts if isinstance(t, torch.Tensor))


def decode(n: int, k: int, stream_mb: int, repeats: int, m: int = 1, only: list[str] | None = None,
           activations: torch.dtype = torch.float32) -> None:
    """The cases take turns, repeat by repeat, so that each sees the machine's other work alike; m rows of x, of
    the model's dtype `activations` (a bfloat16 model's x lets int4 run in bfloat16 where the CPU has it)."""
    x = torch.randn(m, k).to(activations)
    base = torch.randn(n, k)
    runs, sizes = {}, {}
    one = base.to(torch.bfloat16)
    copies = [one.clone() for _ in range(max(1, stream_mb * 2**20 // (one.numel() * 2)))]
    gemm = cpu_native.gemv if m <= cpu_native.GEMV_MAX_ROWS else cpu_native.small_gemm
    runs["bfloat16 (gemv)"] = (lambda copies=copies: [gemm(x, w, None) for w in copies]), len(copies)
    sizes["bfloat16 (gemv)"] = one.numel() * 2
    for name, parts in formats(base).items():
        if only and name not in only:
            continue
        sizes[name] = weight_bytes(parts)
        copies = [tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in parts)
                  for _ in range(max(1, stream_mb * 2**20 // sizes[name]))]
        runs[name] = (lambda copies=copies: [quant_linear(x, q, s, g, None, o) for q, s, g, o in copies]), len(copies)
        if x16_runs(x, parts[0], parts[2]):  # quant_linear runs integer activations: the weight-only kernel beside
            sizes[name + " weight-only"] = sizes[name]
            runs[name + " weight-only"] = (lambda copies=copies: [
                cpu_native.quant_gemm(x, q, s, g, None, o) for q, s, g, o in copies]), len(copies)
    source = torch.empty(stream_mb * 2**20, dtype=torch.uint8).random_()
    target = torch.empty_like(source)
    runs["copy"], sizes["copy"] = (lambda: target.copy_(source), 1), source.numel()
    best = {name: float("inf") for name in runs}
    for _ in range(repeats):
        for name, (run, count) in runs.items():
            best[name] = min(best[name], best_seconds(run, 1) / count)
    print(f"decode, {m} row(s) of {activations}, N={n} K={k}: GB/s of weight bytes read "
          f"(weights cycled past {stream_mb} MB)")
    for name, seconds in best.items():
        if name == "copy":
            print(f"  copy of {stream_mb} MB: {sizes[name] / seconds / 1e9:6.1f} GB/s read (as much written)")
        else:
            print(f"  {name:28s} {seconds * 1e6:8.1f} us  {sizes[name] / seconds / 1e9:6.1f} GB/s")


def prefill(n: int, k: int, rows: list[int], repeats: int) -> None:
    base = torch.randn(n, k)
    cases = formats(base)
    bf16 = base.to(torch.bfloat16)
    print(f"prefill, N={n} K={k}: ms per call")
    for m in rows:
        x = torch.randn(m, k)
        f32 = best_seconds(lambda: torch.nn.functional.linear(x, base), repeats)
        half = best_seconds(lambda: torch.nn.functional.linear(x.to(torch.bfloat16), bf16), repeats)
        line = [f"f32 {f32 * 1e3:7.2f}", f"bf16 {half * 1e3:7.2f}"]
        for name, (q, s, g, o) in cases.items():
            line.append(f"{name} {best_seconds(lambda: quant_linear(x, q, s, g, None, o), repeats) * 1e3:7.2f}")
        print(f"  M={m:4d}  " + "  ".join(line))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--size", type=int, default=2048, help="N = K")
    parser.add_argument("--shapes", nargs="+", default=None, help="NxK weight shapes (instead of --size)")
    parser.add_argument("--decode-rows", type=int, nargs="+", default=[1], help="rows of x in decode")
    parser.add_argument("--activations", choices=["float32", "bfloat16"], default="float32",
                        help="x's dtype in decode (a bfloat16 model's)")
    parser.add_argument("--formats", nargs="+", default=None, help="decode only these formats (e.g. int8 int4)")
    parser.add_argument("--rows", type=int, nargs="*", default=[16, 128, 512], help="prefill batches")
    parser.add_argument("--stream-mb", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="N = K = 256, M = 32, 8 MB, 2 repeats")
    args = parser.parse_args()
    if args.quick:
        args.size, args.rows, args.stream_mb, args.repeats = 256, [32], 8, 2
    torch.set_num_threads(args.threads)
    global CLOCK
    if args.threads == 1:  # the time this thread ran: not the time other processes took the core
        CLOCK = time.thread_time
    print(f"threads {args.threads} ({CLOCK.__name__}), native library: {cpu_native.available()}")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else [(args.size,) * 2]
    for n, k in shapes:
        for m in args.decode_rows:
            decode(n, k, args.stream_mb, args.repeats, m, args.formats, getattr(torch, args.activations))
        if args.rows:
            prefill(n, k, args.rows, args.repeats)


if __name__ == "__main__":
    main()
