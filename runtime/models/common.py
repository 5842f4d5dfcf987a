"""Capability sets shared by several declarations, so that each model file states only what differs."""

from __future__ import annotations

from runtime.models.interface import Capabilities, Feature, Status, Support, partial, planned, supported, unsupported

ON_ENGINE = supported()
NOT_ON_ENGINE = planned("The forward pass has not landed on the engine yet.")
SINGLE_DEVICE = planned("`tandem plan --tp N` computes per-rank shapes, but these layers are not split over ranks yet.")
NO_PREFIX_CACHING = planned("Prefix caching is not implemented; the block-size resolver already accounts for it.")
NO_CUDA_GRAPHS = planned("CUDA graph capture is not implemented: decode runs eagerly on a GPU. CPU decode steps are "
                         "captured and replayed where every op can be (enforce_eager turns that off).")
NO_MTP = partial("n-gram (prompt lookup) and draft model drafts, verified exactly for every layer kind; MTP heads "
                 "are planned.")


def capabilities(engine: Support = NOT_ON_ENGINE, **overrides: Support) -> Capabilities:
    """The engine status plus every feature, defaulting to what the engine does today."""
    features = {
        Feature.PREFIX_CACHING: NO_PREFIX_CACHING,
        Feature.CHUNKED_PREFILL: NOT_ON_ENGINE,
        Feature.CUDA_GRAPHS: NO_CUDA_GRAPHS,
        Feature.TENSOR_PARALLEL: SINGLE_DEVICE,
        Feature.PIPELINE_PARALLEL: unsupported(),
        Feature.LORA: unsupported(),
        # Every layer kind on the engine rolls back exactly (docs/features/speculative_decoding.md).
        Feature.SPECULATIVE_DECODING: NO_MTP if engine.status is Status.SUPPORTED else NOT_ON_ENGINE,
    }
    for name, support in overrides.items():
        features[Feature[name.upper()]] = support
    return Capabilities(engine=engine, features=features)


# What LoRA leaves out where a family has it (runtime/lora/adapter.py refuses such adapters by module name).
LORA_NO_EXPERTS = supported("Routed experts' projections are refused by name; attention, Mamba, MLP and shared-expert "
                            "linears are adapted.")
LORA_NO_DT_PROJ = supported("`dt_proj` is refused: transformers' Mamba-1 mixers read its weight directly, so a PEFT "
                            "adapter on it has no effect there.")
LORA_NO_EXPERTS_DT_PROJ = supported("Routed experts' projections and `dt_proj` (read directly by transformers' Mamba-1 "
                                    "mixer) are refused by name.")
LORA_ZAMBA2 = supported("The shared transformer blocks are one module per block here: an adapter whose weights differ "
                        "between the layers that apply one block is refused.")
