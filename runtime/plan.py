"""`tandem plan MODEL`: the cache layout of a model, explained from its config alone."""

from __future__ import annotations

import argparse
import itertools
import json
import re
from typing import Any

from runtime.cache.layout import CacheLayout
from runtime.cache.prefix import prefix_block_size
from runtime.config import EngineConfig
from runtime.hf_config import ConfigError

UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "kb": 1000, "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
         "g": 1024**3, "gib": 1024**3, "gb": 1000**3, "t": 1024**4, "tib": 1024**4, "tb": 1000**4}


MAX_LISTED_RUNS = 12
LETTERS = {"attention": "*", "mamba2": "M", "mamba1": "m", "parallel": "P", "hybrid": "H",
           "short_conv": "C", "gated_deltanet": "G", "mlp": "-"}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}; write it like 8GiB, 512MiB or 1000000000")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that decide the cache layout, shared by plan, generate and serve."""
    parser.add_argument("--dtype", default="auto",
                        help="model dtype: auto (from config.json), float32, bfloat16, float16")
    parser.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--block-size", type=int, default=None, help="attention tokens per page (default: automatic)")
    parser.add_argument("--enable-prefix-caching", action="store_true", help="align blocks to the Mamba chunk size")
    parser.add_argument("--mamba-ssm-dtype", default="auto", help="SSM state dtype: auto (model dtype) or float32, ...")


def engine_options(args: argparse.Namespace) -> dict:
    """The EngineConfig keywords of the options add_engine_arguments added."""
    return dict(dtype=args.dtype, tensor_parallel_size=args.tp, block_size=args.block_size,
                enable_prefix_caching=args.enable_prefix_caching, mamba_ssm_dtype=args.mamba_ssm_dtype)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("plan", help="explain a model's cache layout from its config.json")
    parser.add_argument("model", help="a model directory or its config.json")
    add_engine_arguments(parser)
    parser.add_argument("--memory", type=parse_size, help="pool size to fit sequences into, e.g. 8GiB")
    parser.add_argument("--max-model-len", type=int, help="tokens per sequence for --memory")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if (args.memory is None) != (args.max_model_len is None):
        raise ConfigError("--memory and --max-model-len go together: give both to see how many sequences fit")
    if args.max_model_len is not None and args.max_model_len < 1:
        raise ConfigError(f"--max-model-len must be positive, got {args.max_model_len}")
    config = EngineConfig(model=args.model, **engine_options(args))
    report = build_report(config, args.memory, args.max_model_len)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


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
        "tensor_parallel_size": config.tensor_parallel_size,
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
    }
    if layout.attention:
        spec = layout.attention
        report["attention"] = {"num_kv_heads_per_rank": spec.num_kv_heads, "head_size": spec.head_size,
                               "dtype": spec.dtype, "bytes_per_token": spec.bytes_per_token}
    if layout.mamba:
        spec = layout.mamba
        report["mamba"] = {"shapes": [list(s) for s in spec.shapes], "dtypes": list(spec.dtypes),
                           "page_size_bytes": spec.unpadded_page_size_bytes,
                           "chunk_size": config.declaration.mamba_chunk_size(config.hf_config)}
        if layout.attention:
            report["padding_pct"] = round(spec.padding_pct, 4)
    if config.enable_prefix_caching:
        report["prefix_cache"] = prefix_cache_report(config)
    if memory is not None:
        report["fit"] = {"memory_bytes": memory, "max_model_len": max_model_len,
                         "pages_per_sequence": layout.pages_per_sequence(max_model_len),
                         "num_page_ids": memory // layout.bytes_per_page_id,
                         "max_num_sequences": layout.max_num_sequences(memory, max_model_len)}
    return report


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
    lines = [
        f"architecture   {r['architecture']}",
        f"dtype          {r['dtype']}, tensor parallel {r['tensor_parallel_size']}",
        f"layers         {r['num_layers']}: {counts}",
    ]
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
        lines.append(f"attention      {a['num_kv_heads_per_rank']} KV heads x {a['head_size']} per rank, "
                     f"{a['dtype']}: {a['bytes_per_token']:,} B per token per layer")
    if r["mamba"]:
        m = r["mamba"]
        states = " + ".join(f"{tuple(s)} {d}" for s, d in zip(m["shapes"], m["dtypes"]))
        lines.append(f"mamba state    {states} = {_bytes(m['page_size_bytes'])} per sequence per layer")
    lines.extend(_format_pages(r))
    return "\n".join(lines)


def _format_pages(r: dict[str, Any]) -> list[str]:
    lines = []
    if r["block_size"] is not None:
        lines.append(f"block size     {r['block_size']} tokens")
    page = f"page           {_bytes(r['page_size_bytes'])}"
    if r["padding_pct"] is not None:
        page += f", Mamba page padded by {r['padding_pct']:.2f}%"
    lines.append(page)
    lines.append(f"groups         {r['group_size']} layers per group: {r['num_attention_groups']} attention, "
                 f"{r['num_state_groups']} state; a page id spans {_bytes(r['bytes_per_page_id'])}")
    if r.get("prefix_cache"):
        lines.extend(_format_prefix_cache(r["prefix_cache"]))
    if "fit" in r:
        f = r["fit"]
        lines.append(f"fit            {_bytes(f['memory_bytes'])} holds {f['num_page_ids']:,} page ids; "
                     f"a sequence of {f['max_model_len']:,} tokens needs {f['pages_per_sequence']:,}: "
                     f"{f['max_num_sequences']:,} sequences fit")
    return lines


def _format_prefix_cache(p: dict[str, Any]) -> list[str]:
    lines = [f"prefix cache   blocks of {p['block_size']} tokens, named by a chained hash of their tokens"]
    if p["snapshot_page_ids"]:
        ids = "page id" if p["snapshot_page_ids"] == 1 else "page ids"
        lines.append(f"  snapshot     {p['snapshot_page_ids']} {ids} = {_bytes(p['snapshot_bytes'])} per cached "
                     "boundary: each state group's state, copied into")
        lines.append("               free pages where a prompt chunk ends on a block boundary; "
                     "evicted least recently used")
    return lines
