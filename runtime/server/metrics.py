"""/metrics: the engine's state in Prometheus text format, written by hand (no client library needed).

Names and meanings follow vLLM's (`vllm:X` is `tandem_X` here): the latency histograms, preemptions and
the cache usage as a fraction; `http_requests_total` counts responses by status code, as vLLM's
instrumentator does.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from runtime.stats import EngineStats, HistogramSnapshot

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(frozen=True)
class ServingStats:
    """A snapshot taken by the engine thread after each step; the event loop only reads it."""

    engine: EngineStats
    rejected: int = 0
    failed: int = 0

    def __getattr__(self, name: str):
        # num_running, num_pages_used, finished, ...: the engine's. (Only called for names not found here;
        # "engine" itself is refused so that a half-built instance cannot recurse.)
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _header(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def _histogram(name: str, help_text: str, label: str, hist: HistogramSnapshot) -> list[str]:
    lines = _header(name, "histogram", help_text)
    for bound, count in zip(hist.buckets, hist.cumulative):
        lines.append(f'{name}_bucket{{{label},le="{float(bound)}"}} {count}')
    lines += [f'{name}_bucket{{{label},le="+Inf"}} {hist.count}', f"{name}_sum{{{label}}} {hist.sum}",
              f"{name}_count{{{label}}} {hist.count}"]
    return lines


def render(stats: ServingStats, http_responses: Counter[tuple[str, str, int]], model_name: str) -> str:
    """`http_responses`: responses by (method, path, status code)."""
    engine = stats.engine
    label = f'model_name="{_escape(model_name)}"'
    single = [
        ("num_requests_running", "gauge", "Requests in the running batch.", engine.num_running),
        ("num_requests_waiting", "gauge", "Requests waiting to be scheduled.", engine.num_waiting),
        ("cache_pages_used", "gauge", "Pages of the page pool held by requests.", engine.num_pages_used),
        ("cache_pages_total", "gauge", "Pages in the page pool.", engine.num_pages_total),
        ("kv_cache_usage_perc", "gauge", "Fraction of the page pool held by requests (1 = full).",
         engine.kv_cache_usage),
        ("num_preemptions_total", "counter", "Requests preempted (their pages freed, recomputed later).",
         engine.num_preemptions),
        ("prompt_tokens_total", "counter", "Prompt tokens of accepted requests.", engine.prompt_tokens),
        ("generation_tokens_total", "counter", "Tokens generated.", engine.generated_tokens),
        ("requests_rejected_total", "counter", "Requests refused with 503: the waiting queue was full.",
         stats.rejected),
        ("requests_failed_total", "counter", "Requests failed by an error inside the engine.", stats.failed),
        ("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
         stats.prefix_cache_queries),
        ("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
    ]
    lines: list[str] = []
    for name, kind, help_text, value in single:
        lines += _header(f"tandem_{name}", kind, help_text) + [f"tandem_{name}{{{label}}} {value}"]
    name = "tandem_requests_finished_total"
    lines += _header(name, "counter", "Finished requests by finish reason.")
    lines += [f'{name}{{{label},finish_reason="{reason}"}} {engine.finished.get(reason, 0)}'
              for reason in FINISH_REASONS]
    histograms = [
        ("time_to_first_token_seconds", "Seconds from a request's arrival to its first token.",
         engine.time_to_first_token),
        ("inter_token_latency_seconds", "Seconds between two tokens of one request.", engine.inter_token_latency),
        ("e2e_request_latency_seconds", "Seconds from arrival to the last token, of requests that finished "
         "with stop or length.", engine.e2e_request_latency),
        ("step_num_requests", "Requests in the batch of each engine step.", engine.batch_size),
    ]
    for name, help_text, hist in histograms:
        lines += _histogram(f"tandem_{name}", help_text, label, hist)
    if engine.spec_decode is not None:
        lines += _spec_decode(engine.spec_decode, label)
    lines += _header("http_requests_total", "counter", "HTTP responses by method, path and status code.")
    lines += [f'http_requests_total{{method="{method}",handler="{_escape(path)}",status="{status}"}} {count}'
              for (method, path, status), count in sorted(http_responses.items())]
    return "\n".join(lines) + "\n"


def _spec_decode(counters, label: str) -> list[str]:
    """vLLM's speculative decoding counters (vllm:spec_decode_*), with accepted tokens per draft position."""
    lines: list[str] = []
    for name, help_text, value in (
        ("num_drafts", "Verify steps of a request with drafts.", counters.num_drafts),
        ("num_draft_tokens", "Draft tokens proposed and verified.", counters.num_draft_tokens),
        ("num_accepted_tokens", "Draft tokens accepted.", counters.num_accepted_tokens),
    ):
        metric = f"tandem_spec_decode_{name}_total"
        lines += _header(metric, "counter", help_text) + [f"{metric}{{{label}}} {value}"]
    metric = "tandem_spec_decode_num_accepted_tokens_per_pos_total"
    lines += _header(metric, "counter", "Draft tokens accepted at each position of the drafts.")
    lines += [f'{metric}{{{label},position="{i}"}} {count}' for i, count in enumerate(counters.accepted_per_pos)]
    return lines
