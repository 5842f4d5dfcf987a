"""`tandem plan MODEL`: the cache layout of a model, explained from its config alone."""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any

from runtime.cache.layout import CacheLayout
from runtime.cache.prefix import prefix_block_size
from runtime.cli import examples
from runtime.config import EngineConfig
from runtime.hf_config import ConfigError
from runtime.options import add_config_options, config_kwargs, plural

MAX_LISTED_RUNS = 12
LETTERS = {"attention": "*", "mamba2": "M", "mamba1": "m", "parallel": "P", "hybrid": "H",
           "short_conv": "C", "gated_deltanet": "G", "lightning": "L", "mlp": "-"}


def add_engine_arguments(parser: argparse.ArgumentParser, plan: bool = False) -> None:
    """Every EngineConfig option (with `plan`, those that change a plan), generated from its field metadata:
    the same in every subcommand."""
    add_config_options(parser, EngineConfig, plan=plan)


def engine_options(args: argparse.Namespace) -> dict:
    """The EngineConfig keywords the user gave."""
    return config_kwargs(args, EngineConfig)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan", help="explain a model's cache layout from its config.json",
        description="Explain a model's cache layout from its config.json alone (no weights): the "
                    "layers, the attention bytes per token, each Mamba layer's state, the block size that "
                    "makes an attention page hold a Mamba page, the padding, and with --kv-cache-memory "
                    "and --max-model-len how many sequences fit; with --quantization or --kv-cache-memory, the "
                    "weight bytes in the model dtype, int8 and int4 (and with the pool).",
        epilog=examples(
            "tandem plan docs/configs/ibm-ai-platform__Bamba-9B",
            "tandem plan docs/configs/ibm-ai-platform__Bamba-9B --dtype bfloat16 --kv-cache-memory 8GiB "
            "--max-model-len 4096",
            "tandem plan docs/configs/ibm-ai-platform__Bamba-9B --tp 2 --json",
            "tandem plan docs/configs/meta-llama__Llama-3.2-1B --quantization int4",
        ))
    parser.add_argument("model", help="a model directory or its config.json")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_engine_arguments(parser, plan=True)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    options = engine_options(args)
    memory, max_model_len = options.get("kv_cache_memory"), options.get("max_model_len")
    if (memory is None) != (max_model_len is None):
        raise ConfigError("--kv-cache-memory and --max-model-len go together: give both to see how many "
                          "sequences fit")
    config = EngineConfig(model=args.model, **options)
    report = build_report(config, memory, max_model_len)
    if memory is not None:
        check_fit(report["fit"], config.cache)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def check_fit(fit: dict[str, Any], layout: CacheLayout) -> None:
    """A pool that holds no sequence is a user error, not a plan that says "0 sequences fit"."""
    if fit["max_num_sequences"] >= 1:
        return
    needed = fit["pages_per_sequence"] * layout.bytes_per_page_id
    pages = fit["num_page_ids"]
    fits = (pages - layout.num_state_groups) // max(1, layout.num_attention_groups) * (layout.block_size or 0)
    lower = f", or lower --max-model-len to {fits:,}" if fits >= 1 and layout.block_size else ""
    raise ConfigError(
        f"--kv-cache-memory {_bytes(fit['memory_bytes'])} holds {plural(pages, 'page id')}, but one sequence of "
        f"{plural(fit['max_model_len'], 'token')} needs {fit['pages_per_sequence']:,}: raise --kv-cache-memory to at "
        f"least {_bytes(needed)}{lower}"
    )


def layer_runs(layout: CacheLayout) -> list[dict[str, Any]]:
    runs, start = [], 0
    for kind, group in itertools.groupby(layout.layers):
        count = len(list(group))
        runs.append({"first": start, "last": start + count - 1, "kind": kind.value})
        start += count
    return runs


def build_report(config: EngineConfig, memory: int | None, max_model_len: int | None) -> dict[str, Any]:
    layout = config.cache
    report: dict[str, Any] = {
        "architecture": config.declaration.architecture,
        "dtype": config.model_dtype,
        "dtype_source": dtype_source(config),
        "engine": engine_status(config),
        "tensor_parallel_size": config.tensor_parallel_size,
        "pipeline_parallel_size": config.pipeline_parallel_size,
        "num_layers": len(layout.layers),
        "layer_counts": {kind.value: layout.layers.count(kind) for kind in dict.fromkeys(layout.layers)},
        "layers": layer_runs(layout),
        "attention": None,
        "mamba": None,
        "block_size": layout.block_size,
        "page_size_bytes": layout.page_size_bytes,
        "padding_pct": None,
        "group_size": layout.group_size,
        "num_attention_groups": layout.num_attention_groups,
        "num_state_groups": layout.num_state_groups,
        "bytes_per_page_id": layout.bytes_per_page_id,
        "prefix_caching": config.enable_prefix_caching,
        # config.json's quantization_config as resolved once (None: a float checkpoint).
        "weights": None if config.checkpoint_quantization is None else config.checkpoint_quantization.describe(),
    }
    if layout.attention:
        spec = layout.attention
        report["attention"] = {"num_kv_heads_per_rank": spec.num_kv_heads, "head_size": spec.head_size,
                               "dtype": spec.dtype, "bytes_per_token": spec.bytes_per_token}
    if layout.mamba:
        spec = layout.mamba
        report["mamba"] = {"name": config.declaration.state_name,
                           "shapes": [list(s) for s in spec.shapes], "dtypes": list(spec.dtypes),
                           "page_size_bytes": spec.unpadded_page_size_bytes,
                           "chunk_size": config.declaration.mamba_chunk_size(config.hf_config),
                           "state_dtype": config.state_dtype.dtype, "state_dtype_from": config.state_dtype.reason}
        if layout.attention:
            report["padding_pct"] = round(spec.padding_pct, 4)
    if config.enable_prefix_caching:
        report["prefix_cache"] = prefix_cache_report(config)
    if config.speculative is not None:
        from runtime.spec_decode.plan import speculative_report  # imports torch for a draft model or an MTP head

        report["speculative"] = speculative_report(config, memory)
    if config.enable_lora:
        from runtime.lora.plan import lora_report  # imports torch, for shapes on the meta device

        report["lora"] = lora_report(config)
    if config.pipeline_parallel_size > 1:
        report["stages"] = stages_report(config)
    report["weight_bytes"] = weights_report(config, memory)
    if memory is not None:
        # A sequence that verifies drafts also holds the states its verify keeps while the step runs.
        spare = report.get("speculative", {}).get("checkpoint_page_ids_per_sequence", 0)
        per_sequence = layout.pages_per_sequence(max_model_len) + spare
        report["fit"] = {"memory_bytes": memory, "max_model_len": max_model_len,
                         "pages_per_sequence": per_sequence,
                         "num_page_ids": memory // layout.bytes_per_page_id,
                         "max_num_sequences": (memory // layout.bytes_per_page_id) // per_sequence}
        if config.speculative is not None:
            from runtime.spec_decode.plan import add_fit

            add_fit(report["speculative"], report["fit"]["max_num_sequences"], config.max_num_seqs)
    return report


def stages_report(config: EngineConfig) -> list[dict[str, Any]]:
    """Each pipeline stage: its layers, one rank's weight bytes, the pages a sequence of max_model_len tokens
    holds in its layers and the bytes of its part of a page id. Torch builds the model on the meta device
    (no memory, no weights) to count its parameters."""
    from runtime.distributed.pipeline import stage_bytes_per_page_id, stage_plan

    return [{"stage": s.index, "first": s.first, "last": s.last, "pattern": "".join(LETTERS[k] for k in s.kinds),
             "weight_bytes": s.weight_bytes, "attention_pages": s.attention_pages, "state_pages": s.state_pages,
             "bytes_per_page_id": stage_bytes_per_page_id(config.cache, s.layers)} for s in stage_plan(config)]


def weights_report(config: EngineConfig, memory: int | None) -> dict[str, Any] | None:
    """The weights' bytes in the model dtype and quantized (runtime.weight_bytes, a model built on the meta
    device: torch is imported for this alone), and with a pool each format's weights plus the pool. Only
    where --quantization asks: building a large MoE (Qwen3-Next's 512 experts a layer),
    even on the meta device, takes a minute."""
    if not config.declaration.implementation or config.quantization is None:
        return None
    if config.checkpoint_quantization is not None:  # published quantized: the `weights` line names its format
        return None
    from runtime.weight_bytes import FORMATS, model_weight_bytes

    sizes = {scheme or config.model_dtype: size for scheme, size in model_weight_bytes(config, FORMATS).items()}
    report: dict[str, Any] = {"bytes": sizes, "quantization": config.quantization}
    if memory is not None:
        report["with_pool_bytes"] = {name: size + memory for name, size in sizes.items()}
    return report


def dtype_source(config: EngineConfig) -> str:
    """"option" (--dtype), "config" (config.json names it) or "assumed" (float32, as transformers loads it)."""
    if config.dtype != "auto":
        return "option"
    named = config.hf_config.first("dtype", "torch_dtype", default=None)
    return "config" if named not in (None, "auto") else "assumed"


def engine_status(config: EngineConfig) -> dict[str, Any]:
    support = config.declaration.capabilities.engine
    return {"status": support.status.value, "note": support.note or None}


def prefix_cache_report(config: EngineConfig) -> dict[str, Any]:
    """Prefix caching's blocks and, with state layers, the size of one snapshot (kept per cached boundary)."""
    layout, decl = config.cache, config.declaration
    chunk = decl.mamba_chunk_size(config.hf_config) if layout.mamba else None
    snapshot = layout.num_state_groups
    return {"block_size": prefix_block_size(layout, chunk, config.attention_alignment),
            "snapshot_page_ids": snapshot, "snapshot_bytes": snapshot * layout.bytes_per_page_id}


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n:,} B ({n / size:.2f} {unit})"
    return f"{n:,} B"


def format_report(r: dict[str, Any]) -> str:
    counts = ", ".join(f"{n} {kind}" for kind, n in r["layer_counts"].items())
    lines = [f"architecture   {r['architecture']}"]
    engine = r["engine"]
    if engine["status"] not in ("supported", "partial"):
        note = f" ({engine['note']})" if engine["note"] else ""
        lines.append(f"engine         {engine['status']}: cannot run on the engine yet{note}; "
                     "this is the layout it will use")
    assumed = " (assumed: config.json names no dtype; pass --dtype)" if r["dtype_source"] == "assumed" else ""
    lines += [
        f"dtype          {r['dtype']}{assumed}, tensor parallel {r['tensor_parallel_size']}"
        + (f", pipeline parallel {r['pipeline_parallel_size']}" if r["pipeline_parallel_size"] > 1 else ""),
        f"layers         {r['num_layers']}: {counts}",
    ]
    if r.get("weights"):
        lines.append(f"weights        {r['weights']}")
    if len(r["layers"]) <= MAX_LISTED_RUNS:
        for run in r["layers"]:
            span = str(run["first"]) if run["first"] == run["last"] else f"{run['first']}-{run['last']}"
            lines.append(f"  {span:<12} {run['kind']}")
    else:
        pattern = "".join(LETTERS[run["kind"]] * (run["last"] - run["first"] + 1) for run in r["layers"])
        legend = ", ".join(f"{LETTERS[kind]} {kind}" for kind in r["layer_counts"])
        lines.append(f"  pattern      {pattern}  ({legend})")
    if r["attention"]:
        a = r["attention"]
        lines.append(f"attention      {plural(a['num_kv_heads_per_rank'], 'KV head')} x {a['head_size']} per rank, "
                     f"{a['dtype']}: {a['bytes_per_token']:,} B per token per layer")
    if r["mamba"]:
        m = r["mamba"]
        states = " + ".join(f"{tuple(s)} {d}" for s, d in zip(m["shapes"], m["dtypes"]))
        # The kind leads the value, not the label: "gated-deltanet state" would not fit the label column.
        kind = m["name"].removesuffix(" state")
        lines.append(f"state          {kind}: {states} = {_bytes(m['page_size_bytes'])} per sequence per layer")
        lines.append(f"state dtype    {m['state_dtype']} ({m['state_dtype_from']})")
    lines.extend(_format_pages(r))
    if r.get("stages"):
        lines.extend(_format_stages(r))
    lines.extend(_format_weights(r.get("weight_bytes"), r["tensor_parallel_size"]))
    return "\n".join(lines)


def _format_stages(r: dict[str, Any]) -> list[str]:
    per_rank = " per rank" if r["tensor_parallel_size"] > 1 else ""
    lines = [f"stages         {len(r['stages'])}, balanced by weights{per_rank} and by the pages a sequence of "
             f"max_model_len tokens holds"]
    for s in r["stages"]:
        span = str(s["first"]) if s["first"] == s["last"] else f"{s['first']}-{s['last']}"
        lines.append(f"  stage {s['stage']:<6} layers {span:<7} {s['pattern']}")
        lines.append(f"               weights {_bytes(s['weight_bytes'])}; pages {s['attention_pages']:,} attention + "
                     f"{s['state_pages']:,} state; a page id spans {_bytes(s['bytes_per_page_id'])} here")
    return lines


def _format_weights(w: dict[str, Any] | None, tp: int) -> list[str]:
    """A line per format, the chosen one (--quantization, or none: the model dtype) marked."""
    if not w:
        return []
    chosen = w["quantization"] or next(iter(w["bytes"]))
    ranks = f" (the whole model; each of {tp} ranks holds about 1/{tp})" if tp > 1 else ""
    lines = [f"weights        decoder linears quantized, the rest in the model dtype{ranks}:"]
    for name, size in w["bytes"].items():
        pool = f"; with the pool {_bytes(w['with_pool_bytes'][name])}" if "with_pool_bytes" in w else ""
        lines.append(f"  {'*' if name == chosen else ' '} {name:<10} {_bytes(size)}{pool}")
    return lines


def _format_pages(r: dict[str, Any]) -> list[str]:
    lines = []
    if r["block_size"] is not None:
        lines.append(f"block size     {r['block_size']} tokens")  # at least the attention alignment, 16
    page = f"page           {_bytes(r['page_size_bytes'])}"
    if r["padding_pct"] is not None:
        name = r["mamba"]["name"].removesuffix(" state")
        page += f", {'Mamba' if name == 'mamba' else name} page padded by {r['padding_pct']:.2f}%"
    lines.append(page)
    lines.append(f"groups         {plural(r['group_size'], 'layer')} per group: {r['num_attention_groups']} attention, "
                 f"{r['num_state_groups']} state; a page id spans {_bytes(r['bytes_per_page_id'])}")
    if r.get("prefix_cache"):
        lines.extend(_format_prefix_cache(r["prefix_cache"]))
    if r.get("speculative"):
        from runtime.spec_decode.plan import format_speculative

        lines.extend(format_speculative(r["speculative"]))
    if r.get("lora"):
        lo = r["lora"]
        lines.append(f"lora slots     {lo['max_loras']} + 1 zero slot of rank {lo['max_lora_rank']} on "
                     f"{plural(lo['num_linears'], 'linear')}: {_bytes(lo['bytes_per_slot'])} per slot, "
                     f"{_bytes(lo['total_bytes'])} in all (float32, per rank; outside the page pool)")
    if "fit" in r:
        f = r["fit"]
        lines.append(f"fit            {_bytes(f['memory_bytes'])} holds {plural(f['num_page_ids'], 'page id')}; "
                     f"a sequence of {plural(f['max_model_len'], 'token')} needs {f['pages_per_sequence']:,}: "
                     f"{plural(f['max_num_sequences'], 'sequence')} fit{'s' if f['max_num_sequences'] == 1 else ''}")
    return lines


def _format_prefix_cache(p: dict[str, Any]) -> list[str]:
    lines = [f"prefix cache   blocks of {p['block_size']} tokens, named by a chained hash of their tokens"]
    if p["snapshot_page_ids"]:
        lines.append(f"  snapshot     {plural(p['snapshot_page_ids'], 'page id')} = {_bytes(p['snapshot_bytes'])} per cached "
                     "boundary: each state group's state, copied into")
        lines.append("               free pages where a prompt chunk ends on a block boundary; "
                     "evicted least recently used")
    return lines
