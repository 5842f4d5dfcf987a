"""/metrics: the engine's state in Prometheus text format, written by hand (no client library needed)."""

from __future__ import annotations

from dataclasses import dataclass, field

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class EngineStats:
    """A snapshot taken by the engine thread after each step; the event loop only reads it."""

    num_running: int = 0
    num_waiting: int = 0
    num_pages_used: int = 0
    num_pages_total: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    rejected: int = 0
    failed: int = 0
    # Prompt tokens looked up in the prefix cache, and found there (vLLM's counters, in tokens).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(stats: EngineStats, model_name: str) -> str:
    label = f'model_name="{_escape(model_name)}"'
    single = [
        ("num_requests_running", "gauge", "Requests in the running batch.", stats.num_running),
        ("num_requests_waiting", "gauge", "Requests waiting to be scheduled.", stats.num_waiting),
        ("cache_pages_used", "gauge", "Pages of the page pool held by requests.", stats.num_pages_used),
        ("cache_pages_total", "gauge", "Pages in the page pool.", stats.num_pages_total),
        ("prompt_tokens_total", "counter", "Prompt tokens of accepted requests.", stats.prompt_tokens),
        ("generation_tokens_total", "counter", "Tokens generated.", stats.generated_tokens),
        ("requests_rejected_total", "counter", "Requests refused with 503: the waiting queue was full.",
         stats.rejected),
        ("requests_failed_total", "counter", "Requests failed by an error inside the engine.", stats.failed),
        ("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
         stats.prefix_cache_queries),
        ("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
    ]
    lines: list[str] = []
    for name, kind, help_text, value in single:
        lines += [f"# HELP tandem_{name} {help_text}", f"# TYPE tandem_{name} {kind}",
                  f"tandem_{name}{{{label}}} {value}"]
    name = "requests_finished_total"
    lines += [f"# HELP tandem_{name} Finished requests by finish reason.", f"# TYPE tandem_{name} counter"]
    lines += [f'tandem_{name}{{{label},finish_reason="{reason}"}} {stats.finished.get(reason, 0)}'
              for reason in FINISH_REASONS]
    return "\n".join(lines) + "\n"
