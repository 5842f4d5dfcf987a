"""The pipeline's stage planner: the decoder layers cut into contiguous stages (pure Python, no torch).

Each layer costs its weight bytes and the cache pages one sequence of max_model_len tokens holds in it:
an attention layer holds a page per block of tokens, a state (Mamba, short conv, Gated DeltaNet) layer
one page whatever the length, an MLP-only layer none. The planner balances both at once: it minimises
the largest stage's share of the weights plus its share of the pages (the embedding counts on the first
stage, the final norm and LM head on the last), so that no stage runs out of either memory first.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.options import spell


@dataclass(frozen=True)
class LayerCost:
    kind: str  # the declaration's LayerKind value
    weight_bytes: int
    attention_pages: int  # pages one sequence of max_model_len tokens holds in this layer
    state_pages: int


@dataclass(frozen=True)
class Stage:
    index: int
    first: int  # its first decoder layer
    last: int  # its last decoder layer (inclusive)
    weight_bytes: int  # its layers' weights, plus the embedding or the final norm and LM head where it holds them
    attention_pages: int  # per sequence of max_model_len tokens, over its layers
    state_pages: int
    kinds: tuple[str, ...]  # its layers' kinds, in order

    @property
    def layers(self) -> range:
        return range(self.first, self.last + 1)

    @property
    def pages(self) -> int:
        return self.attention_pages + self.state_pages


def check_splittable(num_layers: int, pp: int, architecture: str) -> None:
    if pp > num_layers:
        raise ValueError(
            f"{spell('pipeline_parallel_size', pp)} needs at least one decoder layer per stage, but {architecture} "
            f"has {num_layers}; use {spell('pipeline_parallel_size', num_layers)} or fewer stages")


def plan_stages(costs: list[LayerCost], pp: int, head_bytes: int = 0, tail_bytes: int = 0,
                architecture: str = "the model") -> list[Stage]:
    """`pp` contiguous stages of `costs`' layers, each at least one layer, balanced as the module says."""
    n = len(costs)
    check_splittable(n, pp, architecture)
    weights = [c.weight_bytes for c in costs]
    pages = [c.attention_pages + c.state_pages for c in costs]
    total_weights = max(1, sum(weights) + head_bytes + tail_bytes)
    total_pages = sum(pages)
    weight_sums, page_sums = _prefix_sums(weights), _prefix_sums(pages)

    def cost(first: int, end: int) -> tuple[float, float]:
        w = weight_sums[end] - weight_sums[first] + (head_bytes if first == 0 else 0) + (tail_bytes if end == n else 0)
        w_share = w / total_weights
        p_share = (page_sums[end] - page_sums[first]) / total_pages if total_pages else 0.0
        return (w_share + p_share, max(w_share, p_share))

    # best[k][end]: the best split of layers [0, end) into k stages, as (worst stage's cost, the cuts).
    best: list[dict[int, tuple[tuple[float, float], tuple[int, ...]]]] = [{0: ((0.0, 0.0), ())}]
    for k in range(1, pp + 1):
        row = {}
        for end in range(k, n - (pp - k) + 1):
            options = []
            for first, (worst, cuts) in best[k - 1].items():
                if first < end:
                    options.append((max(worst, cost(first, end)), cuts + (end,)))
            row[end] = min(options)
        best.append(row)
    cuts = (0,) + best[pp][n][1]
    stages = []
    for index, (first, end) in enumerate(zip(cuts, cuts[1:])):
        chosen = costs[first:end]
        w = sum(weights[first:end]) + (head_bytes if first == 0 else 0) + (tail_bytes if end == n else 0)
        stages.append(Stage(index, first, end - 1, w, sum(c.attention_pages for c in chosen),
                            sum(c.state_pages for c in chosen), tuple(c.kind for c in chosen)))
    return stages


def _prefix_sums(values: list[int]) -> list[int]:
    sums = [0]
    for value in values:
        sums.append(sums[-1] + value)
    return sums
