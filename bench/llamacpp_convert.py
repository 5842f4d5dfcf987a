"""llama.cpp's convert_hf_to_gguf.py with three fixes for the benchmark's random checkpoints, applied in this
process (the vendored source stays as it is):

    python bench/llamacpp_convert.py LLAMA_CPP_DIR CHECKPOINT --outtype bf16 --outfile OUT.gguf

1. A freshly made byte-level BPE tokenizer is not among the pre-tokenizers the converter knows by hash; its
   pre-tokenizer is GPT-2's, so an unrecognised one falls back to "gpt-2".
2. transformers 5 names GraniteMoeHybrid's layer types "full_attention" / "linear_attention"; the converter
   (written for transformers 4.57) matches only "attention" and would write zero KV heads everywhere.
3. The converter turns rope off for every hybrid GraniteMoeHybrid (IBM's Granite 4.0-H are NoPE); a
   checkpoint with `position_embedding_type: "rope"` (ours) needs it on. And with no experts (our dense MLP)
   it writes `num_experts_per_tok`'s default 2 as the experts used, which llama.cpp's loader rejects
   (n_expert_used_max <= n_expert): 0.
Published checkpoints (Granite 4.0-H, Nemotron-H, Qwen3-Next) convert without these.
Our byte-level tokenizer has no merges, and llama.cpp refuses a BPE vocabulary without any: one is added.
And one for this environment: the Llama converter imports sentencepiece before it looks for a tokenizer.model;
without the package (not a Tandem dependency) a checkpoint with no tokenizer.model gets the FileNotFoundError
the converter expects, and falls through to its GPT-2-style vocabulary, as with sentencepiece installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

ATTENTION_TYPES = ("attention", "full_attention")


def patch(source: Path) -> None:
    """Import the converter from `source` (its vendored gguf-py first) and apply the three fixes."""
    sys.path[:0] = [str(source / "gguf-py"), str(source)]
    from conversion import base, granite

    recognise = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return recognise(self, tokenizer)
        except NotImplementedError:
            return "gpt-2"

    def get_attn_layers(self) -> list[int]:
        if layer_types := self.hparams.get("layer_types"):
            return [i for i, kind in enumerate(layer_types) if kind in ATTENTION_TYPES]
        return attn_layers(self)

    set_parameters = granite.GraniteHybridModel.set_gguf_parameters

    def set_gguf_parameters(self) -> None:
        set_parameters(self)
        if self.hparams.get("position_embedding_type") == "rope":
            self.gguf_writer.add_rope_scaling_finetuned(True)
            self.gguf_writer.add_context_length(self.hparams["max_position_embeddings"])
        if not self.hparams.get("num_local_experts"):  # a dense MLP: llama.cpp asserts used <= count
            self.gguf_writer.add_expert_used_count(0)
            # and the dense MLP is the shared one: llama.cpp sizes it by feed_forward_length
            self.gguf_writer.add_feed_forward_length(self.hparams["shared_intermediate_size"])

    sentencepiece_vocab = base.TextModel._set_vocab_sentencepiece

    def _set_vocab_sentencepiece(self, *args, **kwargs):
        if not (self.dir_model / "tokenizer.model").is_file():
            raise FileNotFoundError(self.dir_model / "tokenizer.model")
        return sentencepiece_vocab(self, *args, **kwargs)

    gpt2_vocab = base.TextModel._set_vocab_gpt2

    def _set_vocab_gpt2(self, *args, **kwargs):
        gpt2_vocab(self, *args, **kwargs)
        if not any("tokenizer.ggml.merges" in kv for kv in self.gguf_writer.kv_data):
            self.gguf_writer.add_token_merges(["a b"])  # never applied: the benchmarks feed token ids

    attn_layers = granite.GraniteHybridModel.get_attn_layers
    base.TextModel._set_vocab_gpt2 = _set_vocab_gpt2
    base.TextModel._set_vocab_sentencepiece = _set_vocab_sentencepiece
    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    granite.GraniteHybridModel.get_attn_layers = get_attn_layers
    granite.GraniteHybridModel.set_gguf_parameters = set_gguf_parameters


def main() -> None:
    source = Path(sys.argv[1])
    patch(source)
    import convert_hf_to_gguf

    sys.argv = [str(source / "convert_hf_to_gguf.py"), *sys.argv[2:]]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
