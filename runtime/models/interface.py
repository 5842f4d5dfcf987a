"""What a model class declares: capabilities, layer layout and cache shapes.

This module imports no torch: the docs generator, `tandem plan` and the block-size
resolver read declarations without weights, a GPU or a deep-learning framework.
Dtypes are spelled as strings ("bfloat16", "float32", ...).
"""

from __future__ import annotations

import enum
import importlib.util
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Mapping

from runtime.hf_config import DTYPE_SIZES, HFConfig


class Status(enum.Enum):
    SUPPORTED = "supported"
    PARTIAL = "partial"
    PLANNED = "planned"
    UNSUPPORTED = "unsupported"


class Feature(enum.Enum):
    PREFIX_CACHING = "prefix caching"
    CHUNKED_PREFILL = "chunked prefill"
    CUDA_GRAPHS = "CUDA graphs"
    TENSOR_PARALLEL = "tensor parallel"
    PIPELINE_PARALLEL = "pipeline parallel"
    LORA = "LoRA"
    SPECULATIVE_DECODING = "speculative decoding"


class LayerKind(enum.Enum):
    """What one decoder layer holds, and therefore what it caches."""

    ATTENTION = "attention"
    MAMBA2 = "mamba2"
    MAMBA1 = "mamba1"
    PARALLEL = "parallel"  # attention and Mamba-2 side by side in one layer (Falcon-H1)
    HYBRID = "hybrid"  # a shared attention block applied before a Mamba-2 mixer (Zamba2)
    SHORT_CONV = "short_conv"  # a gated short convolution (LFM2)
    GATED_DELTANET = "gated_deltanet"  # linear attention with a delta-rule state (Qwen3-Next)
    LIGHTNING = "lightning"  # linear attention with a decayed key-value state and no conv (MiniMax)
    MLP = "mlp"  # an MLP or MoE layer with no cache (Nemotron-H)

    @property
    def has_attention(self) -> bool:
        return self in (LayerKind.ATTENTION, LayerKind.PARALLEL, LayerKind.HYBRID)

    @property
    def has_state(self) -> bool:
        """Whether the layer keeps a fixed-size recurrent state per sequence (a "Mamba page")."""
        return self not in (LayerKind.ATTENTION, LayerKind.MLP)


@dataclass(frozen=True)
class Support:
    status: Status
    note: str | None = None


def supported(note: str | None = None) -> Support:
    return Support(Status.SUPPORTED, note)


def partial(note: str) -> Support:
    return Support(Status.PARTIAL, note)


def planned(note: str) -> Support:
    return Support(Status.PLANNED, note)


def unsupported(note: str | None = None) -> Support:
    return Support(Status.UNSUPPORTED, note)


@dataclass(frozen=True)
class Capabilities:
    """Status on the engine (V1) and of each engine feature, with optional notes."""

    engine: Support
    features: Mapping[Feature, Support] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", MappingProxyType(dict(self.features)))

    def feature(self, feature: Feature) -> Support:
        return self.features[feature]


@dataclass(frozen=True)
class AttentionShape:
    """One attention layer's KV cache per token, on one tensor-parallel rank."""

    num_kv_heads: int
    head_size: int


@dataclass(frozen=True)
class StateShape:
    """One stateful layer's per-sequence state on one rank: for Mamba, (conv, SSM)."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]


class DeclarationError(ValueError):
    """A model class declares something inconsistent; the message names model and field."""


class ModelDeclaration:
    """Base of every model class in the registry.

    A subclass sets the class attributes below and overrides the classmethods that
    its layer kinds need. Nothing here needs weights, torch or a GPU.
    """

    architecture: ClassVar[str]
    model_name: ClassVar[str]  # the family name shown in the docs ("Bamba")
    example_models: ClassVar[tuple[str, ...]]
    layer_kinds: ClassVar[frozenset[LayerKind]]
    capabilities: ClassVar[Capabilities]
    # "module:Class" of the torch implementation, or None while its forward pass has not landed.
    implementation: ClassVar[str | None] = None
    defaults: ClassVar[Mapping[str, Any]] = MappingProxyType({})
    # The SSM state dtype when neither the user nor config.json (`mamba_ssm_cache_dtype`) names one;
    # None keeps the model dtype.
    default_ssm_dtype: ClassVar[str | None] = None
    # What `tandem plan` calls one stateful layer's per-sequence state.
    state_name: ClassVar[str] = "mamba state"
    # Quantization formats this architecture runs, each proven by a test: "int8", "int4" (on the fly),
    # "fp8", "compressed-tensors" (checkpoints published so), "gguf".
    quantizations: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def read_config(cls, raw: Mapping[str, Any]) -> HFConfig:
        """The HF config with this architecture's defaults and legacy spellings resolved."""
        return HFConfig(cls.architecture, {**cls.defaults, **cls.translate_legacy(dict(raw))})

    @classmethod
    def translate_legacy(cls, raw: dict[str, Any]) -> dict[str, Any]:
        return raw

    @classmethod
    def dims(cls, cfg: HFConfig) -> Any:
        """The frozen dimensions the torch module is built from (see runtime.models.dims)."""
        raise NotImplementedError(f"{cls.__name__} has no torch implementation to build")

    @classmethod
    def layout(cls, cfg: HFConfig) -> tuple[LayerKind, ...]:
        raise NotImplementedError

    @classmethod
    def attention_shape(cls, cfg: HFConfig, tp: int) -> AttentionShape:
        raise NotImplementedError

    @classmethod
    def mamba_state_shape(cls, cfg: HFConfig, tp: int) -> tuple[tuple[int, ...], ...]:
        """Shapes of one stateful layer's state tensors on one rank (Mamba: conv, then SSM)."""
        raise NotImplementedError

    @classmethod
    def mamba_state_dtypes(cls, cfg: HFConfig, dtype: str, ssm_dtype: str | None) -> tuple[str, ...]:
        # The conv state follows the model dtype; the recurrent state may be kept wider.
        num_states = len(cls.mamba_state_shape(cfg, 1))
        return (dtype,) + (ssm_dtype or dtype,) * (num_states - 1)

    @classmethod
    def mamba_chunk_size(cls, cfg: HFConfig) -> int | None:
        return None

    @classmethod
    def mamba_state(cls, cfg: HFConfig, tp: int, dtype: str, ssm_dtype: str | None) -> StateShape:
        shapes = tuple(tuple(shape) for shape in cls.mamba_state_shape(cfg, tp))
        dtypes = tuple(cls.mamba_state_dtypes(cfg, dtype, ssm_dtype))
        if not shapes or len(dtypes) != len(shapes):
            raise DeclarationError(
                f"{cls.__name__}: mamba_state_dtypes: gives {len(dtypes)} dtypes for {len(shapes)} state tensors"
            )
        unknown = [d for d in dtypes if d not in DTYPE_SIZES]
        if unknown:
            raise DeclarationError(f"{cls.__name__}: mamba_state_dtypes: unknown dtype {unknown[0]!r}")
        return StateShape(shapes, dtypes)

    @classmethod
    def has_attention(cls) -> bool:
        return any(kind.has_attention for kind in cls.layer_kinds)

    @classmethod
    def has_state(cls) -> bool:
        return any(kind.has_state for kind in cls.layer_kinds)


FEATURES = tuple(Feature)


def _overrides(cls: type[ModelDeclaration], name: str) -> bool:
    return getattr(cls, name).__func__ is not getattr(ModelDeclaration, name).__func__


def validate_declaration(cls: type[ModelDeclaration]) -> None:
    """Raise DeclarationError naming the model and the field when a declaration is inconsistent."""

    def fail(field_name: str, problem: str) -> None:
        raise DeclarationError(f"{cls.__name__}: {field_name}: {problem}")

    for attribute in ("architecture", "model_name", "example_models", "layer_kinds", "capabilities"):
        if not hasattr(cls, attribute):
            fail(attribute, "is not declared")
    if not cls.example_models:
        fail("example_models", "lists no checkpoint")
    if not cls.layer_kinds:
        fail("layer_kinds", "is empty")
    missing = [f.value for f in FEATURES if f not in cls.capabilities.features]
    if missing:
        fail("capabilities.features", f"has no status for {', '.join(missing)}")
    if not _overrides(cls, "layout"):
        fail("layout", "is not defined")
    if cls.has_attention() and not _overrides(cls, "attention_shape"):
        fail("attention_shape", "the model has attention layers but declares no KV heads or head size")
    if cls.has_state() and not _overrides(cls, "mamba_state_shape"):
        fail("mamba_state_shape", "the model has Mamba layers but declares no state shapes")
    if LayerKind.MAMBA2 in cls.layer_kinds and not _overrides(cls, "mamba_chunk_size"):
        fail("mamba_chunk_size", "a Mamba-2 model must declare its chunk size")
    _validate_engine_status(cls, fail)


def _validate_engine_status(cls: type[ModelDeclaration], fail) -> None:
    status = cls.capabilities.engine.status
    if status in (Status.SUPPORTED, Status.PARTIAL):
        if cls.implementation is None:
            fail("capabilities.engine", f"is {status.value} but no forward pass (implementation) exists")
        module, _, name = cls.implementation.partition(":")
        if not name or importlib.util.find_spec(module) is None:
            fail("implementation", f"{cls.implementation!r} does not name an importable module:Class")
    elif status is Status.PLANNED and not cls.capabilities.engine.note:
        fail("capabilities.engine", "a planned model must say why in a note")
