"""Where the GGUF tensors of the families in runtime/gguf/families.py go in the HF checkpoint, and which of the
converter's changes weights.py undoes for each (llama.cpp's convert_hf_to_gguf.py: conversion/mamba.py,
nemotron.py, falcon_h1.py, lfm2.py, qwen.py, jamba.py).

Every Mamba mixer: A stored as -exp(A_log), D (Mamba-2: as (heads, 1)), the conv squeezed, Mamba-2's gated norm
grouped; these are undone by suffix in weights._transform. Per family, as `Layout` says:
- nemotron_h: q/k rows permuted like Llama's (through GraniteHybridModel);
- qwen3next: its norms stored as 1 + w (all but the Gated DeltaNet's), in_proj_qkvz's per-key-head [q, k, v, z]
  blocks regrouped into attn_qkv ([all q, all k, all v]) and attn_gate (all z);
- nemotron_h, qwen3next and jamba: the experts stacked into 3-D tensors, one slice per expert.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAMBA2_MIXER = {"ssm_in.weight": "in_proj.weight", "ssm_out.weight": "out_proj.weight",
                "ssm_conv1d.weight": "conv1d.weight", "ssm_conv1d.bias": "conv1d.bias", "ssm_dt.bias": "dt_bias",
                "ssm_a": "A_log", "ssm_d": "D", "ssm_norm.weight": "norm.weight"}
MAMBA_MIXER = {**{k: v for k, v in MAMBA2_MIXER.items() if k not in ("ssm_dt.bias", "ssm_norm.weight")},
               "ssm_x.weight": "x_proj.weight", "ssm_dt.weight": "dt_proj.weight", "ssm_dt.bias": "dt_proj.bias"}
QKV = {"attn_q.weight": "q_proj.weight", "attn_k.weight": "k_proj.weight", "attn_v.weight": "v_proj.weight"}


def _under(prefix: str, table: dict[str, str]) -> dict[str, str]:
    return {k: prefix + v for k, v in table.items()}


def _with_biases(table: dict[str, str]) -> dict[str, str]:
    """Each linear's optional bias beside its weight (bias-carrying variants of the same family)."""
    biases = {k.removesuffix(".weight") + ".bias": v.removesuffix(".weight") + ".bias"
              for k, v in table.items() if k.endswith(".weight") and "norm" not in k}
    return {**biases, **table}


@dataclass(frozen=True)
class Layout:
    """Where a family's GGUF tensors go: `top` for the global ones, `layer` (a format string taking the block
    index) followed by `table[suffix]` for the blocks' ones; `experts` names the per-expert HF tensor ({e}) that
    each slice of a stacked GGUF expert tensor becomes; `permuted`: q/k rows permuted by the converter;
    `norm_offset`: the converter stored these norms' weights plus this; `qkvz`: the Gated DeltaNet's in_proj_qkvz
    was regrouped into attn_qkv and attn_gate."""
    top: dict[str, str]
    layer: str
    table: dict[str, str]
    experts: dict[str, str] = field(default_factory=dict)
    permuted: bool = False
    norm_offset: float = 0.0
    qkvz: str | None = None


BACKBONE = {"token_embd.weight": "backbone.embeddings.weight", "output_norm.weight": "backbone.norm_f.weight",
            "output.weight": "lm_head.weight"}
NEMOTRON_H = {
    "attn_norm.weight": "norm.weight", **_under("mixer.", MAMBA2_MIXER), **_under("mixer.", QKV),
    "attn_output.weight": "mixer.o_proj.weight", "ffn_up.weight": "mixer.up_proj.weight",
    "ffn_down.weight": "mixer.down_proj.weight", "ffn_gate_inp.weight": "mixer.gate.weight",
    "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
    "ffn_up_shexp.weight": "mixer.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mixer.shared_experts.down_proj.weight"}
FALCON_H1 = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm": "pre_ff_layernorm.weight",
    "ffn_norm.weight": "pre_ff_layernorm.weight", **_under("mamba.", MAMBA2_MIXER), **_under("self_attn.", QKV),
    "attn_output.weight": "self_attn.o_proj.weight", "ffn_gate.weight": "feed_forward.gate_proj.weight",
    "ffn_up.weight": "feed_forward.up_proj.weight", "ffn_down.weight": "feed_forward.down_proj.weight"}
LFM2 = {
    "attn_norm.weight": "operator_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "shortconv.conv.weight": "conv.conv.weight", "shortconv.in_proj.weight": "conv.in_proj.weight",
    "shortconv.out_proj.weight": "conv.out_proj.weight", **_under("self_attn.", QKV),
    "attn_output.weight": "self_attn.out_proj.weight", "attn_q_norm.weight": "self_attn.q_layernorm.weight",
    "attn_k_norm.weight": "self_attn.k_layernorm.weight", "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_up.weight": "feed_forward.w3.weight", "ffn_down.weight": "feed_forward.w2.weight"}
QWEN3_NEXT = {
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ssm_a": "linear_attn.A_log", "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias", "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "ssm_norm.weight": "linear_attn.norm.weight", "ssm_out.weight": "linear_attn.out_proj.weight",
    **_under("self_attn.", QKV), "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight", "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight"}
JAMBA = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "pre_ff_layernorm.weight",
    **_under("mamba.", MAMBA_MIXER), "ssm_dt_norm.weight": "mamba.dt_layernorm.weight",
    "ssm_b_norm.weight": "mamba.b_layernorm.weight", "ssm_c_norm.weight": "mamba.c_layernorm.weight",
    **_under("self_attn.", QKV), "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "feed_forward.gate_proj.weight", "ffn_up.weight": "feed_forward.up_proj.weight",
    "ffn_down.weight": "feed_forward.down_proj.weight", "ffn_gate_inp.weight": "feed_forward.router.weight"}
MODEL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
         "output.weight": "lm_head.weight"}
LAYOUTS = {
    "mamba": Layout(BACKBONE, "backbone.layers.{}.", _with_biases(
        {"attn_norm.weight": "norm.weight", **_under("mixer.", MAMBA_MIXER)})),
    "mamba2": Layout(BACKBONE, "backbone.layers.{}.", _with_biases(
        {"attn_norm.weight": "norm.weight", **_under("mixer.", MAMBA2_MIXER)})),
    "nemotron_h": Layout(BACKBONE, "backbone.layers.{}.", _with_biases(NEMOTRON_H), permuted=True, experts={
        "ffn_up_exps.weight": "mixer.experts.{e}.up_proj.weight",
        "ffn_down_exps.weight": "mixer.experts.{e}.down_proj.weight"}),
    "falcon_h1": Layout({**MODEL, "output_norm.weight": "model.final_layernorm.weight"}, "model.layers.{}.",
                        _with_biases(FALCON_H1)),
    "lfm2": Layout({**{k: v for k, v in MODEL.items() if k != "output_norm.weight"},
                    "token_embd_norm.weight": "model.embedding_norm.weight"}, "model.layers.{}.", _with_biases(LFM2)),
    "jamba": Layout({**MODEL, "output_norm.weight": "model.final_layernorm.weight"}, "model.layers.{}.",
                    _with_biases(JAMBA), experts={
                        f"ffn_{proj}_exps.weight": f"feed_forward.experts.{{e}}.{proj}_proj.weight"
                        for proj in ("gate", "up", "down")}),
    "qwen3_next": Layout(MODEL, "model.layers.{}.", QWEN3_NEXT, norm_offset=1.0,
                         qkvz="linear_attn.in_proj_qkvz.weight", experts={
                             f"ffn_{proj}_exps.weight": f"mlp.experts.{{e}}.{proj}_proj.weight"
                             for proj in ("gate", "up", "down")}),
}
