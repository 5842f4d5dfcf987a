"""PackedLinear (oneDNN's packed weights) against nn.Linear, and the bounded set of row counts it runs."""

import pytest
import torch
from torch import nn

from runtime.kernels import cpu_native
from runtime.layers.linear import (
    AMX_MAX_ROWS,
    PANEL_MAX_ROWS,
    PANEL_MAX_ROWS_BF16_WITHOUT_AMX,
    PackedLinear,
    PanelEmbedding,
    bfloat16_packs,
    bucket,
    native_max_rows,
    pack_linears,
    panel_max_rows,
)


@pytest.mark.parametrize("rows", [1, 4, 5, 7, 8, 9, 17, 48, 49, 100, 129, 300])
def test_packed_linear_matches_nn_linear_for_every_row_count(rows):
    torch.manual_seed(rows)
    linear = nn.Linear(24, 40)
    x = torch.randn(rows, 24)
    torch.testing.assert_close(PackedLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


def test_packed_linear_keeps_leading_dims_and_handles_no_bias():
    linear = nn.Linear(16, 8, bias=False)
    x = torch.randn(3, 5, 16)
    out = PackedLinear(linear)(x)
    assert out.shape == (3, 5, 8)
    torch.testing.assert_close(out, linear(x), rtol=1e-5, atol=1e-5)


def test_bucket_covers_rows_with_a_few_dozen_sizes_and_at_most_a_quarter_more():
    sizes = {bucket(rows) for rows in range(1, 8193)}
    assert len(sizes) <= 48
    for rows in range(1, 8193):
        assert rows <= bucket(rows) <= rows * 1.25
        assert bucket(bucket(rows)) == bucket(rows)


@pytest.mark.parametrize("rows", [1, 9, 100])
@pytest.mark.parametrize("bias", [True, False])
def test_bfloat16_packed_linear_matches_nn_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(64, 40, bias=bias).to(torch.bfloat16)
    x = torch.randn(2, rows, 64, dtype=torch.bfloat16)
    out = PackedLinear(linear)(x)
    assert out.dtype == torch.bfloat16 and out.shape == (2, rows, 40)
    # Both round a float32 sum to bfloat16 (natively packed, or widened to float32 where the CPU has no
    # bfloat16 instructions); their summation orders may differ by an ulp.
    torch.testing.assert_close(out, linear(x), rtol=2.0**-7, atol=1e-2)


def test_pack_linears_packs_float32_and_bfloat16_and_leaves_others():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 8).half())
    assert pack_linears(model) == 2
    assert [type(m) for m in model] == [PackedLinear, PackedLinear, nn.Linear]
    # bfloat16 GEMMs run natively where the CPU has bfloat16 instructions, else widened to float32.
    assert model[1].float32 is not bfloat16_packs() and model[0].float32


def test_decode_batches_use_the_native_kernels_only_where_they_beat_onednn():
    """Where the CPU has AVX-512 the panel kernel takes decode batches: float32 from 5 to 64 rows (the
    matrix-vector kernel up to 4), bfloat16 (with AVX-512 BF16) up to 4 beside AMX and 8 without, and then AMX tiles up to 64 where the
    CPU has AMX and K is whole tiles of 32 (else oneDNN, whose AMX GEMM wins over vdpbf16ps from 8 rows). The
    AVX2 kernels take float32 batches up to SMALL_GEMM_MAX_ROWS where there is no panel kernel; where oneDNN
    runs bfloat16 natively they never take bfloat16 ones."""
    panel_dtypes = cpu_native.panel_dtypes() if cpu_native.available() else ()
    for dtype in (torch.float32, torch.bfloat16):
        linear = PackedLinear(nn.Linear(16, 8).to(dtype))
        if dtype in panel_dtypes:
            without_amx = dtype == torch.bfloat16 and not cpu_native.amx_ready()
            rows = PANEL_MAX_ROWS_BF16_WITHOUT_AMX if without_amx else PANEL_MAX_ROWS[dtype]
            assert linear.panel_max_rows == rows and linear.panels is not None
            gemv = cpu_native.GEMV_MAX_ROWS if dtype == torch.float32 else 0
            assert linear.native_max_rows == gemv and (linear.dense_weight is not None) == bool(gemv)
            amx = dtype == torch.bfloat16 and cpu_native.amx_ready()
            assert linear.amx_max_rows == 0  # 16 in_features: AMX takes whole tiles of 32
            assert PackedLinear(nn.Linear(32, 8).to(dtype)).amx_max_rows == (AMX_MAX_ROWS if amx else 0)
        else:
            assert linear.panel_max_rows == 0 and linear.panels is None and linear.amx_max_rows == 0
            assert linear.native_max_rows == native_max_rows(dtype)
    if bfloat16_packs():
        assert native_max_rows(torch.bfloat16) == 0
    if not cpu_native.available():
        assert native_max_rows(torch.float32) == 0
    elif not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        assert native_max_rows(torch.float32) == cpu_native.SMALL_GEMM_MAX_ROWS
    assert native_max_rows(torch.float16) == 0 and panel_max_rows(torch.float16) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 5, 8, 9, 64, 65])
@pytest.mark.parametrize("in_features", [96, 72])  # whole AMX tiles of k, or not
def test_every_kernel_a_linear_picks_matches_nn_linear(dtype, rows, in_features):
    """The row counts either side of each kernel's limit, on whatever kernels this CPU picks."""
    torch.manual_seed(rows)
    reference = nn.Linear(in_features, 72).to(dtype)
    x = torch.randn(rows, in_features).to(dtype)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2.0**-7, atol=1e-2)
    torch.testing.assert_close(PackedLinear(reference)(x), reference(x), **tolerance)


def test_native_kernels_switched_off_keep_no_second_weight_copy(monkeypatch):
    monkeypatch.setenv(cpu_native.ENV_VAR, "0")
    reference = nn.Linear(16, 8)
    linear = PackedLinear(reference)
    assert linear.native_max_rows == 0 and linear.dense_weight is None
    assert linear.panel_max_rows == 0 and linear.panels is None
    x = torch.randn(2, 16)  # two rows: the native kernels' size, now oneDNN's
    torch.testing.assert_close(linear(x), reference(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 4, 5, 64, 65, 300])
@pytest.mark.parametrize("in_features", [96, 71])  # whole AMX tiles of k, or an odd K (a zero pair member)
def test_a_head_on_the_panels_alone_matches_nn_linear_at_every_row_count(dtype, rows, in_features):
    """onednn=False (the LM head): where the panel kernel runs, no oneDNN copy is made and every batch, a
    prompt's rows for prompt logprobs included, runs on the panels (or AMX tiles); where the AVX2 kernels run
    instead, on those, past the small GEMM's rows in pieces of them (65 and 300 rows); elsewhere oneDNN's."""
    torch.manual_seed(rows)
    reference = nn.Linear(in_features, 70, bias=rows % 2 == 1).to(dtype)  # a partial last panel of 6 features
    head = PackedLinear(reference, onednn=False)
    panels = dtype in (cpu_native.panel_dtypes() if cpu_native.available() else ())
    native = native_max_rows(dtype) > 0
    assert (head.weight is None) == (panels or native) and (head.panels is not None) == panels
    assert head.input_dtype == (dtype if panels or not head.float32 else torch.float32)
    x = torch.randn(rows, in_features).to(dtype)
    out = head(x.to(head.input_dtype))
    assert out.dtype == dtype and out.shape == (rows, 70)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2.0**-7, atol=1e-2)
    torch.testing.assert_close(out, reference(x), **tolerance)


def test_pack_linears_puts_the_lm_head_alone_on_the_panels():
    """The model's own `lm_head` keeps no oneDNN copy where the panels or the AVX2 kernels run; a layer of that
    name deeper in the model is an ordinary linear and keeps it."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Module()
            self.block.lm_head = nn.Linear(32, 16)
            self.lm_head = nn.Linear(32, 64, bias=False)

    model = Model()
    assert pack_linears(model) == 2
    alone = torch.float32 in (cpu_native.panel_dtypes() if cpu_native.available() else ()) or native_max_rows(
        torch.float32) > 0
    assert (model.lm_head.weight is None) == alone and model.block.lm_head.weight is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tied_head_on_the_avx2_kernels_holds_the_vocabulary_once(dtype):
    """Where the AVX2 kernels take the head's every batch (no panels), the head keeps no oneDNN copy (in float32
    there, twice a bfloat16 vocabulary) and reads the embedding's own tensor."""
    if dtype in (cpu_native.panel_dtypes() if cpu_native.available() else ()) or not native_max_rows(dtype):
        pytest.skip(f"the AVX2 kernels do not take {dtype}'s head here")
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(100, 24).to(dtype)
            self.lm_head = nn.Linear(24, 100, bias=False).to(dtype)
            self.lm_head.weight = self.embed.weight

        def input_embeddings(self):
            return self.embed

    model = Model()
    reference = nn.Linear(24, 100, bias=False).to(dtype)
    reference.weight.data = model.embed.weight.detach().clone()
    pack_linears(model)
    head = model.lm_head
    assert head.weight is None and head.dense_weight.data_ptr() == model.embed.weight.data_ptr()
    x = torch.randn(cpu_native.SMALL_GEMM_MAX_ROWS * 2 + 3, 24).to(dtype)  # three pieces
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2.0**-7, atol=1e-2)
    torch.testing.assert_close(head(x.to(head.input_dtype)), reference(x), **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab, hidden", [(64, 16), (70, 37)])  # whole panels; a partial one and an odd K
def test_an_embedding_tied_to_the_head_reads_its_rows_from_the_panels(dtype, vocab, hidden):
    """Where the tied head keeps its panels alone, the embedding is a PanelEmbedding holding no tensor of its own:
    the same rows as nn.Embedding for any shape of ids, and the vocabulary counted once in the model's tensors."""
    if dtype not in (cpu_native.panel_dtypes() if cpu_native.available() else ()):
        pytest.skip(f"the panel kernel does not run {dtype} here: the embedding keeps its own rows")
    torch.manual_seed(vocab)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, hidden).to(dtype)
            self.lm_head = nn.Linear(hidden, vocab, bias=False).to(dtype)
            self.lm_head.weight = self.embed.weight

        def input_embeddings(self):
            return self.embed

    model = Model()
    reference = nn.Embedding.from_pretrained(model.embed.weight.detach().clone())
    pack_linears(model)
    assert isinstance(model.embed, PanelEmbedding) and not list(model.embed.parameters())
    assert not list(model.embed.buffers())
    # The vocabulary is held by the head alone: its panels, and in float32 the weight as stored for the
    # matrix-vector kernel (the embedding's own storage, not a copy).
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in [*model.parameters(),
                                                                                      *model.buffers()]}
    head = model.lm_head
    assert sorted(storages.values()) == sorted(t.untyped_storage().nbytes() for t in (head.panels, head.dense_weight)
                                               if t is not None)
    ids = torch.tensor([[0, vocab - 1, 5], [31, 32, 33]])
    out = model.embed(ids)
    assert out.dtype == dtype and torch.equal(out, reference(ids))
    assert model.embed(torch.tensor([], dtype=torch.long)).shape == (0, hidden)


def test_an_untied_embedding_or_one_kept_by_the_caller_stays_an_embedding():
    class Model(nn.Module):
        def __init__(self, tied):
            super().__init__()
            self.embed, self.lm_head = nn.Embedding(64, 16), nn.Linear(16, 64, bias=False)
            if tied:
                self.lm_head.weight = self.embed.weight

        def input_embeddings(self):
            return self.embed

    for model, kwargs in ((Model(tied=False), {}), (Model(tied=True), {"embedding_from_head": False})):
        pack_linears(model, **kwargs)
        assert type(model.embed) is nn.Embedding


@pytest.mark.parametrize("case", ["untied", "tied", "mtp", "padding", "shared"])
def test_the_heads_panels_take_its_weights_memory_only_where_nothing_else_reads_it(case):
    """Packed in place, the head's vocabulary never has two copies alive at start-up. Not where anything else
    keeps the weight: an embedding tied to it that stays an nn.Embedding (padding_idx; embedding_from_head=False,
    as with an MTP head) or any other module holding it; those read the values they had."""
    dtype = torch.bfloat16
    if dtype not in (cpu_native.panel_dtypes() if cpu_native.available() else ()):
        pytest.skip("the panel kernel does not run bfloat16 here: the head has no panels")
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, 16, padding_idx=0 if case == "padding" else None).to(dtype)
            self.lm_head = nn.Linear(16, 64, bias=False).to(dtype)
            if case != "untied":
                self.lm_head.weight = self.embed.weight
            if case == "shared":
                self.other = nn.Linear(16, 64, bias=False)
                self.other.weight = self.lm_head.weight

        def input_embeddings(self):
            return self.embed

    model = Model()
    weight = model.lm_head.weight.detach()
    values, memory = weight.clone(), weight.data_ptr()
    embedded = model.embed.weight.detach().clone()
    reference = nn.Linear(16, 64, bias=False).to(dtype)
    reference.weight.data = values
    pack_linears(model, embedding_from_head=case != "mtp")
    in_place = case in ("untied", "tied")
    assert (model.lm_head.panels.data_ptr() == memory) == in_place
    if not in_place:
        assert torch.equal(weight, values)
    x = torch.randn(3, 16).to(dtype)
    torch.testing.assert_close(model.lm_head(x), reference(x), rtol=2.0**-7, atol=1e-2)
    ids = torch.tensor([1, 63, 32])
    assert torch.equal(model.embed(ids), embedded[ids])
