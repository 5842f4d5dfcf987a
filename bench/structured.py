"""What structured outputs cost: the decode step of constrained requests against unconstrained ones, and the
time to first token of a constrained request through a real `tandem serve` (issue 35's benchmark).

    python bench/structured.py                                  # 32 requests, bfloat16, 3 rounds
    python bench/structured.py --dtype float32 --repeats 1 --steps 16
    python bench/structured.py --skip-serve                     # the decode step only
    python bench/structured.py --device cuda --threads 8

The model is bench/throughput.py's ~100M `hybrid` random checkpoint (built once under --cache). Its
tokenizer (saved by build_checkpoint) is byte-level without a decoder: xgrammar takes it as a raw
vocabulary of 256 one-character tokens (id i is chr(i)) padded to the model's 32,000 logits, so a JSON
output is one character a step. A real 150k-token BPE vocabulary makes xgrammar's per-step mask fill
dearer (more tokens to check where the grammar is undecided), so this is the cost of the machinery
(the batch bitmask, its fill and apply, the matchers' advance) more than of a large vocabulary.

The schema (SCHEMA) is mid-size: an object of 8 required fields (strings with maxLength, integers with
bounds, an enum, a boolean, a nested object, an array with maxItems), free whitespace as the server allows.

Decode step: two engines (LLM(...).engine) of the same checkpoint, one given --requests constrained
prompts of --input-len random token ids, the other the same prompts unconstrained (EOS ignored, as long).
Each prefills its batch in one step; then the two decode in turns, one engine.step() of each (the order
swapped every step), each step timed while all --requests of its batch are running (--steps of them). On a
shared machine a slow spell then falls on both alike, where whole runs in turn took it on one of them. A
round's figure is the median of its steps, and its ratio the median over its steps side by side (step i
of one engine against step i of the other); one untimed warm-up round comes first.

Time to first token: `tandem serve` on 127.0.0.1 (a free port) with the same checkpoint; each request is
a streamed completion of one token through the official `openai` client, timed from the call to its
first chunk (one token: a random model's tokens beyond the byte vocabulary decode to no text, and the
server streams no chunk for an empty delta). Per round, in turns: a schema never seen before (a property
renamed, so its grammar compiles inside the request), the same schema again (compiled grammar cached), no
schema. Then, off the critical path: a request with a new large schema (--large-fields patterned string
fields: seconds of compilation) is sent, and while it compiles an unconstrained request is sent; its
time to first token is reported beside the large request's and beside an unconstrained one alone.

Medians over --repeats rounds, and each round's figures. The machine's load average is said before
and after: on a shared machine the figures are only as steady as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))

from bench.throughput import build_checkpoint, prompts  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "email": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "integer", "minimum": -1000, "maximum": 1000},
        "role": {"enum": ["admin", "editor", "viewer", "guest"]},
        "active": {"type": "boolean"},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                     "zip": {"type": "string", "maxLength": 8}},
                    "required": ["city", "zip"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
    },
    "required": ["name", "email", "age", "score", "role", "active", "address", "tags"],
}
MODEL_NAME = "bench-hybrid"
PROMPT = "A user record as JSON:"
STARTUP_TIMEOUT_S = 300


def fresh_schema(tag: str) -> dict:
    """SCHEMA with its first property renamed: a grammar no cache holds yet, of the same size."""
    properties = {f"name_{tag}" if key == "name" else key: value for key, value in SCHEMA["properties"].items()}
    required = [f"name_{tag}" if key == "name" else key for key in SCHEMA["required"]]
    return {**SCHEMA, "properties": properties, "required": required}


def large_schema(tag: str, fields: int) -> dict:
    """Many patterned string fields (each pattern its own automaton): seconds to compile at 3000 fields."""
    properties = {f"slow_{tag}_{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 5 + 1}}}[0-9]{{2,{i % 7 + 3}}}$"}
                  for i in range(fields)}
    return {"type": "object", "properties": properties, "required": list(properties)}


# ---------------------------------------------------------------------------------------------- decode step


def start_batch(engine, ids: list[list[int]], steps: int, constrained: bool) -> str:
    """Queue one request per prompt and prefill them all; returns the first request's id."""
    from runtime import SamplingParams, StructuredOutputsParams

    structured = StructuredOutputsParams(json=SCHEMA) if constrained else None
    # One prefill step and `steps` decode steps; a constrained output ends early only if its grammar does.
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True, structured_outputs=structured)
    first = [engine.add_request({"prompt_token_ids": p}, params) for p in ids][0]
    engine.step()  # every prompt's prefill (the batch budget holds them all) and first token
    return first


def timed_step(engine, requests: int, outputs: dict) -> float | None:
    """One engine step's seconds if every request was running in it (else None); finished outputs kept."""
    full = len(engine.scheduler.running) == requests and not engine.scheduler.waiting
    start = time.perf_counter()
    finished = engine.step()
    took = time.perf_counter() - start
    outputs.update((out.request_id, out) for out in finished)
    return took if full else None


def step_round(engines: dict[str, object], ids: list[list[int]], steps: int, swap: bool) -> tuple[dict, str]:
    """Both batches decoding at once on their own engines, one step of each in turn (so a slow spell of a
    shared machine falls on both); per kind, its steps' seconds; and the first constrained output."""
    first = {kind: start_batch(engine, ids, steps, kind == "constrained") for kind, engine in engines.items()}
    times: dict[str, list[float]] = {kind: [] for kind in engines}
    outputs: dict[str, dict] = {kind: {} for kind in engines}
    order = list(engines)[::-1] if swap else list(engines)
    while any(engine.has_unfinished() for engine in engines.values()):
        for kind in order:
            if engines[kind].has_unfinished():
                took = timed_step(engines[kind], len(ids), outputs[kind])
                if took is not None:
                    times[kind].append(took)
        order.reverse()  # neither kind always steps first
    tokens = outputs["constrained"][first["constrained"]].outputs[0].token_ids
    return times, raw_text(tokens)


def raw_text(token_ids: list[int]) -> str:
    """Output tokens as xgrammar reads the byte tokenizer: id i is the character chr(i)."""
    return "".join(chr(t) if t < 256 else "\N{REPLACEMENT CHARACTER}" for t in token_ids)


def step_rounds(args: argparse.Namespace, directory: Path) -> tuple[dict[str, list[float]], str, int]:
    """Per kind (constrained, unconstrained), each round's median decode step in seconds, and under "ratio"
    each round's median of constrained over unconstrained step for the steps taken side by side (step i of
    one against step i of the other: a load that comes and goes within a round cancels out); a sample
    output; the fewest steps a run timed."""
    import runtime  # noqa: F401  (before torch, as a user's import would be: it sets OpenMP's wait policy)
    from runtime import LLM

    def engine():
        # A page pool for the batch only (on a GPU the default takes its free memory, and there are two).
        return LLM(directory, dtype=args.dtype, max_num_seqs=args.requests, threads=args.threads,
                   device=args.device, max_model_len=args.input_len + args.steps + 16, kv_cache_memory="1GiB",
                   max_num_batched_tokens=max(2048, args.requests * args.input_len)).engine

    engines = {"unconstrained": engine(), "constrained": engine()}
    ids = prompts(args.requests, args.input_len)
    step_round(engines, ids, 3, swap=False)  # warm-up: compiled kernels, the schema's grammar
    figures: dict[str, list[float]] = {kind: [] for kind in [*engines, "ratio"]}
    counted, sample = [], ""
    for i in range(args.repeats):
        times, sample = step_round(engines, ids, args.steps, swap=i % 2 == 1)
        for kind, steps in times.items():
            figures[kind].append(statistics.median(steps))
            counted.append(len(steps))
        figures["ratio"].append(statistics.median(c / u for c, u in zip(times["constrained"],
                                                                         times["unconstrained"])))
    return figures, sample, min(counted)


def step_table(args: argparse.Namespace, figures: dict[str, list[float]]) -> str:
    rows = ["| dtype | requests | run | decode step ms | each round ms | constrained/unconstrained |",
            "| --- | ---: | --- | ---: | --- | ---: |"]
    ratios = figures["ratio"]
    for kind in ("unconstrained", "constrained"):
        ratio = f"{statistics.median(ratios):.3f}x" if kind == "constrained" else ""
        rows.append(f"| {args.dtype} | {args.requests} | {kind} | {1000 * statistics.median(figures[kind]):.1f} | "
                    + ", ".join(f"{1000 * s:.1f}" for s in figures[kind]) + f" | {ratio} |")
    rows.append("\neach round's ratio (its median over steps side by side): " + ", ".join(f"{r:.3f}x" for r in ratios))
    return "\n".join(rows)


# ----------------------------------------------------------------------------------------- time to first token


@contextlib.contextmanager
def serve(args: argparse.Namespace, directory: Path, log: Path) -> Iterator[str]:
    """`tandem serve` on 127.0.0.1, a port the system picks; yields its URL once /health answers."""
    import httpx

    command = [sys.executable, "-m", "runtime", "serve", str(directory), "--port", "0", "--dtype", args.dtype,
               "--max-model-len", "512", "--max-num-seqs", str(args.requests), "--threads", str(args.threads),
               "--device", args.device, "--served-model-name", MODEL_NAME]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               TRANSFORMERS_VERBOSITY="error")
    with open(log, "w") as out:  # a file, not a pipe: a pipe nobody reads would fill up and stall the server
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not (match := re.search(r"serving on (http://\S+)", log.read_text())):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"tandem serve did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        url = match.group(1)
        while httpx.get(f"{url}/health", timeout=30).status_code != 200:
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def first_token(client, schema: dict | None = None) -> float:
    """Seconds from the call to the first streamed chunk of a one-token completion."""
    extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "record", "schema": schema}}} \
        if schema is not None else {}
    start = time.perf_counter()
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, temperature=0, stream=True,
                                       extra_body=extra)
    took = None
    for chunk in stream:
        if took is None and chunk.choices:
            took = time.perf_counter() - start
    if took is None:
        raise SystemExit("a streamed completion ended without a chunk")
    return took


def during_compile(client, fields: int) -> tuple[float, float, bool]:
    """An unconstrained request's time to first token, sent while a new large schema compiles; the large
    request's own (its compilation included); and whether the first got its token before the large one did
    (else the compilation was over before the measurement and showed nothing)."""
    took: dict[str, float] = {}
    sent = threading.Event()

    def large() -> None:
        sent.set()
        took["large_start"] = time.perf_counter()
        took["large"] = first_token(client, large_schema(uuid.uuid4().hex[:8], fields))

    thread = threading.Thread(target=large)
    thread.start()
    sent.wait()
    time.sleep(0.2)  # the large request is in, its grammar compiling on the server's worker thread
    start = time.perf_counter()
    took["other"] = first_token(client)
    thread.join()
    overlapped = start + took["other"] < took["large_start"] + took["large"]
    return took["other"], took["large"], overlapped


TTFT_ROWS = ("unconstrained", "schema cached", "schema new (compile included)",
             "unconstrained, alone", "unconstrained, while a large schema compiles", "large schema new")


def ttft_rounds(args: argparse.Namespace, directory: Path) -> tuple[dict[str, list[float]], list[bool]]:
    """Per row of TTFT_ROWS, each round's time to first token in seconds; per round, whether the unconstrained
    request got its token while the large schema's request still waited for its own."""
    import openai

    figures: dict[str, list[float]] = {row: [] for row in TTFT_ROWS}
    overlaps: list[bool] = []
    with tempfile.TemporaryDirectory() as tmp, serve(args, directory, Path(tmp) / "serve.log") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600.0)
        first_token(client)  # warm-up: the first forward passes, and a grammar compiled once
        first_token(client, fresh_schema("warmup"))
        for i in range(args.repeats):
            tag = uuid.uuid4().hex[:8]
            turns = [("unconstrained", None), ("schema new (compile included)", fresh_schema(tag)),
                     ("schema cached", fresh_schema(tag))]
            for row, schema in (turns if i % 2 == 0 else [turns[1], turns[2], turns[0]]):
                figures[row].append(first_token(client, schema))
            figures["unconstrained, alone"].append(first_token(client))
            other, large, overlapped = during_compile(client, args.large_fields)
            figures["unconstrained, while a large schema compiles"].append(other)
            figures["large schema new"].append(large)
            overlaps.append(overlapped)
    return figures, overlaps


def ttft_table(args: argparse.Namespace, figures: dict[str, list[float]], overlaps: list[bool]) -> str:
    rows = ["| request | time to first token ms | each round ms |", "| --- | ---: | --- |"]
    for row in TTFT_ROWS:
        label = f"{row} ({args.large_fields} fields)" if row == "large schema new" else row
        rows.append(f"| {label} | {1000 * statistics.median(figures[row]):.1f} | "
                    + ", ".join(f"{1000 * s:.1f}" for s in figures[row]) + " |")
    during = statistics.median(figures["unconstrained, while a large schema compiles"])
    alone = statistics.median(figures["unconstrained, alone"])
    large = statistics.median(figures["large schema new"])
    rows.append(f"\noff the critical path: an unconstrained request sent while a {args.large_fields}-field schema "
                f"compiles got its first token in {1000 * during:.1f} ms ({during / alone:.2f}x its "
                f"{1000 * alone:.1f} ms alone), the large request in {1000 * large:.1f} ms; in {sum(overlaps)} of "
                f"{len(overlaps)} rounds it got its token while the large request still waited for its own")
    return "\n".join(rows)


# ----------------------------------------------------------------------------------------------------- report


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPUs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", help="float32 or bfloat16")
    parser.add_argument("--requests", type=int, default=32, help="concurrent requests in the decode batch")
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens per request (decode step)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per run")
    parser.add_argument("--large-fields", type=int, default=3000, help="fields of the large schema")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; medians reported")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "tandem-bench")
    parser.add_argument("--skip-serve", action="store_true", help="the decode step only")
    parser.add_argument("--skip-step", action="store_true", help="the time to first token only")
    args = parser.parse_args()
    started = time.perf_counter()
    directory = build_checkpoint("hybrid", args.cache)
    print(f"model: bench/throughput.py's hybrid ({directory}), {args.dtype}, {args.threads} threads, device "
          f"{args.device}; byte tokenizer (xgrammar: 256 one-character tokens of 32,000 logits)")
    print(f"before: {load()}")
    if not args.skip_step:
        figures, sample, counted = step_rounds(args, directory)
        print(f"\n## Decode step: {args.requests} requests x {args.input_len} tokens in, medians of {args.repeats} "
              f"rounds of {counted}+ timed steps each (all {args.requests} running; the two batches step in turns)\n")
        print(step_table(args, figures))
        print(f"a constrained output's first {args.steps + 1} tokens: {sample!r}")
    if not args.skip_serve:
        figures, overlaps = ttft_rounds(args, directory)
        print(f"\n## Time to first token through `tandem serve` (streamed, one token), medians of {args.repeats} "
              "rounds\n")
        print(ttft_table(args, figures, overlaps))
    print(f"\nafter: {load()}; total benchmark time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
