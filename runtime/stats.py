"""What the engine reports about itself: `Engine.stats()`, a frozen snapshot the server's /metrics reads.

The histograms have vLLM's meanings and buckets (vllm/v1/metrics/loggers.py), so that a vLLM dashboard
reads them the same way. Bookkeeping only: no torch.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class HistogramSnapshot:
    buckets: tuple[float, ...]
    # cumulative[i]: observations <= buckets[i]; `count` includes those above the last bucket (+Inf).
    cumulative: tuple[int, ...]
    sum: float
    count: int

    def minus(self, before: HistogramSnapshot) -> HistogramSnapshot:
        """What was observed since `before` (the same histogram, earlier)."""
        return HistogramSnapshot(self.buckets, tuple(a - b for a, b in zip(self.cumulative, before.cumulative)),
                                 self.sum - before.sum, self.count - before.count)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value

    def snapshot(self) -> HistogramSnapshot:
        cumulative, total = [], 0
        for count in self.counts[:-1]:
            total += count
            cumulative.append(total)
        return HistogramSnapshot(self.buckets, tuple(cumulative), self.sum, total + self.counts[-1])


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_pages_used: int = 0
    num_pages_total: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    # Finished requests by finish reason: "stop", "length", "abort" or "error".
    finished: dict[str, int] = field(default_factory=dict)
    time_to_first_token: HistogramSnapshot = field(default_factory=lambda: Histogram(TTFT_BUCKETS).snapshot())
    inter_token_latency: HistogramSnapshot = field(default_factory=lambda: Histogram(ITL_BUCKETS).snapshot())
    e2e_request_latency: HistogramSnapshot = field(default_factory=lambda: Histogram(E2E_BUCKETS).snapshot())
    # Sequences in each step's batch: shows whether requests ran together, whenever anyone looks.
    batch_size: HistogramSnapshot = field(default_factory=lambda: Histogram(BATCH_BUCKETS).snapshot())
    # Prompt tokens looked up in the prefix cache, and found there (vLLM's counters, in tokens).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Speculative decoding's totals (runtime.spec_decode.verify.SpecCounters); None when it is off.
    spec_decode: Any = None

    @property
    def kv_cache_usage(self) -> float:
        """The fraction (0 to 1) of the page pool held by requests, as vLLM's kv_cache_usage_perc."""
        return self.num_pages_used / self.num_pages_total if self.num_pages_total else 0.0
