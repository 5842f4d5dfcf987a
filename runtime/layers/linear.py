"""Dense layers on oneDNN's packed weights, for float32 and bfloat16 models on a CPU.

oneDNN's linear with weights reordered once into its blocked layout runs 1.4x (prefill) to
2.5x (decode, the LM head) faster than the default float32 GEMM on the CPUs we measured, and
1.3-1.5x faster than the default bfloat16 GEMM at decode sizes (docs/performance.md). Both use
torch's own prepacked path (`mkldnn._reorder_linear_weight`, `_linear_pointwise`, as
torch.compile's CPU backend does), which takes and returns plain tensors: float32 once went through
oneDNN tensors (`to_mkldnn`, `mkldnn_linear`, `to_dense`), whose two conversions per call cost 15-20 %
of a prefill GEMM on the AVX-512 machine. bfloat16 runs natively where the CPU has bfloat16
instructions. Where it has none
(AVX2 only), bfloat16 GEMMs are emulated and run 4.5-7x slower than float32 ones (docs/performance.md),
so a bfloat16 linear keeps its weights widened to float32 and multiplies in float32: a product of two
bfloat16 values is exact in float32, and both paths accumulate in float32 and round the output to
bfloat16, so only the summation order differs.

A decode batch goes to cpu_native's kernels instead, where the native library builds and where they beat
oneDNN. Where the CPU has AVX-512, the panel kernel (`panel_max_rows`): the weights packed once more in
panels of 32 output features, a block of rows times a panel in registers, the next panel prefetched;
float32 from 5 to 64 rows (0.65-0.75x oneDNN's time at 32 rows, 0.75-0.86x at 64; up to 4 rows the
AVX2 matrix-vector kernel below, which streamed the hybrid's weights from memory faster at one row,
16.5 against 20 ms, and level at 4), bfloat16 (AVX-512 BF16) up to 4 rows (0.4-0.85x) where the CPU has AMX
and up to 8 where it has not (oneDNN then multiplies with vdpbf16ps too; 0.63-0.83x from 5 to 8 rows on the
EPYC). Past 4 rows vdpbf16ps runs at the float32 rate and oneDNN's AMX GEMM wins, so where the CPU has AMX the same panels
go to AMX tiles up to 64 rows (`amx_max_rows`; 0.59-0.73x oneDNN's time at 32 rows, 0.73-0.95x at 64;
docs/performance.md). On a CPU with AVX2 only (`native_max_rows`), the AVX2 kernels on the weights as
stored: up to 4 rows the matrix-vector kernel (oneDNN read the weights at about half the machine's
bandwidth there), up to SMALL_GEMM_MAX_ROWS the small GEMM (dot products, 8 rows at a time: 2x oneDNN
at 8 rows, 1.2-1.6x at 32); bfloat16 there is widened to float32 as above.

The LM head keeps its panels alone where they run (`onednn=False`): it multiplies one row per sampled position
(a prompt's rows only for prompt logprobs), and the panel kernel takes any number of rows at 0.96-1.15x oneDNN's
time (N = K = 2048, 4 to 2048 rows, one and two threads of the AVX-512 EPYC), so oneDNN's copy of the largest
weight would buy little and cost a vocabulary's worth of memory (125 MiB of the 1.23B hybrid, an eighth of its
int4 model). On a CPU with AVX2 only it keeps its weights as stored alone: the small GEMM takes up to
SMALL_GEMM_MAX_ROWS rows at a time (1.2-1.6x oneDNN at 32 rows), and oneDNN's copy there is in float32, twice a
bfloat16 vocabulary (250 MiB of the 1.23B hybrid).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from runtime.kernels import cpu_native

PACK_ROWS = 32  # the batch size the weights are laid out for


class PackedLinear(nn.Module):
    """`onednn=False`: where the panel kernel runs, it takes every batch, and where the AVX2 kernels run instead,
    they take every batch in pieces of their rows; oneDNN's copy is not made (the LM head's case, module
    docstring); elsewhere (no native library) oneDNN's copy is made regardless. `in_place`: linear's weight is
    read by nothing else, and its panels, if they are its only copy, may take its memory (pack_panels)."""

    def __init__(self, linear: nn.Linear, onednn: bool = True, in_place: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.dtype = weight.dtype
        self.panel_max_rows = panel_max_rows(weight.dtype)
        panels = self.panel_max_rows > 0
        # Below the panels, the matrix-vector kernel where it reads the weights faster (float32 at one row).
        self.native_max_rows = native_max_rows(weight.dtype)
        if panels:
            self.native_max_rows = min(self.native_max_rows, cpu_native.GEMV_MAX_ROWS)
        native = self.native_max_rows > 0
        # Float32 GEMMs: a float32 model, or a bfloat16 one on a CPU without bfloat16 instructions.
        self.float32 = weight.dtype == torch.float32 or not bfloat16_packs()
        # The type x is multiplied in (the caller casts to it).
        self.input_dtype = torch.float32 if self.float32 else weight.dtype
        # The layout oneDNN picks for 32-row inputs (vLLM's choice too) served 1 to 2048 rows best here.
        packed = None
        if onednn or not (panels or native):
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(self.input_dtype), PACK_ROWS)
        self.register_buffer("weight", packed, persistent=False)
        bias = linear.bias.detach().to(self.input_dtype) if linear.bias is not None and packed is not None else None
        self.register_buffer("bias", bias, persistent=False)
        # Copies of the weights for the decode-batch kernels where they pay: packed in panels (AVX-512),
        # and as stored for the matrix-vector kernel (float32 up to 4 rows; and on AVX2-only CPUs).
        # The panels go in place only where no other copy is made from the weight (they were the last one).
        in_place = in_place and packed is None and not native
        self.register_buffer("panels", cpu_native.pack_panels(weight, in_place) if panels else None,
                             persistent=False)
        bias = linear.bias.detach().float() if panels and linear.bias is not None else None
        self.register_buffer("panel_bias", bias, persistent=False)
        self.amx_max_rows = amx_max_rows(weight.dtype, self.in_features) if panels else 0
        self.register_buffer("dense_weight", weight.contiguous() if native else None, persistent=False)
        bias = linear.bias.detach().float() if native and linear.bias is not None else None
        self.register_buffer("dense_bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        # Each kernel's bound is 0 where it does not run here (no native library): an empty batch takes oneDNN.
        if rows <= self.native_max_rows and self.native_max_rows:
            return self._native(flat).view(*x.shape[:-1], self.out_features)
        if self.weight is None and not self.panel_max_rows:  # the LM head where the AVX2 kernels take every batch
            y = torch.cat([self._native(piece) for piece in flat.split(self.native_max_rows)])
            return y.view(*x.shape[:-1], self.out_features)
        panels_only = self.weight is None  # every batch on the panels: on AMX tiles past a few rows where it runs
        if (rows <= self.panel_max_rows and self.panel_max_rows) or (panels_only and not self.amx_max_rows):
            y = cpu_native.panel_gemm(flat, self.panels, self.panel_bias, self.out_features)
            return y.view(*x.shape[:-1], self.out_features)
        if (rows <= self.amx_max_rows and self.amx_max_rows) or panels_only:
            y = cpu_native.amx_gemm(flat, self.panels, self.panel_bias, self.out_features)
            return y.view(*x.shape[:-1], self.out_features)
        # oneDNN keeps native memory (a primitive, its scratchpad) for every input shape it meets, and
        # the engine's token count changes every step: padded to a bucket, a long-running server meets
        # a few dozen shapes and its RSS levels off (bench/rss.py; issue 13). Padding rows are zeros
        # and their outputs are dropped; each row's output depends on that row alone.
        size = bucket(rows)
        if size == rows:
            padded = flat.contiguous()
        else:
            padded = flat.new_empty(size, self.in_features)
            padded[:rows] = flat
            padded[rows:].zero_()
        if self.float32:
            padded = padded.float()
        y = torch.ops.mkldnn._linear_pointwise(padded, self.weight, self.bias, "none", [], "").to(self.dtype)
        return y[:rows].view(*x.shape[:-1], self.out_features)


    def _native(self, flat: torch.Tensor) -> torch.Tensor:
        kernel = cpu_native.gemv if flat.shape[0] <= cpu_native.GEMV_MAX_ROWS else cpu_native.small_gemm
        return kernel(flat, self.dense_weight, self.dense_bias).to(self.dtype)


def bucket(rows: int) -> int:
    """`rows` rounded up to one of four sizes per power of two (at most 25 % more rows); up to 8 as is.

    Single-sequence decode (one row) would run twice as slowly padded to 8 rows (oneDNN's matrix-vector
    path), so the smallest sizes stay exact: eight more shapes.
    """
    if rows <= 8:
        return rows
    step = 1 << (rows.bit_length() - 3)  # a quarter of the power of two at or below rows
    return -(-rows // step) * step


def pack_linears(model: nn.Module, embedding_from_head: bool = True) -> int:
    """Replace every float32 and bfloat16 nn.Linear of `model` by a PackedLinear, its LM head (`lm_head`) on
    the panels alone where they run, and (`embedding_from_head`) an input embedding tied to that head by a
    PanelEmbedding; returns how many linears."""
    packable = {torch.float32, torch.bfloat16}
    packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype in packable:
                head = parent is model and name == "lm_head"
                # The head's panels take its weight's memory where nothing else will read that weight: not an
                # embedding tied to it that keeps it (without embedding_from_head, an MTP head reads it too).
                in_place = head and embedding_from_head and _read_by_panels_alone(model, child)
                setattr(parent, name, PackedLinear(child, onednn=not head, in_place=in_place))
                packed += 1
                if head and embedding_from_head:
                    _tie_embedding_to_panels(model, child)
    return packed


def _tied_embedding(model: nn.Module, linear: nn.Linear) -> nn.Module | None:
    """The model's input embedding if its weight is this linear's."""
    embedding = model.input_embeddings() if hasattr(model, "input_embeddings") else None
    return embedding if getattr(embedding, "weight", None) is linear.weight else None


def _read_by_panels_alone(model: nn.Module, linear: nn.Linear) -> bool:
    """No module of `model` but `linear` and an embedding that a PanelEmbedding will replace holds a tensor in
    the memory of linear's weight."""
    memory = linear.weight.untyped_storage().data_ptr()
    embedding = _tied_embedding(model, linear)
    for module in model.modules():
        if module is linear or (module is embedding and _reads_panels(module)):
            continue
        tensors = [*module._parameters.values(), *module._buffers.values()]
        if any(t is not None and t.untyped_storage().data_ptr() == memory for t in tensors):
            return False
    return True


def _reads_panels(embedding: nn.Module) -> bool:
    """A PanelEmbedding can stand for this embedding."""
    return type(embedding) is nn.Embedding and embedding.padding_idx is None and embedding.max_norm is None


def _tie_embedding_to_panels(model: nn.Module, linear: nn.Linear) -> None:
    """The input embedding whose weight is the LM head's (tied) reads its rows from the head's panels instead."""
    embedding = _tied_embedding(model, linear)
    packed = model.lm_head
    # A head with panels has no oneDNN copy (PackedLinear's onednn=False): its panels are all it holds.
    if embedding is None or not _reads_panels(embedding) or packed.panels is None:
        return
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if child is embedding:
                setattr(parent, name, PanelEmbedding(packed, embedding.num_embeddings))


class PanelEmbedding(nn.Module):
    """An input embedding tied to the LM head, its rows read from the head's panels (pack_panels' layout), so
    that the vocabulary is held once (the 1.23B hybrid's 125 MiB; a 100k-token vocabulary of 4096 values, 800 MiB
    in bfloat16). A token's row is every PANEL-th value (pair of values in bfloat16) of its panel: a strided
    gather, cheap beside a step's linears."""

    def __init__(self, head: PackedLinear, num_embeddings: int):
        super().__init__()
        assert head.panels is not None and head.out_features == num_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, head.in_features
        self.weight_dtype = head.panels.dtype
        # The head owns the panels: kept out of this module's buffers, so they count once in the model's.
        self.__dict__["head"] = head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        panel, feature = ids // cpu_native.PANEL, ids % cpu_native.PANEL
        panels = self.head.panels
        rows = panels[panel, :, feature] if panels.dim() == 3 else panels[panel, :, feature, :]
        return rows.flatten(1)[:, : self.embedding_dim].reshape(*input_ids.shape, self.embedding_dim)


# Up to how many rows the panel kernel beat oneDNN on the AVX-512 machine with AMX (docs/performance.md).
PANEL_MAX_ROWS = {torch.float32: 64, torch.bfloat16: 4}
# bfloat16 where the CPU has AVX-512 BF16 but no AMX, so that oneDNN multiplies with the same vdpbf16ps: the panels
# took 0.63-0.83x oneDNN's time from 5 to 8 rows on the EPYC (2 threads; 8512 x 2048, 2048 x 4096, 3352 x 768,
# 768 x 1536), and 0.74-1.22x at 12 and 16.
PANEL_MAX_ROWS_BF16_WITHOUT_AMX = 8
AMX_MAX_ROWS = 64


def panel_max_rows(dtype: torch.dtype) -> int:
    """Up to how many rows a linear of this weight type runs on cpu_native's panel kernel here (0: never,
    as on a CPU without AVX-512). Not cached, as native_max_rows."""
    if not cpu_native.available() or dtype not in cpu_native.panel_dtypes():
        return 0
    if dtype == torch.bfloat16 and not cpu_native.amx_ready():
        return PANEL_MAX_ROWS_BF16_WITHOUT_AMX
    return PANEL_MAX_ROWS[dtype]


def amx_max_rows(dtype: torch.dtype, in_features: int) -> int:
    """Up to how many rows a bfloat16 linear with panels runs on AMX tiles here, past panel_max_rows (0: never,
    as for float32, a CPU without AMX, or in_features not a whole number of tiles)."""
    if dtype != torch.bfloat16 or in_features % cpu_native.AMX_K_MULTIPLE or not panel_max_rows(dtype):
        return 0
    return AMX_MAX_ROWS if cpu_native.amx_ready() else 0


def native_max_rows(dtype: torch.dtype) -> int:
    """Up to how many rows a linear of this weight type runs on cpu_native's kernels here (0: never).
    Not cached: TANDEM_CPU_NATIVE=0 holds for every engine built after it is set, as for the other kernels."""
    if not cpu_native.available() or dtype not in cpu_native.NATIVE_DTYPES:
        return 0
    if dtype == torch.bfloat16 and bfloat16_packs():
        return 0
    if torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return cpu_native.GEMV_MAX_ROWS
    return cpu_native.SMALL_GEMM_MAX_ROWS


@functools.cache
def bfloat16_packs() -> bool:
    """torch's prepacked bfloat16 linear exists here and the CPU runs bfloat16 natively (else float32 is faster)."""
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and bool(mkldnn._is_mkldnn_bf16_supported()))
