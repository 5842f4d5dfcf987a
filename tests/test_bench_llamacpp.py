"""The llama.cpp peer of bench/throughput.py on a tiny checkpoint: the converter with bench/llamacpp_convert.py's
three fixes, and the benchmark binaries' figures. Runs where TANDEM_BENCH_LLAMACPP names a llama.cpp build (or
bin) directory inside its source tree (bench/llamacpp.py's docstring says how it was built); skipped otherwise
(CI has no llama.cpp). The converter needs only the source; the binaries the build."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))

from bench import llamacpp as peer  # noqa: E402

BUILD = os.environ.get("TANDEM_BENCH_LLAMACPP")
pytestmark = pytest.mark.skipif(not BUILD, reason="TANDEM_BENCH_LLAMACPP (a llama.cpp build directory) not set")


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tokenizer_dir):
    """A tiny GraniteMoeHybrid as the benchmark's hybrid is: transformers 5's layer type names, rope, a BPE
    tokenizer no pre-tokenizer hash of the converter knows; converted to BF16 once."""
    from tiny_models import build_model

    directory = tmp_path_factory.mktemp("llamacpp") / "granitemoehybrid"
    build_model("granitemoehybrid-dense-nope", directory, tokenizer_dir, position_embedding_type="rope",
                layer_types=["linear_attention", "full_attention", "linear_attention"])
    return directory, peer.convert(directory, "BF16", Path(BUILD))


def test_converter_fixes_hold_in_the_gguf(converted):
    import gguf

    _, path = converted
    fields = gguf.GGUFReader(path).fields
    value = lambda key: fields[key].contents()  # noqa: E731
    assert value("tokenizer.ggml.pre") == "gpt-2"  # 1: the unknown BPE pre-tokenizer falls back to GPT-2's
    assert value("granitehybrid.attention.head_count_kv") == [0, 2, 0]  # 2: full_attention is attention
    assert value("granitehybrid.rope.scaling.finetuned") is True  # 3: rope on
    assert value("granitehybrid.context_length") == 512  # max_position_embeddings, not NoPE's 2**20
    # The cached file is reused, not converted again.
    assert peer.convert(converted[0], "BF16", Path(BUILD)) == path


def test_benchmark_binaries_report_every_engines_figures(converted):
    directory, _ = converted
    quantized = peer.convert(directory, "Q8_0", Path(BUILD))
    assert quantized == peer.gguf_path(directory, "Q8_0") and quantized.stat().st_size > 0
    # Q8_0 reads about half BF16's bytes per step (the tied embedding is the LM head: counted).
    bf16_bytes = peer.weight_bytes_per_step(converted[1])
    assert 0.4 < peer.weight_bytes_per_step(quantized) / bf16_bytes < 0.7
    single = peer.run(quantized, Path(BUILD), 1, 8, 3, 1)
    batch = peer.run(quantized, Path(BUILD), 2, 8, 3, 1)
    for result, generated in ((single, 3), (batch, 2 * 3)):
        assert result["generated_tokens"] == generated
        assert 0 < result["prefill_s"] < result["total_s"] and result["step_s"] > 0
        assert 1 < result["peak_rss_mib"] < 64 * 1024  # the llama.cpp process's own
