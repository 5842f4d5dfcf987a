"""Tiny random HF checkpoints and an offline tokenizer, built with transformers' own classes.

initializer_range=0.3 keeps the top-2 logit gap far above float noise, so greedy parity
is decided by the model, not by 1e-5 rounding. Every parameter is random: HF initialises
norm weights, Mamba's D and (for some models) dt_bias to 1 and biases to 0, values under
which an engine that ignored them would still agree; `randomize` redraws them around
their usual values after HF has built the model.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "The page pool holds attention blocks and Mamba states of equal size.",
    "A hybrid model mixes attention layers with state-space layers.",
    "Every model class declares what it supports and what it caches.",
    "The scheduler batches prefills and decodes, and preempts when pages run out.",
    "Chunked prefill processes a long prompt over several steps.",
    "The quick brown fox jumps over the lazy dog, again and again.",
    "Numbers like 1, 2, 3, 42 and 528 appear in the cache layout table.",
    "Tandem generates text from the small model that ships with it.",
] * 4

VOCAB_SIZE = 320

COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, initializer_range=0.3, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False)
ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, max_position_embeddings=512)
MAMBA2_HYBRID = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=16)

CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(COMMON, **ATTENTION, num_hidden_layers=2)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        COMMON, **ATTENTION, num_hidden_layers=2, embedding_multiplier=2.0, attention_multiplier=0.2,
        residual_multiplier=0.7, logits_scaling=1.5)),
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(
        COMMON, num_hidden_layers=2, num_heads=8, head_dim=16, n_groups=2, state_size=16, chunk_size=16,
        expand=2)),
    "bamba": ("BambaConfig", "BambaForCausalLM", dict(
        COMMON, **ATTENTION, **MAMBA2_HYBRID, num_hidden_layers=3, attn_layer_indices=[1])),
    # Legacy layer names, MoE with a shared expert, rope and every Granite multiplier off its default.
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        COMMON, **ATTENTION, **MAMBA2_HYBRID, num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "attention"], num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=48, position_embedding_type="rope",
        embedding_multiplier=2.0, attention_multiplier=0.2, residual_multiplier=0.7, logits_scaling=1.5)),
    # No position embedding ("nope"), no experts (the shared MLP alone), tied embeddings.
    "granitemoehybrid-dense-nope": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        COMMON, **ATTENTION, **MAMBA2_HYBRID, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
        num_local_experts=0, shared_intermediate_size=48, position_embedding_type="nope", tie_word_embeddings=True,
        embedding_multiplier=2.0, attention_multiplier=0.2, residual_multiplier=0.7, logits_scaling=1.5)),
    # Layers: Mamba + MoE, attention + MLP, Mamba + MLP, attention + MoE.
    "jamba": ("JambaConfig", "JambaForCausalLM", dict(
        COMMON, **ATTENTION, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=3,
        expert_layer_offset=0, num_experts=4, num_experts_per_tok=2, mamba_d_state=16, mamba_dt_rank=8)),
    "mamba": ("MambaConfig", "MambaForCausalLM", dict(
        COMMON, num_hidden_layers=2, state_size=16, expand=2, time_step_rank=8, tie_word_embeddings=True)),
    # mamba_d_ssm (96) differs from expand x hidden (128); every muP multiplier is off its default.
    # Four KV heads make 16-token attention pages, so that decoding runs the preemption test's pool dry.
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", dict(
        COMMON, **dict(ATTENTION, num_key_value_heads=4), **dict(MAMBA2_HYBRID, mamba_n_heads=6), num_hidden_layers=2,
        mamba_d_ssm=96, embedding_multiplier=1.5, lm_head_multiplier=0.8, mlp_multipliers=[0.9, 1.2],
        key_multiplier=0.7, attention_in_multiplier=1.1, attention_out_multiplier=0.9,
        ssm_multipliers=[0.8, 1.2, 0.9, 1.1, 0.7], ssm_in_multiplier=1.3, ssm_out_multiplier=0.8)),
    "falcon_h1_rms_norm": ("FalconH1Config", "FalconH1ForCausalLM", dict(
        COMMON, **ATTENTION, **dict(MAMBA2_HYBRID, mamba_n_heads=6), num_hidden_layers=2, mamba_d_ssm=96,
        mamba_rms_norm=True, mamba_norm_before_gate=False, ssm_multipliers=[0.8, 1.2, 0.9, 1.1, 0.7])),
    # Every block type; routing limited to the best of two expert groups, with scaled weights.
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        COMMON, **ATTENTION, hybrid_override_pattern="M*-ME", head_dim=16, mamba_num_heads=8, mamba_head_dim=16,
        n_groups=2, ssm_state_size=16, chunk_size=16, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1,
        routed_scaling_factor=1.5)),
    # Three applications of two shared blocks (the third reuses the first), with adapters and RoPE.
    # At initializer_range 0.3 the shared attention amplifies float32 rounding until HF's own float32
    # and float64 logits differ by 6e-3; at 0.15 they differ by 3e-5 and the tokens stay diverse.
    "zamba2": ("Zamba2Config", "Zamba2ForCausalLM", dict(
        COMMON, **dict(ATTENTION, num_key_value_heads=4), initializer_range=0.15, tie_word_embeddings=True,
        num_hidden_layers=5, layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid"], num_mem_blocks=2,
        use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True, n_mamba_heads=8, mamba_ngroups=2,
        mamba_d_state=16, chunk_size=16)),
}


def build_tokenizer(directory: Path) -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>")
    fast.save_pretrained(directory)


def _inverse_softplus(x: torch.Tensor) -> torch.Tensor:
    return x + torch.log(-torch.expm1(-x))


def _redraw(name: str, tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor | None:
    """A new random value for `name`, near its usual value, or None to keep HF's (already random) one."""
    def uniform(low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(tensor.shape, generator=generator, dtype=torch.float64)

    if name.endswith(("dt_bias", "dt_proj.bias")):
        # softplus(dt_bias) is the time step at zero input: log-uniform in [1e-3, 1e-1] as mamba_ssm draws it.
        return _inverse_softplus(torch.exp(uniform(math.log(1e-3), math.log(1e-1))))
    if name.endswith("A_log"):
        return torch.log(uniform(1.0, 16.0))
    if name.endswith(".D"):
        return uniform(0.5, 1.5)
    if name.endswith("e_score_correction_bias"):
        return 0.2 * torch.randn(tensor.shape, generator=generator, dtype=torch.float64)
    if tensor.numel() > 1 and bool((tensor == tensor.flatten()[0]).all()):
        value = tensor.flatten()[0].item()
        if value == 0:  # biases
            return 0.1 * torch.randn(tensor.shape, generator=generator, dtype=torch.float64)
        return value * uniform(0.7, 1.3)  # norm weights (1) and other constant scales
    return None


@torch.no_grad()
def randomize(model, seed: int) -> None:
    """Redraw every parameter (and persistent buffer) HF initialised to a constant or a fixed pattern."""
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point():
            value = _redraw(name, tensor, generator)
            if value is not None:
                tensor.copy_(value.to(tensor.dtype))


def build_model(name: str, directory: Path, tokenizer_dir: Path, dtype=torch.float32, seed: int = 0, **overrides):
    """Save a tiny random `name` checkpoint (and the tokenizer) into `directory`; return the HF model."""
    config_class, model_class, kwargs = CONFIGS[name]
    config = getattr(transformers, config_class)(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    randomize(model, seed)
    model = model.to(dtype).eval()
    model.save_pretrained(directory)
    for path in tokenizer_dir.iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
    return model


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF's own greedy continuation of one prompt, never stopping at EOS."""
    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def hf_greedy_logprobs(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy tokens and, for each step, its log-softmax over the vocabulary (max_new_tokens, vocab).

    HF's own incremental decode produces them (one cached forward per new token), not a forward over
    the finished text: HF's prefill and decode paths differ where a config makes them (dt limits).
    """
    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    logprobs = torch.cat(out.logits).float().log_softmax(dim=-1)
    return out.sequences[0, len(prompt_ids):].tolist(), logprobs


def hf_last_logits(model, prompt_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt_ids])).logits[0, -1].float()


# Issue 17's families, built like CONFIGS (every parameter HF initialises to a constant or a pattern
# redrawn by `randomize`, expert_bias included), so that a weight loaded into the wrong place changes the tokens.
FAMILY_CONFIGS = {
    # The MLP width goes through LFM2's auto-adjustment (2/3 x 144 x 1.3, rounded up to 32: 128).
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(
        COMMON, **dict(ATTENTION, intermediate_size=144), num_hidden_layers=5,
        layer_types=["conv", "full_attention", "conv", "conv", "full_attention"], block_multiple_of=32,
        block_ffn_dim_multiplier=1.3, tie_word_embeddings=True)),
    # Biases in the projections and the conv, a wider conv, legacy full_attn_idxs, untied embeddings.
    "lfm2_bias": ("Lfm2Config", "Lfm2ForCausalLM", dict(
        COMMON, **ATTENTION, num_hidden_layers=3, full_attn_idxs=[2], conv_bias=True, conv_L_cache=4,
        block_auto_adjust_ff_dim=False)),
    # One dense layer, then experts (sigmoid routing with a selection bias, renormalised and scaled).
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", dict(
        COMMON, **ATTENTION, num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"],
        num_dense_layers=1, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        routed_scaling_factor=1.5)),
    # Untied embeddings, a non-default mixer eps, and biases on the projections as well as the conv.
    "falcon_mamba": ("FalconMambaConfig", "FalconMambaForCausalLM", dict(
        COMMON, num_hidden_layers=2, state_size=16, expand=2, time_step_rank=8, mixer_rms_eps=1e-3, use_bias=True)),
}


def build_family_model(name: str, directory: Path, tokenizer_dir: Path, dtype=torch.float32, seed: int = 0,
                       **overrides):
    """build_model for FAMILY_CONFIGS."""
    config_class, model_class, kwargs = FAMILY_CONFIGS[name]
    config = getattr(transformers, config_class)(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    randomize(model, seed)
    model = model.to(dtype).eval()
    model.save_pretrained(directory)
    for path in tokenizer_dir.iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
    return model


# Gated DeltaNet families (issue 17, second part). Gated DeltaNet layers around gated attention; every norm
# weight, dt_bias and A_log redrawn by `randomize`. Value heads are twice the key heads and the value head
# is narrower than the key head, so that a swapped head or layout changes the tokens.
GATED_DELTANET = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                      linear_value_head_dim=8, linear_conv_kernel_dim=4)
DELTANET_CONFIGS = {
    # Experts with a gated shared expert in every layer but the MLP-only layer 2; partial rotary (0.25).
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        COMMON, **dict(ATTENTION, head_dim=16), **GATED_DELTANET, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        mlp_only_layers=[2])),
    # Unfused Gated DeltaNet projections and a dense MLP.
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        COMMON, **dict(ATTENTION, head_dim=16), **GATED_DELTANET, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])),
    # Experts with a gated shared expert in every layer; attention placed by the default interval of 4.
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        COMMON, **dict(ATTENTION, head_dim=16), **GATED_DELTANET, num_hidden_layers=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)),
    # Separate projections and convs, an output gate, doubled beta (negative eigenvalues), OLMo-3 attention
    # with whole-projection q/k norms; attention in layers 1 and 3.
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM", dict(
        COMMON, **ATTENTION, **GATED_DELTANET, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])),
}


def build_deltanet_model(name: str, directory: Path, tokenizer_dir: Path, dtype=torch.float32, seed: int = 0,
                         **overrides):
    """build_model for DELTANET_CONFIGS."""
    config_class, model_class, kwargs = DELTANET_CONFIGS[name]
    config = getattr(transformers, config_class)(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    randomize(model, seed)
    model = model.to(dtype).eval()
    model.save_pretrained(directory)
    for path in tokenizer_dir.iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
    return model
