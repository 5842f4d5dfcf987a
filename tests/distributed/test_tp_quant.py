"""Quantized weights under tensor and pipeline parallelism: on-the-fly int8/int4 and checkpoints published
quantized (FP8 block-wise, compressed-tensors FP8 per channel / per tensor, W4A16 symmetric and asymmetric) give,
at tensor_parallel_size=2 or pipeline_parallel_size=2, HF's greedy tokens and logprobs (within 1e-4) on the
weights the single-process tests dequantize (tests/engine/test_quantization.py and test_quantized_checkpoints.py:
the same oracle, so TP=2 equals TP=1). A rank holds exactly its rows or columns of the unsharded quantization
(the unit tests below check the cut against the dequantized weight); a split of the inputs that is not whole
quantization groups is refused before any process starts.

One 2-rank group (gloo, this process and one spawned worker) serves the module, as in test_tp_parity.py.
"""

import re
import sys
from pathlib import Path

import pytest
import torch

from runtime import LLM
from runtime.distributed import group, state
from runtime.kernels.quant_linear import dequantize, pack_int4, quantize
from runtime.layers.parallel import Part, Shard
from runtime.layers.quantized import QuantLinear, QuantStackedLinear
from runtime.quant.parallel import cut, fits, local_group_size

# The single-process tests' checkpoint writers and oracles, from the format's and the scheme's statements.
sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from gguf_files import write_gguf  # noqa: E402
from test_gguf import FILE_TYPES, oracle_model  # noqa: E402
from test_quantization import dequantized_hf  # noqa: E402
from test_quantized_checkpoints import (  # noqa: E402
    FORMATS, assert_matches, ct_config, int4_groups, quantized_checkpoint, quantized_copy)

__all__ = ["quantized_checkpoint"]  # a fixture, imported to be used here
# Groups of 32 along K: the tiny llama's down_proj (96 inputs) cannot be split in two whole groups.
FORMATS.setdefault("w4a16-g32", (lambda w: int4_groups(w, 32, True), lambda ignore: ct_config(
    dict(num_bits=4, strategy="group", group_size=32), ignore, "pack-quantized")))


def quantized_modules(llm):
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, (QuantLinear, QuantStackedLinear))]


def layer_names(llm):
    return [n for n, m in llm.engine.runner.model.named_modules() if isinstance(m, (QuantLinear, QuantStackedLinear))]


# --- The cut: a rank's part of a converted linear is exactly its part of the dequantized weight ------------

def asymmetric(n, k, group):
    """A random int4 weight with offsets (zero points), as a W4A16 asymmetric checkpoint converts."""
    torch.manual_seed(0)
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    scales, offsets = torch.rand(n, k // group) + 0.1, torch.randn(n, k // group)
    return pack_int4(q), scales, group, offsets


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("kind", ["int4-groups", "int4-offsets", "int8-row", "fp8-block"])
def test_each_rank_holds_its_part_of_the_dequantized_weight(kind, dim):
    n, k, tp = 48, 96, 2
    torch.manual_seed(1)
    weight = torch.randn(n, k)
    if kind == "int4-offsets":
        qweight, scales, group_size, offsets = asymmetric(n, k, 16)
    elif kind == "fp8-block":  # a 128-wide block scale, repeated over its rows: one group wider than K
        qweight, group_size, offsets = weight.to(torch.float8_e4m3fn), 128, None
        scales = torch.rand(n, 1) + 0.1
    else:
        qweight, scales, group_size = quantize(weight, "int4" if kind == "int4-groups" else "int8",
                                               group_size=16 if kind == "int4-groups" else None)
        offsets = None
    full = dequantize(qweight, scales, group_size, k, offsets)
    shard = Shard((n, k), dim, (Part((n, k)[dim], tp),))
    parts = []
    for rank in range(tp):
        q, s, g, o, local_k = cut("layer", shard, rank, tp, qweight, scales, group_size, offsets, k)
        parts.append(dequantize(q, s, g, local_k, o))
    assert torch.equal(torch.cat(parts, dim=dim), full)


def test_a_split_of_the_inputs_must_be_whole_groups_or_inside_one():
    assert local_group_size("x", 512, 128, 2) == 128  # two groups a rank
    assert local_group_size("x", 96, 128, 2) == 48  # one partial group, both ranks inside it
    assert local_group_size("x", 96, 96, 2) == 48  # int8 and per-channel FP8: one scale per row
    assert fits(256, 128, 4) and not fits(96, 32, 2)
    with pytest.raises(ValueError, match=r"^layer: its 384 inputs split over tensor_parallel_size=2 give 192 per "
                                         r"rank, which is not a whole number of its quantization groups of 128 "
                                         r"inputs; .* \(tensor-parallel sizes up to 16 that work here: 1, 3, 6, 12\)$"):
        local_group_size("layer", 384, 128, 2)


# --- On-the-fly int8 / int4 -------------------------------------------------------------------------------

@pytest.mark.parametrize("name, scheme", [("llama", "int8"), ("llama", "int4"), ("bamba", "int4"),
                                          ("granitemoehybrid", "int8")])
def test_tp2_quantized_on_loading_matches_transformers(name, scheme, tiny_checkpoint):
    """Row-parallel groups that span the ranks (int8's rows; int4's one partial group at K < 128) take their
    scale from the whole row, as TP=1 quantizes it."""
    directory, hf = tiny_checkpoint(name)
    llm = LLM(directory, dtype="float32", quantization=scheme, tensor_parallel_size=2)
    try:
        assert state.world_size() == 2 and quantized_modules(llm)
        assert_matches(llm, dequantized_hf(hf, scheme), f"{name} {scheme} tp=2")
    finally:
        llm.engine.shutdown()


# --- Checkpoints published quantized -------------------------------------------------------------------------

CASES = [("qwen3_next", "fp8-block"), ("qwen3_5_moe", "fp8-block"), ("llama", "ct-fp8-channel"),
         ("llama", "ct-fp8-tensor"), ("bamba", "w4a16"), ("granitemoehybrid", "ct-fp8-channel"),
         ("nemotron_h", "ct-fp8-channel"), ("falcon_h1", "w4a16-asym")]


# Qwen3.5-MoE's Gated DeltaNet at the tiny models' scale (initializer range 0.3): its float32 logprobs drift from
# transformers' by up to 1.6e-4 with the two ranks' sums on an AVX-512 EPYC, the torch references (no native
# kernels) included, and by less than 1e-4 on an AMX Xeon. At 0.2 the drift is float32's.
SCALE = {"qwen3_5_moe": dict(initializer_range=0.2)}


@pytest.mark.parametrize("name, fmt", CASES)
def test_tp2_quantized_checkpoint_matches_transformers(name, fmt, quantized_checkpoint):
    directory, reference = quantized_checkpoint(name, fmt, **SCALE.get(name, {}))
    llm = LLM(directory, dtype="float32", tensor_parallel_size=2)
    try:
        assert state.world_size() == 2 and quantized_modules(llm)
        assert_matches(llm, reference, f"{name} {fmt} tp=2")
    finally:
        llm.engine.shutdown()


def test_tp2_nemotron_h_latent_moe_biases(tiny_checkpoint, tmp_path):
    """Latent MoE projections with biases: fc2_latent_proj's output is summed over the ranks, so its bias (a
    quantized linear's, kept whole) is added by rank 0 alone."""
    source, hf = tiny_checkpoint("nemotron_h", moe_latent_size=16, mlp_bias=True)
    reference = quantized_copy(source, tmp_path / "model", hf, "ct-fp8-channel")
    llm = LLM(tmp_path / "model", dtype="float32", tensor_parallel_size=2)
    try:
        latent = next(m for n, m in llm.engine.runner.model.named_modules() if n.endswith("fc2_latent_proj"))
        assert isinstance(latent, QuantLinear) and latent.bias.abs().sum() > 0  # rank 0's
        assert_matches(llm, reference, "nemotron_h latent biases tp=2")
    finally:
        llm.engine.shutdown()


# --- GGUF files: each rank reads the file, then keeps its part ----------------------------------------------

@pytest.fixture(scope="module")
def gguf_file(tiny_checkpoint, tmp_path_factory):
    """gguf_file(kind, **overrides) -> (path, HF on the weights gguf dequantizes), of the tiny llama."""
    def make(kind, **overrides):
        directory, hf = tiny_checkpoint("llama", **overrides)
        path = tmp_path_factory.mktemp("gguf") / f"llama-{kind}.gguf"
        types, file_type = FILE_TYPES[kind]
        return path, oracle_model(hf, write_gguf(directory, path, types, file_type))
    return make


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K_M"])
def test_tp2_gguf_matches_transformers(kind, gguf_file):
    """An MLP of 256 (Q4_K's 256-value rows): every row-parallel share is whole 32-value blocks."""
    path, reference = gguf_file(kind, intermediate_size=256)
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2)
    try:
        linears = quantized_modules(llm)
        assert linears and {m.out_features for m in linears if m.in_features == 128} == {64}  # down_proj's half
        assert_matches(llm, reference, f"gguf {kind} tp=2")
    finally:
        llm.engine.shutdown()


# --- Pipeline parallelism: a stage reads and converts its own layers only -----------------------------------

@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K_M"])
def test_pp2_gguf_matches_transformers(kind, gguf_file):
    """Each stage reads the file and keeps its own layers (the other stage's go before the pool is planned)."""
    path, reference = gguf_file(kind, intermediate_size=256)
    llm = LLM(str(path), dtype="float32", pipeline_parallel_size=2)
    try:
        first, second = llm.engine.runner.describe()
        held = {int(m.group(1)) for m in map(re.compile(r".*layers\.(\d+)\.").match, layer_names(llm)) if m}
        assert held == set(first["layers"]) and not held & set(second["layers"])
        assert_matches(llm, reference, f"gguf {kind} pp=2")
    finally:
        llm.engine.shutdown()


def test_pp2_quantized_on_loading_matches_transformers(tiny_checkpoint):
    directory, hf = tiny_checkpoint("bamba")
    llm = LLM(directory, dtype="float32", quantization="int8", pipeline_parallel_size=2)
    try:
        assert_matches(llm, dequantized_hf(hf, "int8"), "bamba int8 pp=2")
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("name, fmt", [("bamba", "w4a16-asym"), ("qwen3_next", "fp8-block")])
def test_pp2_quantized_checkpoint_matches_transformers(name, fmt, quantized_checkpoint):
    directory, reference = quantized_checkpoint(name, fmt)
    llm = LLM(directory, dtype="float32", pipeline_parallel_size=2)
    try:
        first, second = llm.engine.runner.describe()
        # Rank 0 (this process) converted the quantized linears of its own layers, and only those.
        held = {int(m.group(1)) for m in map(re.compile(r".*layers\.(\d+)\.").match, layer_names(llm)) if m}
        assert held == set(first["layers"]) and not held & set(second["layers"])
        assert_matches(llm, reference, f"{name} {fmt} pp=2")
    finally:
        llm.engine.shutdown()


# --- Refusals: before any process starts, one line naming the layer, the group size and the TP size --------

def test_int4_groups_split_across_ranks_are_refused(tiny_checkpoint):
    directory, _ = tiny_checkpoint("llama", intermediate_size=384)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj: its 384 inputs split over "
                                         r"tensor_parallel_size=2 give 192 per rank, which is not a whole number "
                                         r"of its quantization groups of 128 inputs") as err:
        LLM(directory, dtype="float32", quantization="int4", tensor_parallel_size=2)
    assert "\n" not in str(err.value)


def test_gguf_blocks_split_across_ranks_are_refused(gguf_file):
    path, _ = gguf_file("Q8_0")
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj: its 96 inputs split over "
                                         r"tensor_parallel_size=2 give 48 per rank, which is not a whole number "
                                         r"of its quantization groups of 32 inputs"):
        LLM(str(path), dtype="float32", tensor_parallel_size=2)


@pytest.mark.parametrize("name, fmt", [("llama", "w4a16-g32"), ("qwen3_5", "fp8-block-32")])
def test_checkpoint_groups_split_across_ranks_are_refused(name, fmt, quantized_checkpoint):
    """W4A16 groups of 32 and FP8 blocks of 32 x 32: a rank's 48 of the MLP's 96 inputs end mid-group."""
    directory, _ = quantized_checkpoint(name, fmt)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj: its 96 inputs split over "
                                         r"tensor_parallel_size=2 give 48 per rank, which is not a whole number "
                                         r"of its quantization groups of 32 inputs; .*work here: 1, 3, 6, 12\)$"):
        LLM(directory, dtype="float32", tensor_parallel_size=2)
