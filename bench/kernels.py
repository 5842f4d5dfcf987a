"""Times the Triton kernels at Bamba-9B-like layer sizes on a GPU, and reports achieved bandwidth.

    python bench/kernels.py                 # on a CUDA GPU: one table, a few minutes on an H200
    python bench/kernels.py --dry-run       # anywhere: every case once at toy sizes under the interpreter
    python bench/kernels.py --compile-only  # anywhere: compile every case's kernels for sm_90, no GPU needed

For each case it times the kernel with triton.testing.do_bench, counts the bytes the kernel must
move at least (inputs read once, outputs and states written once; no scratch), and divides by
the device's copy bandwidth (a large device-to-device tensor copy, read + write). Prefill cases
also report TFLOP/s, since they can be compute-bound. Shapes: Mamba-2 H=128, P=64, N=128, G=1,
W=4, d_inner=8192, chunk 256; attention Hq=32, Hkv=8, Dh=128 with 528-token pages (the hybrid page
size); Mamba-1 (not in Bamba) d_inner=8192, N=16 as in Falcon-Mamba-7B; the short convolution (not in
Bamba) D=1536, W=3 as in LFM2-700M; the gated delta rule (not in Bamba) 16 key and 32 value heads of 128
as in Qwen3-Next-80B-A3B, with a float32 recurrent state. Activations bfloat16.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

# Before triton is imported: TRITON_INTERPRET takes effect when the kernels are decorated.
if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
elif "--compile-only" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

if "--compile-only" in sys.argv:
    import triton  # noqa: E402, F401  (here, before runtime: on a machine without a GPU runtime imports it only so)

TIME_BUDGET_S = 420  # stop starting new cases after 7 minutes, to stay under 8 on an H200


@dataclass(frozen=True)
class Sizes:
    heads: int = 128
    head_dim: int = 64
    d_state: int = 128
    groups: int = 1
    width: int = 4
    chunk: int = 256
    q_heads: int = 32
    kv_heads: int = 8
    attn_head_dim: int = 128
    page: int = 528
    mamba1_inner: int = 8192
    mamba1_state: int = 16
    short_conv_dim: int = 1536  # LFM2-700M's hidden size
    short_conv_width: int = 3
    gdn_k_heads: int = 16  # Qwen3-Next-80B-A3B's Gated DeltaNet: key heads, value heads, head dim (keys and values)
    gdn_v_heads: int = 32
    gdn_head_dim: int = 128
    batches: tuple[int, ...] = (1, 16, 64, 256)
    contexts: tuple[int, ...] = (1024, 4096, 32768)
    prefills: tuple[int, ...] = (1024, 8192, 32768)
    attn_prefills: tuple[tuple[int, int], ...] = ((2048, 4096), (8192, 8192), (2048, 32768))  # (new, total)
    batched_prefill: tuple[int, int] = (8, 4096)  # sequences x tokens

    @property
    def d_inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.groups * self.d_state


# The layer dimensions of Sizes() (so the kernels get the same block sizes), with small batches.
SMALL_BATCHES = Sizes(batches=(1, 4), contexts=(600,), prefills=(300,), attn_prefills=((40, 600),),
                      batched_prefill=(2, 100))
TOY = Sizes(heads=4, head_dim=16, d_state=16, chunk=16, q_heads=4, kv_heads=2, attn_head_dim=16, page=24,
            mamba1_inner=32, mamba1_state=8, short_conv_dim=40, gdn_k_heads=2, gdn_v_heads=4, gdn_head_dim=16,
            batches=(1, 3), contexts=(40,), prefills=(40,),
            attn_prefills=((9, 40),), batched_prefill=(3, 13))


@dataclass
class Case:
    kernel: str
    shape: str
    run: Callable[[], object]
    bytes: float
    flops: float = 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="run every case once at toy sizes (no GPU needed)")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile every case's kernels for sm_90 (H100/H200) without a GPU; print registers")
    args = parser.parse_args(argv)
    if args.dry_run:
        return dry_run()
    if args.compile_only:
        return compile_only()
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU, and none is available here: nothing measured.")
        return 0
    from runtime.kernels._triton_utils import interpreting

    if interpreting():
        print("TRITON_INTERPRET is set: unset it to time compiled kernels.")
        return 2
    return benchmark(Sizes())


def benchmark(sizes: Sizes) -> int:
    from triton.testing import do_bench

    started = time.time()
    copy_bw = copy_bandwidth(do_bench)
    print(f"device: {torch.cuda.get_device_name()}; copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)")
    print(f"| {'kernel':<30} | {'shape':<28} | {'time µs':>9} | {'MB moved':>9} | {'GB/s':>7} | {'% copy':>6} "
          f"| {'TFLOP/s':>7} |")
    print(f"|{'-' * 32}|{'-' * 30}|{'-' * 10}:|{'-' * 10}:|{'-' * 8}:|{'-' * 7}:|{'-' * 8}:|")
    for case in all_cases(sizes, "cuda"):
        if time.time() - started > TIME_BUDGET_S:
            print(f"time budget of {TIME_BUDGET_S} s spent: remaining cases skipped")
            break
        ms = do_bench(case.run, warmup=10, rep=50)
        seconds = ms / 1e3
        tflops = f"{case.flops / seconds / 1e12:7.1f}" if case.flops else " " * 7
        print(f"| {case.kernel:<30} | {case.shape:<28} | {ms * 1e3:9.1f} | {case.bytes / 1e6:9.2f} "
              f"| {case.bytes / seconds / 1e9:7.0f} | {100 * case.bytes / seconds / copy_bw:5.0f}% | {tflops} |")
    print(f"total {time.time() - started:.0f} s")
    return 0


def dry_run() -> int:
    count = 0
    for case in all_cases(TOY, "cpu"):
        case.run()
        assert case.bytes > 0, case
        count += 1
    print(f"dry run: {count} cases ran once at toy sizes under the interpreter")
    return 0


def compile_only() -> int:
    """Compile (never launch) each kernel variant the cases use, at the real layer sizes and at toy
    sizes, for sm_90 through a stand-in driver; ptxas reports registers and spills."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class Sm90:  # what JITFunction.run asks of the driver before it launches
        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

    driver.set_active(Sm90())
    compiled: dict[tuple[str, str], object] = {}
    run = JITFunction.run

    def compile_without_launch(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled[(self.fn.__name__, kernel.hash)] = kernel
        return kernel

    JITFunction.run = compile_without_launch
    for sizes in (SMALL_BATCHES, TOY):
        for case in all_cases(sizes, "cpu"):
            case.run()
    ptxas = get_ptxas(90).path
    spilled = 0
    with tempfile.TemporaryDirectory() as tmp:
        for (name, _), kernel in sorted(compiled.items(), key=lambda item: item[0]):
            ptx = Path(tmp) / "kernel.ptx"
            ptx.write_text(kernel.asm["ptx"])
            info = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp) / "kernel.cubin")],
                                  capture_output=True, text=True, check=True).stderr
            registers = re.search(r"Used (\d+) registers", info)
            spill = re.search(r"(\d+) bytes spill stores", info)
            spilled += bool(spill and int(spill[1]))
            print(f"{name:<40} warps={kernel.metadata.num_warps} shared={kernel.metadata.shared:>6} B "
                  f"registers={registers[1] if registers else '?':>3} spill stores={spill[1] if spill else '?'} B")
    print(f"{len(compiled)} kernel variants compiled for sm_90; {spilled} spill registers to local memory")
    return 0


def copy_bandwidth(do_bench) -> float:
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=50)
    return 2 * src.numel() / (ms / 1e3)


def all_cases(s: Sizes, device: str) -> Iterator[Case]:
    yield from attention_cases(s, device)
    yield from mamba2_decode_cases(s, device)
    yield from mamba2_prefill_cases(s, device)
    yield from mamba1_cases(s, device)
    yield from short_conv_cases(s, device)
    yield from gated_delta_rule_cases(s, device)


BF16 = torch.bfloat16
NO_DT_LIMIT = (0.0, float("inf"))


def attention_cases(s: Sizes, device: str) -> Iterator[Case]:
    from runtime.kernels.kv_cache import store_kv_triton
    from runtime.kernels.metadata import build_attention_metadata
    from runtime.kernels.paged_attention import paged_attention_triton

    pages_per_seq = math.ceil(max(s.contexts) / s.page)
    num_pages = max(max(s.batches) * pages_per_seq, math.ceil(max(t for _, t in s.attn_prefills) / s.page))
    pool = torch.empty(num_pages, 2, s.page, s.kv_heads, s.attn_head_dim, dtype=BF16, device=device).normal_()
    k_cache, v_cache = pool[:, 0], pool[:, 1]  # strided page views, as the engine's
    token_bytes = 2 * s.kv_heads * s.attn_head_dim * 2  # K and V of one token

    for tokens in (1, max(s.batches), 8192 if device == "cuda" else 50):
        kv = torch.randn(2, tokens, s.kv_heads, s.attn_head_dim, dtype=BF16, device=device)
        slots = torch.randperm(num_pages * s.page, device=device)[:tokens]
        run = partial(store_kv_triton, kv[0], kv[1], k_cache, v_cache, slots)
        yield Case("store_kv", f"T={tokens}", run, 2 * tokens * token_bytes + 8 * tokens)

    def attention(name: str, query_lens: list[int], seq_lens: list[int]) -> Case:
        blocks = max(math.ceil(n / s.page) for n in seq_lens)
        assert len(seq_lens) * blocks <= num_pages
        # Distinct pages in random order: each sequence's keys are scattered over the pool.
        table = torch.randperm(num_pages, device=device)[: len(seq_lens) * blocks].view(len(seq_lens), -1).int()
        meta = build_attention_metadata(query_lens, seq_lens, device)
        q = torch.randn(sum(query_lens), s.q_heads, s.attn_head_dim, dtype=BF16, device=device)
        out = torch.empty_like(q)
        moved = sum(seq_lens) * token_bytes + 2 * q.numel() * 2 + table.numel() * 4
        visible = sum(sum(n - q_len + i + 1 for i in range(q_len)) for q_len, n in zip(query_lens, seq_lens))
        flops = 4 * s.q_heads * s.attn_head_dim * visible
        run = partial(paged_attention_triton, q, k_cache, v_cache, table, meta, s.attn_head_dim**-0.5, out)
        return Case("paged_attention " + name, f"{shape(query_lens, seq_lens)}", run, moved, flops)

    for context in s.contexts:
        for batch in s.batches:
            yield attention("decode", [1] * batch, [context] * batch)
    for new, total in s.attn_prefills:
        yield attention("prefill", [new], [total])


def shape(query_lens: list[int], seq_lens: list[int]) -> str:
    if all(q == 1 for q in query_lens):
        return f"b={len(seq_lens)} L={seq_lens[0]}"
    return f"q={query_lens[0]} L={seq_lens[0]}" + (f" x{len(seq_lens)}" if len(seq_lens) > 1 else "")


def mamba2_decode_cases(s: Sizes, device: str) -> Iterator[Case]:
    from runtime.kernels.causal_conv1d import causal_conv1d_update_triton
    from runtime.kernels.rms_norm_gated import rms_norm_gated_triton
    from runtime.kernels.ssm_state_update import selective_state_update_triton

    for state_dtype in (torch.float32, BF16):
        slots_total = max(s.batches) + 1
        ssm = torch.empty(slots_total, s.heads, s.head_dim, s.d_state, dtype=state_dtype, device=device).normal_()
        size = state_dtype.itemsize
        for batch in s.batches:
            x = torch.randn(batch, s.heads, s.head_dim, dtype=BF16, device=device)
            bc = torch.randn(2, batch, s.groups, s.d_state, dtype=BF16, device=device)
            dt = torch.randn(batch, s.heads, dtype=BF16, device=device)
            params = param_tensors(s, device)
            slots = torch.randperm(slots_total, device=device)[:batch]
            out = torch.empty_like(x)
            run = partial(selective_state_update_triton, ssm, x, dt, params["A"], bc[0], bc[1], params["D"],
                          params["dt_bias"], NO_DT_LIMIT, slots, out)
            moved = batch * (2 * s.heads * s.head_dim * s.d_state * size
                             + (2 * s.heads * s.head_dim + 2 * s.groups * s.d_state + s.heads) * 2)
            yield Case(f"ssm_state_update ({str(state_dtype)[6:]})", f"b={batch}", run, moved)

    conv_states = torch.empty(max(s.batches) + 1, s.width - 1, s.conv_dim, dtype=BF16, device=device).normal_()
    weight = torch.randn(s.conv_dim, s.width, dtype=BF16, device=device)
    bias = torch.randn(s.conv_dim, dtype=BF16, device=device)
    for batch in s.batches:
        x = torch.randn(batch, s.conv_dim, dtype=BF16, device=device)
        slots = torch.randperm(conv_states.shape[0], device=device)[:batch]
        run = partial(causal_conv1d_update_triton, x, weight, bias, conv_states, slots)
        yield Case("causal_conv1d_update", f"b={batch}", run, batch * s.conv_dim * 2 * (2 * (s.width - 1) + 2))

    norm_weight = torch.rand(s.d_inner, dtype=BF16, device=device)
    for tokens in (*s.batches, max(s.prefills)):
        x, z = torch.randn(2, tokens, s.d_inner, dtype=BF16, device=device)
        run = partial(rms_norm_gated_triton, x, z, norm_weight, 1e-5, s.d_inner // s.groups)
        yield Case("rms_norm_gated", f"T={tokens}", run, 3 * tokens * s.d_inner * 2)


def param_tensors(s: Sizes, device: str) -> dict[str, torch.Tensor]:
    return dict(A=-torch.rand(s.heads, device=device) - 0.5, D=torch.randn(s.heads, device=device),
                dt_bias=torch.rand(s.heads, device=device))


def mamba2_prefill_cases(s: Sizes, device: str) -> Iterator[Case]:
    from runtime.kernels.causal_conv1d import causal_conv1d_fn_triton
    from runtime.kernels.metadata import build_mamba_prefill_metadata
    from runtime.kernels.ssd_scan import ssd_scan_triton

    num, length = s.batched_prefill
    batches = [[n] for n in s.prefills] + [[length] * num]
    weight = torch.randn(s.conv_dim, s.width, dtype=BF16, device=device)
    params = param_tensors(s, device)
    for lens in batches:
        tokens = sum(lens)
        meta = build_mamba_prefill_metadata(lens, [0] * len(lens), s.chunk, device)
        slots = torch.arange(len(lens), device=device)
        conv_states = torch.empty(len(lens), s.width - 1, s.conv_dim, dtype=BF16, device=device)
        xbc = torch.randn(tokens, s.conv_dim, dtype=BF16, device=device)
        run = partial(causal_conv1d_fn_triton, xbc, weight, None, conv_states, slots, meta)
        name = f"T={tokens}" if len(lens) == 1 else f"{len(lens)} x {length}"
        yield Case("causal_conv1d_fn", name, run, tokens * s.conv_dim * 2 * 2)

        x, B, C = xbc.split([s.d_inner, s.groups * s.d_state, s.groups * s.d_state], dim=-1)
        x = x.reshape(tokens, s.heads, s.head_dim)
        B, C = B.reshape(tokens, s.groups, s.d_state), C.reshape(tokens, s.groups, s.d_state)
        dt = torch.randn(tokens, s.heads, dtype=BF16, device=device) - 2
        ssm = torch.zeros(len(lens), s.heads, s.head_dim, s.d_state, dtype=torch.float32, device=device)
        out = torch.empty_like(x)
        run = partial(ssd_scan_triton, x, dt, params["A"], B, C, params["D"], params["dt_bias"], NO_DT_LIMIT, ssm,
                      slots, meta, out)
        moved = tokens * (2 * s.d_inner + 2 * s.groups * s.d_state + s.heads) * 2 + ssm.numel() * 4
        # CB, chunk states, and the two halves of the chunk scan, per chunk of Q tokens.
        per_token = 2 * (s.chunk * s.groups * s.d_state + 2 * s.d_inner * s.d_state + s.chunk * s.d_inner / 2)
        yield Case("ssd_scan", name, run, moved, tokens * per_token)


def mamba1_cases(s: Sizes, device: str) -> Iterator[Case]:
    from runtime.kernels.metadata import build_mamba_prefill_metadata
    from runtime.kernels.selective_scan import selective_scan_triton, selective_state_update_mamba1_triton

    dm, n = s.mamba1_inner, s.mamba1_state
    A = -torch.rand(dm, n, device=device) - 0.5
    D, dt_bias = torch.randn(dm, device=device), torch.rand(dm, device=device)
    states = torch.zeros(max(s.batches) + 1, dm, n, dtype=torch.float32, device=device)
    for tokens in s.prefills[:2]:
        meta = build_mamba_prefill_metadata([tokens], [0], s.chunk, device)
        x, dt, z = torch.randn(3, tokens, dm, dtype=BF16, device=device)
        bc = torch.randn(2, tokens, n, dtype=BF16, device=device)
        out = torch.empty_like(x)
        slot = torch.zeros(1, dtype=torch.long, device=device)
        run = partial(selective_scan_triton, x, dt, A, bc[0], bc[1], D, dt_bias, z, states, slot, meta, out)
        yield Case("mamba1 selective_scan", f"T={tokens}", run, tokens * (4 * dm + 2 * n) * 2 + dm * n * 8)
    for batch in s.batches:
        x, dt, z = torch.randn(3, batch, dm, dtype=BF16, device=device)
        bc = torch.randn(2, batch, n, dtype=BF16, device=device)
        slots = torch.randperm(states.shape[0], device=device)[:batch]
        out = torch.empty_like(x)
        run = partial(selective_state_update_mamba1_triton, states, x, dt, A, bc[0], bc[1], D, dt_bias, z, slots, out)
        yield Case("mamba1 state_update", f"b={batch}", run, batch * (2 * dm * n * 4 + (4 * dm + 2 * n) * 2))


def short_conv_cases(s: Sizes, device: str) -> Iterator[Case]:
    """LFM2's gated short convolution: in_proj's (T, 3D) output in, C * conv(B * x) out, (W-1, D) states."""
    from runtime.kernels.metadata import build_mamba_prefill_metadata
    from runtime.kernels.short_conv import short_conv_fn_triton, short_conv_update_triton

    dim, width = s.short_conv_dim, s.short_conv_width
    weight = torch.randn(dim, width, dtype=BF16, device=device)
    states = torch.empty(max(s.batches) + 1, width - 1, dim, dtype=BF16, device=device).normal_()
    for tokens in s.prefills:
        meta = build_mamba_prefill_metadata([tokens], [0], s.chunk, device)
        bcx = torch.randn(tokens, 3 * dim, dtype=BF16, device=device)
        slot = torch.zeros(1, dtype=torch.long, device=device)
        run = partial(short_conv_fn_triton, bcx, weight, None, states, slot, meta)
        yield Case("short_conv_fn", f"T={tokens}", run, tokens * 4 * dim * 2)
    for batch in s.batches:
        bcx = torch.randn(batch, 3 * dim, dtype=BF16, device=device)
        slots = torch.randperm(states.shape[0], device=device)[:batch]
        run = partial(short_conv_update_triton, bcx, weight, None, states, slots)
        yield Case("short_conv_update", f"b={batch}", run, batch * (4 * dim + 2 * (width - 1) * dim) * 2)


def gated_delta_rule_cases(s: Sizes, device: str) -> Iterator[Case]:
    """Gated DeltaNet's delta rule: q, k (T, Hk, D), v (T, Hv, D), a and b (T, Hv) in; (T, Hv, D) out;
    (Hv, D, D) float32 states read and written once per sequence."""
    from runtime.kernels.gated_delta_rule import gated_delta_rule_fn_triton, gated_delta_rule_update_triton
    from runtime.kernels.metadata import build_mamba_prefill_metadata

    hk, hv, d = s.gdn_k_heads, s.gdn_v_heads, s.gdn_head_dim
    A_log, dt_bias = torch.rand(hv, device=device) + 0.5, torch.rand(hv, device=device)
    states = torch.empty(max(s.batches) + 1, hv, d, d, dtype=torch.float32, device=device).normal_()
    state_bytes = hv * d * d * 4
    per_token = (2 * hk * d + 2 * hv * d + 2 * hv) * 2  # q, k, v, a, b in and the output, bfloat16

    def inputs(tokens: int) -> tuple[torch.Tensor, ...]:
        qk = torch.randn(tokens, 2, hk, d, dtype=BF16, device=device)
        ab = torch.randn(2, tokens, hv, dtype=BF16, device=device)
        return qk[:, 0], qk[:, 1], torch.randn(tokens, hv, d, dtype=BF16, device=device), ab[0], ab[1]

    for tokens in s.prefills[:2]:
        meta = build_mamba_prefill_metadata([tokens], [0], 64, device)
        slot = torch.zeros(1, dtype=torch.long, device=device)
        run = partial(gated_delta_rule_fn_triton, *inputs(tokens), A_log, dt_bias, states, slot, meta)
        # Per token and value head: decay, S^T k, the rank-1 update and S^T q over the (D, D) state.
        yield Case("gated_delta_rule_fn", f"T={tokens}", run, tokens * per_token + 2 * state_bytes,
                   tokens * hv * 7 * d * d)
    for batch in s.batches:
        slots = torch.randperm(states.shape[0], device=device)[:batch]
        run = partial(gated_delta_rule_update_triton, *inputs(batch), A_log, dt_bias, states, slots)
        yield Case("gated_delta_rule_update", f"b={batch}", run, batch * (per_token + 2 * state_bytes))


if __name__ == "__main__":
    sys.exit(main())
