"""What `tandem plan --speculative-config` adds to a plan: the verify step, the states it keeps, and what the
proposer holds besides the model: prompt lookup nothing, a draft model its weights and a page pool of its own,
an MTP head its weights and its own attention K/V (docs/features/speculative_decoding.md).

From config.json alone: the draft model and the MTP head are built on torch's meta device (shapes, no memory,
no weights read) to count their weights, as runtime/weight_bytes.py does for the model.
"""

from __future__ import annotations

import importlib
from typing import Any

from runtime.cache.layout import cdiv
from runtime.hf_config import ConfigError
from runtime.options import plural, spell

# Qwen3.5's: whether its head has an embedding of its own (the engine sees an mtp.embed_tokens tensor).
MTP_DEDICATED_EMBEDDING_KEY = "mtp_use_dedicated_embeddings"


def speculative_report(config: Any, memory: int | None = None) -> dict[str, Any]:
    """What a verify step computes, which pages its rollback needs, and what the proposer holds."""
    spec, layout = config.speculative, config.cache
    # The state after each draft position, one page id per state group per draft (runtime/waves.py).
    groups = layout.num_state_groups * spec.num_speculative_tokens
    report: dict[str, Any] = {
        "method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
        "verify_positions": spec.num_speculative_tokens + 1,
        "checkpoint_page_ids_per_sequence": groups,
        "checkpoint_bytes_per_sequence": groups * layout.bytes_per_page_id,
        "attention_blocks_per_verify": cdiv(spec.num_speculative_tokens + 1, layout.block_size)
        if layout.block_size else 0}
    if spec.model is not None:
        report["draft"] = draft_report(config, memory)
    elif spec.method == "mtp":
        report["mtp"] = mtp_report(config)
    else:
        report.update(prompt_lookup_min=spec.prompt_lookup_min, prompt_lookup_max=spec.prompt_lookup_max)
    return report


def add_fit(report: dict[str, Any], num_sequences: int, max_num_seqs: int) -> None:
    """With a pool budget: the MTP head's K/V for the sequences that run at once (it lives outside the pool)."""
    head = report.get("mtp")
    if head is not None:
        running = min(num_sequences, max_num_seqs)
        head.update(num_sequences=running, kv_bytes=running * head["kv_bytes_per_sequence"])


def draft_report(config: Any, memory: int | None) -> dict[str, Any]:
    """The draft model's weights (the model dtype; built on the meta device) and its own pool: its page ids,
    what a sequence holds there, and with a budget how many."""
    from runtime.spec_decode.draft import draft_engine_config, draft_pages_per_sequence, draft_pool_pages
    from runtime.weight_bytes import model_weight_bytes

    draft = draft_engine_config(config)
    layout, max_model_len = draft.cache, config.derived_max_model_len
    per_sequence = draft_pages_per_sequence(layout, max_model_len)
    report = {"model": config.speculative.model, "architecture": draft.declaration.architecture,
              "weight_dtype": draft.model_dtype, "weight_bytes": model_weight_bytes(draft, (None,))[None],
              "num_layers": len(layout.layers), "block_size": layout.block_size,
              "num_attention_groups": layout.num_attention_groups, "num_state_groups": layout.num_state_groups,
              "bytes_per_page_id": layout.bytes_per_page_id, "max_model_len": max_model_len,
              "page_ids_per_sequence": per_sequence, "bytes_per_sequence": per_sequence * layout.bytes_per_page_id}
    if memory is not None:
        pages = draft_pool_pages(layout, config.max_num_seqs, max_model_len, memory)
        report.update(memory_bytes=memory, num_page_ids=pages, max_num_sequences=pages // per_sequence)
    return report


def mtp_report(config: Any) -> dict[str, Any]:
    """The head as runtime/models/qwen3_next/mtp.py builds it from the config: its weights besides the model's
    (the embeddings and LM head are the model's unless Qwen3.5's config gives it an embedding of its own),
    and the K/V its attention keeps per position, in one buffer per sequence outside the page pool."""
    import torch

    from runtime.dtypes import DTYPES
    from runtime.loader import default_dtype
    from runtime.models.qwen3_next.mtp import Qwen3NextMTP
    from runtime.spec_decode.mtp import LAYER_KEYS

    model_class = _mtp_model_class(config)
    configured = config.hf_config.first(*LAYER_KEYS)
    num_layers = int(configured) if configured else 1
    dedicated = bool(config.hf_config.first(MTP_DEDICATED_EMBEDDING_KEY, default=False))
    dims, dtype = config.dims, DTYPES[config.model_dtype]
    with default_dtype(dtype), torch.device("meta"):
        head = Qwen3NextMTP(dims, model_class.decoder_layer, num_layers, dedicated)
    weight_bytes = sum(p.numel() * p.element_size() for p in head.parameters())
    # Layer 0 keeps an entry per position the model ran; further layers only the drafts', truncated again.
    per_token = 2 * dims.num_kv_heads * dims.head_dim * dtype.itemsize
    max_model_len = config.derived_max_model_len
    return {"num_layers": num_layers, "num_layers_from": "config" if configured else "assumed",
            "dedicated_embedding": dedicated, "weight_dtype": config.model_dtype, "weight_bytes": weight_bytes,
            # The file decides which of the head's linears a quantized checkpoint quantizes: the bytes are an upper
            # bound there.
            "weight_bytes_at_most": config.checkpoint_quantization is not None,
            "num_kv_heads": dims.num_kv_heads, "head_size": dims.head_dim, "kv_dtype": config.model_dtype,
            "kv_bytes_per_token": per_token, "max_model_len": max_model_len,
            "kv_bytes_per_sequence": per_token * max_model_len,
            # HeadKV grows its buffer to twice the entries it needs (at least 16).
            "kv_bytes_per_sequence_allocated_at_most": per_token * max(16, 2 * max_model_len)}


def _mtp_model_class(config: Any) -> type:
    """The model class, which must have an MTP head (runtime/spec_decode/mtp.py refuses the rest as well)."""
    module, _, name = config.declaration.implementation.partition(":")
    model_class = getattr(importlib.import_module(module), name) if module else None
    if model_class is None or not hasattr(model_class, "load_mtp_head"):
        raise ConfigError(f'{spell("speculative_config")}: method "mtp" reads the multi-token-prediction heads of '
                          f"Qwen3-Next and Qwen3.5 checkpoints, and {config.declaration.architecture} has none; "
                          'use {"method": "ngram", ...}')
    return model_class


# Text ---------------------------------------------------------------------------------------------------


def format_speculative(p: dict[str, Any]) -> list[str]:
    from runtime.plan import _bytes

    draft, head = p.get("draft"), p.get("mtp")
    if draft is not None:
        source = f"the argmax of draft model {draft['model']}, {draft['architecture']}"
    elif head is not None:
        source = "the argmax of the checkpoint's MTP head"
    else:
        source = f"n-grams of {p['prompt_lookup_min']}-{p['prompt_lookup_max']}"
    lines = [f"speculative    {p['method']}: {plural(p['num_speculative_tokens'], 'draft token')} per step "
             f"({source}), verified as {p['verify_positions']} positions in one step"]
    if p["checkpoint_page_ids_per_sequence"]:
        lines.append(f"  kept states  {plural(p['checkpoint_page_ids_per_sequence'], 'page id')} = "
                     f"{_bytes(p['checkpoint_bytes_per_sequence'])} per verifying sequence (one per state group per "
                     "draft), borrowed from free pages for the step: the state after each draft position, copied "
                     "back after a rejected draft")
    else:
        lines.append("  kept states  none: attention alone, a rejected draft's KV is dropped by length")
    if draft is not None:
        lines.extend(_format_draft_pool(draft, _bytes))
    if head is not None:
        lines.extend(_format_mtp_head(head, _bytes))
    return lines


def _format_draft_pool(d: dict[str, Any], size) -> list[str]:
    groups = f"{d['num_attention_groups']} attention, {d['num_state_groups']} state"
    checkpoint = f", {d['num_state_groups']} of them its state checkpoint" if d["num_state_groups"] else ""
    lines = [f"  draft        weights {size(d['weight_bytes'])} in {d['weight_dtype']}, besides the model's",
             f"  draft pool   its own pages: {plural(d['num_layers'], 'layer')}, groups {groups}; a page id spans "
             f"{size(d['bytes_per_page_id'])}",
             f"               a sequence of {plural(d['max_model_len'], 'token')} holds {d['page_ids_per_sequence']:,} "
             f"page ids{checkpoint} = {size(d['bytes_per_sequence'])}"]
    if "num_page_ids" in d:
        lines.append(f"               a budget of its own, the model's {size(d['memory_bytes'])}, holds "
                     f"{plural(d['num_page_ids'], 'page id')} (no more than max_num_seqs sequences use): "
                     f"{plural(d['max_num_sequences'], 'sequence')} at full length")
    return lines


def _format_mtp_head(h: dict[str, Any], size) -> list[str]:
    layers = plural(h["num_layers"], "decoder layer")
    if h["num_layers_from"] == "assumed":
        layers += " (assumed: config.json names none, the checkpoint's mtp.layers.N decide)"
    embedding = "an embedding of its own and the model's LM head" if h["dedicated_embedding"] else \
        "the model's embeddings and LM head"
    weights = f"{size(h['weight_bytes'])} in {h['weight_dtype']}"
    if h["weight_bytes_at_most"]:
        weights = f"at most {weights} (less: the checkpoint's quantized linears stay in its format)"
    lines = [f"  mtp head     {layers} of full attention and the model's MLP or experts, with fc and norms: weights "
             f"{weights}, besides the model's; it reads {embedding}",
             f"  head K/V     its own, outside the page pool: {plural(h['num_kv_heads'], 'KV head')} x {h['head_size']}, "
             f"{h['kv_dtype']}: {h['kv_bytes_per_token']:,} B per token",
             f"               a sequence of {plural(h['max_model_len'], 'token')} holds "
             f"{size(h['kv_bytes_per_sequence'])}, in a buffer grown by doubling "
             f"(at most {size(h['kv_bytes_per_sequence_allocated_at_most'])})"]
    if "kv_bytes" in h:
        lines.append(f"               the {plural(h['num_sequences'], 'sequence')} that fit and run at once: "
                     f"{size(h['kv_bytes'])} besides the pool")
    return lines
