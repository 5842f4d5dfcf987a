"""The native CPU kernels as torch operators: every tensor argument is checked before a pointer reaches C (a
RuntimeError naming the operator and the argument, under `python -O` too), and the profiler and torch.compile
see the operators by name."""

import os
import subprocess
import sys

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.kernels import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="the native CPU kernels do not build here")

f32, bf16, i32, i64 = torch.float32, torch.bfloat16, torch.int32, torch.int64


def valid_arguments(op: str) -> list:
    """Arguments each operator accepts: small random tensors of the shapes and types its schema documents."""
    torch.manual_seed(0)
    r = torch.randn
    if op == "ssm_state_update":  # 2 sequences, 2 heads of 4, one group, d_state 8, a pool of 4 slots
        return [r(4, 2, 4, 8), torch.tensor([0, 2]), r(2, 2, 4), r(2, 2), r(2), False, 0.0, 0.0, -r(2).abs(),
                r(2, 1, 8), r(2, 1, 8), r(2, 4), torch.empty(2, 2, 4)]
    if op == "conv_update":  # 2 sequences, 6 channels, width 4
        return [r(4, 3, 6), torch.tensor([1, 3]), r(2, 6), r(6, 4), r(6), True, torch.empty(2, 6)]
    if op == "ssm_scan":  # sequences of 3 and 2 tokens
        starts = torch.tensor([0, 3, 5], dtype=i32)
        return [r(4, 2, 4, 8), torch.tensor([0, 1]), starts, torch.tensor([0, 1], dtype=torch.uint8), r(5, 2, 4),
                r(5, 2).abs(), r(5, 2).sigmoid(), r(5, 1, 8), r(5, 1, 8), r(2, 4), torch.empty(5, 2, 4)]
    if op == "conv_fn":
        starts = torch.tensor([0, 3, 5], dtype=i32)
        return [r(4, 3, 6), torch.tensor([0, 1]), starts, torch.tensor([0, 1], dtype=torch.uint8), r(5, 6), r(4, 6),
                r(6), True, torch.empty(5, 6)]
    if op == "rms_norm":
        return [r(3, 8), r(3, 8), r(8), 1e-5, 4, torch.empty(3, 8)]
    if op == "rotary":
        return [r(3, 2, 8), r(3, 4), r(3, 4), torch.empty(3, 2, 8)]
    if op in ("gemv", "small_gemm"):
        return [r(6, 8), r(2, 8), r(6), torch.empty(2, 6)]
    if op == "decode_attention":  # pages of 4 tokens, 2 KV heads of 8, 4 query heads
        table = torch.tensor([[0, 1], [2, 0]], dtype=i32)
        return [r(2, 4, 8), False, r(3, 4, 2, 8), r(3, 4, 2, 8), table, torch.tensor([5, 3], dtype=i32), 0.3,
                torch.empty(2, 4, 8)]
    if op == "silu_and_mul":
        return [r(3, 8), r(3, 8), torch.empty(3, 8)]
    if op == "store_kv":
        return [r(3, 2, 8), r(3, 2, 8), r(3, 4, 2, 8), r(3, 4, 2, 8), torch.tensor([0, 5, 11])]
    if op == "panel_gemm":
        return [cpu_native.pack_panels(r(40, 8)), r(2, 8), r(40), torch.empty(2, 40)]
    if op == "amx_gemm":
        return [cpu_native.pack_panels(r(40, 32).to(bf16)), r(2, 32).to(bf16), r(40), torch.empty(2, 40, dtype=bf16)]
    if op == "quant_gemm":  # int4: 6 features, K 40 in groups of 16 (the last partial), 16 values in 8 bytes
        return [torch.randint(0, 256, (6, 24), dtype=torch.uint8), r(6, 3).abs(), r(6, 3), 16, r(2, 40), r(6),
                torch.empty(2, 6)]
    if op == "quant_x16_gemm":  # int4: 6 features, K 64 in groups of 32 (a step of 64 values), integer x
        return [torch.randint(0, 256, (6, 32), dtype=torch.uint8), r(6, 2).abs(), r(6, 2), 32, r(2, 64), r(6),
                torch.empty(2, 6)]
    if op == "amx_quant_gemm":  # int4: 40 features, K 64 in one group (16 values in 8 bytes), a bfloat16 x
        return [torch.randint(0, 256, (40, 32), dtype=torch.uint8), r(40, 1).abs(), 128, r(2, 64).to(bf16), r(40),
                torch.empty(2, 40)]
    if op == "quant_dequantize":  # int8: 6 features, K 8 in one group
        return [torch.randint(-127, 128, (6, 8), dtype=torch.int8), r(6, 1).abs(), r(6, 1), 8, torch.empty(6, 8)]
    if op == "lora_shrink":  # 3 rows, 2 adapters and the zero slot, rank 4, 8 inputs
        return [r(3, 8), r(3, 4, 8), torch.tensor([0, 2, 1]), torch.empty(3, 4)]
    if op == "lora_expand":  # 3 rows, rank 4, 6 outputs
        return [r(3, 4), r(3, 4, 6), r(3, 6), torch.tensor([1, 2, 0]), r(3, 6)]
    raise AssertionError(op)


def argument_names(op: str) -> list[str]:
    return [argument.name for argument in getattr(torch.ops.tandem, op).default._schema.arguments]


def tensor_arguments(op: str) -> list[tuple[int, str]]:
    return [(i, name) for i, (name, value) in enumerate(zip(argument_names(op), valid_arguments(op)))
            if isinstance(value, torch.Tensor)]


def call(op: str, arguments: list) -> None:
    getattr(torch.ops.tandem, op)(*arguments)


def with_argument(op: str, index: int, value) -> list:
    arguments = valid_arguments(op)
    arguments[index] = value
    return arguments


RUNNABLE = [op for op in cpu_native.MUTATING_OPS if op not in ("panel_gemm", "amx_gemm", "amx_quant_gemm")]
CASES = [(op, i, name) for op in cpu_native.MUTATING_OPS for i, name in tensor_arguments(op)]
# store_kv copies rows of any dtype, the same for all four tensors: a changed key is told apart by the value.
DTYPE_NAMED = {("store_kv", "key"): "value"}


@pytest.mark.parametrize("op", RUNNABLE)
def test_valid_arguments_run(op):
    call(op, valid_arguments(op))


@pytest.mark.parametrize("op, index, name", CASES)
def test_a_wrong_dtype_names_the_argument(op, index, name):
    value = valid_arguments(op)[index]
    wrong = value.to(torch.float64) if value.is_floating_point() else value.to(i32 if value.dtype == i64 else i64)
    with pytest.raises(RuntimeError, match=f"tandem::{op}: argument '{DTYPE_NAMED.get((op, name), name)}' must"):
        call(op, with_argument(op, index, wrong))


@pytest.mark.parametrize("op, index, name", CASES)
def test_a_wrong_number_of_dimensions_names_the_argument(op, index, name):
    wrong = valid_arguments(op)[index].unsqueeze(0)
    with pytest.raises(RuntimeError, match=f"tandem::{op}: argument '{name}' must have \\d dimensions"):
        call(op, with_argument(op, index, wrong))


@pytest.mark.parametrize("op, index, name", CASES)
def test_a_non_contiguous_row_names_the_argument(op, index, name):
    value = valid_arguments(op)[index]
    strided = torch.empty(*value.shape[:-1], value.shape[-1] * 2, dtype=value.dtype)[..., ::2]
    strided.copy_(value)
    if value.shape[-1] == 1:
        pytest.skip("a dimension of size 1 has no stride to get wrong")
    with pytest.raises(RuntimeError, match=f"tandem::{op}: argument '{name}' must be contiguous"):
        call(op, with_argument(op, index, strided))


# Shapes that disagree with the others (same number of dimensions): (op, argument, wrong shape).
WRONG_SHAPES = [
    ("ssm_state_update", "dt", (2, 3)), ("ssm_state_update", "y", (2, 2, 5)), ("ssm_state_update", "slots", (3,)),
    ("ssm_state_update", "states", (4, 2, 4, 9)), ("ssm_state_update", "D", (2, 3)), ("ssm_state_update", "A", (3,)),
    ("conv_update", "states", (4, 2, 6)), ("conv_update", "out", (3, 6)), ("conv_update", "bias", (7,)),
    ("ssm_scan", "dt", (4, 2)), ("ssm_scan", "starts", (4,)), ("ssm_scan", "resume", (3,)), ("ssm_scan", "C", (5, 1, 9)),
    ("conv_fn", "out", (5, 7)), ("conv_fn", "states", (4, 2, 6)),
    ("rms_norm", "z", (3, 9)), ("rms_norm", "weight", (9,)), ("rms_norm", "out", (4, 8)),
    ("rotary", "sin", (3, 6)), ("rotary", "out", (3, 2, 9)),
    ("gemv", "x", (2, 9)), ("gemv", "y", (2, 7)), ("small_gemm", "bias", (5,)),
    ("decode_attention", "v_cache", (3, 4, 2, 9)), ("decode_attention", "seq_lens", (3,)),
    ("decode_attention", "out", (2, 4, 9)), ("silu_and_mul", "up", (3, 9)), ("store_kv", "slots", (2,)),
    ("store_kv", "value", (3, 2, 9)), ("panel_gemm", "y", (3, 40)),
    ("quant_gemm", "qweight", (6, 20)), ("quant_gemm", "scales", (6, 2)), ("quant_gemm", "offsets", (5, 3)),
    ("quant_gemm", "bias", (5,)), ("quant_gemm", "y", (2, 7)),
    ("quant_x16_gemm", "scales", (6, 1)), ("quant_x16_gemm", "offsets", (5, 2)), ("quant_x16_gemm", "y", (2, 7)),
    ("quant_dequantize", "qweight", (6, 9)), ("quant_dequantize", "scales", (6, 2)),
    ("quant_dequantize", "out", (7, 8)),
    ("amx_quant_gemm", "qweight", (40, 24)), ("amx_quant_gemm", "scales", (40, 2)), ("amx_quant_gemm", "bias", (39,)),
    ("amx_quant_gemm", "y", (2, 41)),
    ("lora_shrink", "lora_a", (3, 4, 9)), ("lora_shrink", "indices", (2,)), ("lora_shrink", "out", (3, 5)),
    ("lora_expand", "lora_b", (3, 5, 6)), ("lora_expand", "lora_bias", (3, 7)), ("lora_expand", "y", (3, 7)),
]


@pytest.mark.parametrize("op, name, shape", WRONG_SHAPES)
def test_a_wrong_shape_names_the_argument(op, name, shape):
    index = argument_names(op).index(name)
    value = valid_arguments(op)[index]
    wrong = torch.zeros(shape, dtype=value.dtype)
    with pytest.raises(RuntimeError, match=f"tandem::{op}: argument '{name}'"):
        call(op, with_argument(op, index, wrong))


@pytest.mark.parametrize("op, name, value, message", [
    ("ssm_state_update", "slots", torch.tensor([0, 4]), "holds 4 at 1, outside \\[-1, 4\\)"),
    ("conv_update", "slots", torch.tensor([-2, 0]), "holds -2 at 0"),
    ("ssm_scan", "starts", torch.tensor([0, 4, 3], dtype=i32), "must run from 0 to the number of tokens"),
    ("conv_fn", "starts", torch.tensor([0, 4, 3, ], dtype=i32).flip(0), "must run from 0"),
    ("store_kv", "slots", torch.tensor([0, 5, 12]), "holds 12 at 2, outside \\[-1, 12\\)"),
    ("decode_attention", "seq_lens", torch.tensor([9, 3], dtype=i32), "holds 9, outside the block table's"),
    ("decode_attention", "block_table", torch.tensor([[0, 3], [2, 0]], dtype=i32), "holds page 3"),
    ("rms_norm", "group_size", 3, "must divide the row size 8"),
    ("quant_dequantize", "group_size", 0, "must be positive"),
    ("quant_gemm", "group_size", 8, "must be a multiple of 16 for int4"),
    ("quant_x16_gemm", "group_size", 48, "must be a multiple of 64 or 32, or span the row, got 48"),
    ("quant_x16_gemm", "qweight", torch.randint(-127, 128, (6, 64), dtype=torch.int8), "must hold int4 weights"),
])
def test_indices_outside_their_pools_are_refused(op, name, value, message):
    index = argument_names(op).index(name)
    with pytest.raises(RuntimeError, match=f"tandem::{op}: argument '{name}' {message}"):
        call(op, with_argument(op, index, value))


def test_gemv_refuses_more_rows_than_its_registers_hold():
    weight, _, bias, _ = valid_arguments("gemv")
    rows = cpu_native.GEMV_MAX_ROWS + 1
    with pytest.raises(RuntimeError, match=f"argument 'x' has {rows} rows, more than {cpu_native.GEMV_MAX_ROWS}"):
        torch.ops.tandem.gemv(weight, torch.randn(rows, 8), bias, torch.empty(rows, 6))


def test_the_checks_hold_under_python_optimize():
    """`python -O` removes asserts, not TORCH_CHECKs: the same bad inputs still raise, naming the argument."""
    code = (
        "import torch\n"
        "from runtime.kernels import cpu_native\n"
        "assert False, 'asserts are on'\n"  # removed by -O: the script goes on only without asserts
        "print(cpu_native.available())\n"
        "try:\n"
        "    torch.ops.tandem.gemv(torch.randn(6, 8), torch.randn(9, 8), None, torch.empty(9, 6))\n"
        "except RuntimeError as err:\n"
        "    print(str(err).splitlines()[0])\n"
    )
    result = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, env=os.environ)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["True", "tandem::gemv: argument 'x' has 9 rows, more than 4"]


def test_torch_compile_traces_the_operators():
    """The fake implementations let torch.compile trace a function that calls an operator (no graph break)."""
    def norm(x, weight):
        out = torch.empty_like(x)
        torch.ops.tandem.rms_norm(x, None, weight, 1e-5, x.shape[1], out)
        return out * 2

    x, weight = torch.randn(3, 8), torch.randn(8)
    explanation = torch._dynamo.explain(norm)(x, weight)
    assert explanation.graph_break_count == 0
    with torch._subclasses.fake_tensor.FakeTensorMode():
        fake_out = torch.empty(3, 8)
        torch.ops.tandem.rms_norm(torch.empty(3, 8), None, torch.empty(8), 1e-5, 8, fake_out)
    assert torch.allclose(torch.compile(norm, backend="eager")(x, weight), norm(x, weight))


def test_the_profiler_names_the_operators_of_a_hybrid_decode_step(tiny_checkpoint):
    directory, _ = tiny_checkpoint("bamba")
    llm = LLM(str(directory), max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, params, use_tqdm=False)  # the decode step is captured
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        llm.generate([{"prompt_token_ids": [8, 9, 10]}] * 2, params, use_tqdm=False)
    names = {event.key for event in profile.key_averages()}
    expected = {"tandem::ssm_state_update", "tandem::conv_update", "tandem::ssm_scan", "tandem::conv_fn",
                "tandem::rms_norm", "tandem::decode_attention", "tandem::store_kv"}
    assert expected <= names, sorted(n for n in names if n.startswith("tandem::"))
