"""The one list of generated regions: id -> template + collector. Render, check and the hook read it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from matrix import collect, configs, evidence, options_table
from matrix.errors import UsageError
from matrix.lint import findings_in
from matrix.render import render


@dataclass(frozen=True)
class Target:
    id: str
    template: str
    collect: Callable[[Path], Mapping[str, Any]]  # repository root -> template context

    def render(self, root: Path) -> str:
        body = render(self.template, self.collect(root))
        assert not findings_in(body), f"{self.id}: the generator emitted a non-canonical glyph"
        return body


TARGETS = (
    Target("supported-models", "supported_models.md.j2", collect.supported_models),
    Target("v1-families", "v1_families.md.j2", collect.v1_families),
    Target("v1-features", "v1_features.md.j2", collect.v1_features),
    Target("evidence", "evidence.md.j2", evidence.evidence_page),
    Target("cache-layout", "cache_layout.md.j2", configs.cache_layout),
    Target("plan-example", "plan_example.md.j2",
           configs.PlanExample(("docs/configs/ibm-ai-platform__Bamba-9B", "--dtype", "bfloat16",
                                "--kv-cache-memory", "8GiB", "--max-model-len", "4096")).collect),
    Target("runtime-models", "runtime_models.md.j2", collect.runtime_models),
    Target("engine-options", "engine_options.md.j2", options_table.engine_options),
    Target("plan-prefix-caching", "plan_example.md.j2",
           configs.PlanExample(("docs/configs/ibm-ai-platform__Bamba-9B", "--dtype", "bfloat16",
                                "--enable-prefix-caching")).collect),
    Target("plan-speculative", "plan_example.md.j2",
           configs.PlanExample(("docs/configs/ibm-ai-platform__Bamba-9B", "--dtype", "bfloat16",
                                "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}',
                                "--kv-cache-memory", "8GiB", "--max-model-len", "4096")).collect),
)
IDS = tuple(target.id for target in TARGETS)
assert len(set(IDS)) == len(IDS), "target ids are unique"


def target(region_id: str) -> Target:
    for candidate in TARGETS:
        if candidate.id == region_id:
            return candidate
    raise UsageError(f"unknown generated region {region_id!r}; known ids: {', '.join(IDS)}")


def render_all(root: Path) -> dict[str, str]:
    return {t.id: t.render(root) for t in TARGETS}
