"""The one frozen config: user knobs validated, and the cache layout resolved, at construction.

Nothing reads a block size from anywhere but `EngineConfig.cache`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from runtime.cache.layout import CacheLayout, build_layout, resolve_block_size
from runtime.cache.spec import AttentionSpec, MambaSpec
from runtime.hf_config import ConfigError, HFConfig, architecture_of, canonical_dtype, load_raw_config
from runtime.models import resolve
from runtime.models.interface import LayerKind, ModelDeclaration
from runtime.options import option, parse_size, spell
from runtime.quant import CHECKPOINT_FORMATS, CheckpointQuant, read_quantization
from runtime.spec_decode.config import SpeculativeConfig, parse_speculative_config

logger = logging.getLogger("tandem")

# Tokens per attention page must be a multiple of this for the attention backend.
ATTENTION_ALIGNMENT = 16
DEFAULT_MAX_MODEL_LEN = 8192
DEFAULT_BATCHED_TOKENS = 2048
# "auto": Triton kernels on a CUDA device, the torch references elsewhere (see runtime.kernels).
KERNEL_BACKENDS = ("auto", "torch", "triton")
DEVICES = ("auto", "cpu", "cuda")
# On-the-fly weight-only quantization of a float checkpoint's decoder linears (vLLM's spellings), and the formats
# of checkpoints published quantized, which `quantization=` may name as vLLM lets it (it must match the file).
ON_THE_FLY = ("int8", "int4")
QUANTIZATIONS = (*ON_THE_FLY, *CHECKPOINT_FORMATS)
THREADS_ENV_VAR = "TANDEM_NUM_THREADS"
# The small model shipped with Tandem: what every command and LLM() run when given no model.
DEFAULT_MODEL = Path(__file__).parent / "default_model"
# Models at least this wide use every usable core by default; narrower ones one thread.
MIN_THREADED_HIDDEN = 512


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers narrow), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def default_threads(hidden_size: int, cores: int) -> int:
    """Threads for a model of this width on `cores` usable cores: all of them, and one for narrow models.

    The load average is not consulted: it counts this process's own recent work (an engine started
    just after another run on an idle 2-core machine picked one thread and ran 1.5x slower), and with
    OpenMP's spin bounded (runtime/__init__.py) a thread that shares its core with another process no
    longer stalls the others for long (docs/performance.md, "Threads").
    """
    return 1 if hidden_size < MIN_THREADED_HIDDEN else cores


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except argparse.ArgumentTypeError as err:
        raise ConfigError(f"{spell('kv_cache_memory')}: {err}") from None


@dataclass(frozen=True)
class StateDtype:
    dtype: str
    reason: str  # what chose it, as `tandem plan` prints it


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = field(default="auto", metadata=option(
        "model dtype: auto (config.json's; float32 when it names none), float32, bfloat16 or float16", plan=True))
    tensor_parallel_size: int = field(default=1, metadata=option(
        "processes (GPUs, or CPU processes) the model is split over; this command starts them (or joins "
        "torchrun's), and the cache shapes are per rank", aliases=("--tp", "-tp"), metavar="N", plan=True,
        plan_help="processes (GPUs, or CPU processes) the model would be split over: the plan shows one rank's "
                  "cache shapes"))
    pipeline_parallel_size: int = field(default=1, metadata=option(
        "stages the decoder layers are split into, one process group each (times tensor_parallel_size processes "
        "in all); this command starts them (or joins torchrun's), and each stage holds only its layers' weights "
        "and cache (see docs/features/pipeline_parallel.md)", aliases=("--pp", "-pp"), metavar="N", plan=True,
        plan_help="stages the decoder layers would be split into: the plan shows each stage's layers, weight "
                  "bytes and pages"))
    block_size: int | None = field(default=None, metadata=option(
        "attention tokens per page (default: the smallest valid size, see docs/cache_layout.md)", metavar="N",
        plan=True))
    enable_prefix_caching: bool = field(default=False, metadata=option(
        "reuse the cache of shared prompt prefixes (aligns blocks to the Mamba chunk size)", plan=True))
    mamba_ssm_dtype: str = field(default="auto", metadata=option(
        "SSM state dtype: auto (the model dtype) or a wider one, e.g. float32", metavar="DTYPE", plan=True))
    max_model_len: int | None = field(default=None, metadata=option(
        "longest prompt plus output, in tokens (default: the config's max_position_embeddings)", metavar="N",
        plan=True, plan_help="longest prompt plus output, in tokens: with --kv-cache-memory, the plan says how "
                             "many sequences of this length fit"))
    quantization: str | None = field(default=None, metadata=option(
        "quantize the decoder layers' linear weights on loading: int8 (one scale per output channel) or int4 "
        "(one scale per 128 inputs); embeddings, the LM head, norms and SSM parameters keep the model dtype. "
        "A checkpoint published quantized (quantization_config in config.json) loads as it is: fp8 or "
        "compressed-tensors may name its format, and must match it "
        "(default: none; see docs/features/quantization.md)", choices=QUANTIZATIONS, plan=True,
        plan_help="the format whose weight bytes the plan marks: int8 or int4 (it prints all of them)"))
    attention_alignment: int = ATTENTION_ALIGNMENT
    # Engine knobs (read by the engine, not by `tandem plan`).
    max_num_seqs: int = field(default=256, metadata=option("requests in the running batch at most", metavar="N"))
    max_num_batched_tokens: int | None = field(default=None, metadata=option(
        "tokens computed per step at most (default: 2048 with chunked prefill, else max_model_len)", metavar="N"))
    enable_chunked_prefill: bool = field(default=True, metadata=option(
        "split long prompts over several steps"))
    # Bytes, or a size as the command line takes it ("8GiB"); a string becomes its bytes at construction.
    kv_cache_memory: int | str | None = field(default=None, metadata=option(
        "size of the page pool: bytes, or a size such as 8GiB (default: 4GiB on the CPU; on a GPU its free memory at start-up less 10%% "
        "of its total; never more pages than max_num_seqs sequences of max_model_len tokens use)",
        hidden_aliases=("--memory",), type=parse_size, metavar="SIZE", plan=True,
        plan_help="size of the page pool, e.g. 8GiB: with --max-model-len, the plan says how many sequences fit"))
    num_pages: int | None = field(default=None, metadata=option(
        "give the page pool's size in pages instead of bytes", metavar="N"))
    seed: int = field(default=0, metadata=option("seed for requests that sample without their own", type=int,
                                                 metavar="N"))
    device: str = field(default="auto", metadata=option(
        "auto (CUDA when present, else the CPU), cpu or cuda", choices=DEVICES))
    threads: int | None = field(default=None, metadata=option(
        "CPU threads for the model's ops (default: the TANDEM_NUM_THREADS environment variable, else "
        "OMP_NUM_THREADS, else every core this process may run on, shared among tensor-parallel ranks, for models "
        "of hidden size 512 or more, and one thread for narrower ones; see docs/performance.md)", metavar="N"))
    kernel_backend: str = field(default="auto", metadata=option(
        "auto: Triton kernels on a CUDA device and the torch reference ops elsewhere (the TANDEM_KERNEL_BACKEND "
        "environment variable overrides auto); torch or triton forces one", choices=KERNEL_BACKENDS))
    enforce_eager: bool = field(default=False, metadata=option(
        "run every step through the model's Python, as vLLM's flag does: no captured decode steps on the CPU "
        "(see docs/performance.md)"))
    # As vLLM: a request asking for more top log-probabilities per token than this is refused.
    max_logprobs: int = field(default=20, metadata=option(
        "top log-probabilities per token a request may ask for at most", metavar="N"))

    # vLLM's spelling; a dict becomes its JSON text at construction, as the command line gives it.
    speculative_config: dict[str, Any] | str | None = field(default=None, metadata=option(
        'speculative decoding as vLLM\'s JSON object, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 1, "prompt_lookup_max": 5}\' (prompt lookup) or \'{"model": "DRAFT_DIR", '
        '"num_speculative_tokens": 4}\' (a smaller model with the same tokenizer) proposes tokens that one step '
        "verifies; greedy output is unchanged (see docs/features/speculative_decoding.md)", type=str, metavar="JSON",
        plan=True))
    # LoRA adapters (vLLM's spellings): the slots are allocated when the engine starts.
    enable_lora: bool = field(default=False, metadata=option(
        "serve LoRA adapters (PEFT's format) per request; see docs/features/lora.md", plan=True,
        plan_help="print the memory the LoRA slots take (--max-loras of --max-lora-rank), per rank"))
    max_loras: int = field(default=1, metadata=option(
        "adapters one step may use at most: the slots on the device", metavar="N", plan=True))
    max_lora_rank: int = field(default=16, metadata=option(
        "largest adapter rank accepted; every slot is this wide", metavar="R", plan=True))
    max_cpu_loras: int | None = field(default=None, metadata=option(
        "adapters kept checked in CPU memory (default: max_loras); others are read again from disk", metavar="N"))

    hf_config: HFConfig = field(init=False, repr=False)
    declaration: type[ModelDeclaration] = field(init=False, repr=False)
    # config.json's quantization_config, resolved once (None: a float checkpoint).
    checkpoint_quantization: CheckpointQuant | None = field(init=False, repr=False)
    cache: CacheLayout = field(init=False, repr=False)
    speculative: SpeculativeConfig | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.kv_cache_memory, str):
            object.__setattr__(self, "kv_cache_memory", _size(self.kv_cache_memory))
        self._check_positive()
        if self.kernel_backend not in KERNEL_BACKENDS:
            choices = ", ".join(KERNEL_BACKENDS)
            raise ConfigError(f"{spell('kernel_backend')} must be one of {choices}, got {self.kernel_backend!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"{spell('quantization')} must be one of {', '.join(QUANTIZATIONS)} (or None), "
                              f"got {self.quantization!r}")
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", self.device):
            raise ConfigError(f"{spell('device')} must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        raw = load_raw_config(self.model)
        declaration = resolve(architecture_of(raw))
        object.__setattr__(self, "declaration", declaration)
        object.__setattr__(self, "hf_config", declaration.read_config(raw))
        object.__setattr__(self, "checkpoint_quantization", read_quantization(raw))
        self._check_quantization()
        self._check_max_model_len()
        object.__setattr__(self, "cache", self._resolve_cache())
        speculative = parse_speculative_config(self.speculative_config, spell("speculative_config"),
                                               self.derived_max_model_len, self.hf_config.first("vocab_size"))
        object.__setattr__(self, "speculative", speculative)
        if isinstance(self.speculative_config, dict):
            object.__setattr__(self, "speculative_config", json.dumps(self.speculative_config, sort_keys=True))

    def _check_positive(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "block_size", "max_model_len", "max_num_seqs",
                     "max_num_batched_tokens", "kv_cache_memory", "num_pages", "threads", "max_loras",
                     "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{spell(name)} must be a positive integer, got {value!r}")

    def _check_quantization(self) -> None:
        quant, asked, decl = self.checkpoint_quantization, self.quantization, self.declaration
        if quant is None:
            if asked in CHECKPOINT_FORMATS:
                raise ConfigError(f"{spell('quantization', asked)} names a checkpoint format, but config.json has no "
                                  f"quantization_config; to quantize a float checkpoint on loading pass "
                                  f"{spell('quantization', 'int8')} or {spell('quantization', 'int4')}")
            return
        if asked in ON_THE_FLY:
            raise ConfigError(f"{spell('quantization', asked)}: this checkpoint is already quantized ({quant.method}, "
                              f"quantization_config in config.json) and is not quantized again; drop the option")
        if asked is not None and asked != quant.method:
            raise ConfigError(f"{spell('quantization', asked)} does not match the checkpoint, whose "
                              f"quantization_config says {quant.method}; pass {spell('quantization', quant.method)} or drop the option")
        if quant.method not in decl.quantizations:
            raise ConfigError(f"{decl.architecture}: {quant.method} checkpoints are not supported for this "
                              f"architecture yet (it supports: {', '.join(decl.quantizations) or 'none'})")

    @cached_property
    def dims(self) -> Any:
        """The model's frozen dimensions, read once; the loader builds the torch modules from them."""
        return self.declaration.dims(self.hf_config)

    def _check_max_model_len(self) -> None:
        limit = self.hf_config.first("max_position_embeddings", "n_positions")
        if self.max_model_len is not None and limit is not None and self.max_model_len > limit:
            raise ConfigError(
                f"{spell('max_model_len', self.max_model_len)} is more than the model was built for "
                f"(max_position_embeddings={limit} in config.json); pass {spell('max_model_len', limit)} or less"
            )

    @cached_property
    def derived_max_model_len(self) -> int:
        """max_model_len, else the config's max_position_embeddings, else 8192."""
        if self.max_model_len is not None:
            return self.max_model_len
        return self.hf_config.first("max_position_embeddings", "n_positions", default=DEFAULT_MAX_MODEL_LEN)

    @cached_property
    def derived_max_num_batched_tokens(self) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        # Without chunked prefill a whole prompt must fit in one step.
        return DEFAULT_BATCHED_TOKENS if self.enable_chunked_prefill else self.derived_max_model_len

    @cached_property
    def derived_threads(self) -> int | None:
        """CPU threads to set, or None to leave torch's count (OMP_NUM_THREADS) as it is."""
        if self.threads is not None:
            return self.threads
        env = os.environ.get(THREADS_ENV_VAR, "").strip()
        if env:
            if not env.isdigit() or int(env) < 1:
                raise ConfigError(f"{THREADS_ENV_VAR}={env!r} is not a thread count; set it to a positive integer")
            return int(env)
        if os.environ.get("OMP_NUM_THREADS", "").strip():
            return None
        # Tensor-parallel ranks on one machine share its cores.
        threads = default_threads(getattr(self.dims, "hidden_size", 0), usable_cores())
        return max(1, threads // self.world_size)

    @property
    def world_size(self) -> int:
        """Processes the engine runs in: every pipeline stage has tensor_parallel_size ranks."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @cached_property
    def model_dtype(self) -> str:
        return self.hf_config.dtype if self.dtype == "auto" else canonical_dtype(self.dtype)

    @cached_property
    def state_dtype(self) -> StateDtype:
        """The recurrent (SSM) state's dtype and why: the option, config.json, the model's default, its dtype."""
        if self.mamba_ssm_dtype != "auto":
            return StateDtype(canonical_dtype(self.mamba_ssm_dtype, spell("mamba_ssm_dtype")),
                              "set by --mamba-ssm-dtype / mamba_ssm_dtype")
        asked = self.hf_config.first("mamba_ssm_cache_dtype")
        if asked not in (None, "auto"):
            return StateDtype(canonical_dtype(asked, "mamba_ssm_cache_dtype in config.json"),
                              "asked for by mamba_ssm_cache_dtype in config.json")
        if self.declaration.default_ssm_dtype is not None:
            return StateDtype(self.declaration.default_ssm_dtype,
                              f"the {self.declaration.model_name} default, as in vLLM")
        return StateDtype(self.model_dtype, "the model dtype")

    @property
    def model_dir(self) -> Path:
        path = Path(self.model)
        return path if path.is_dir() else path.parent

    def _resolve_cache(self) -> CacheLayout:
        decl, cfg, tp = self.declaration, self.hf_config, self.tensor_parallel_size
        layers = decl.layout(cfg)
        assert set(layers) <= decl.layer_kinds, f"{decl.__name__}.layout gave undeclared layer kinds"
        attention = mamba = None
        if any(kind.has_state for kind in layers):
            state = decl.mamba_state(cfg, tp, self.model_dtype, self.state_dtype.dtype)
            mamba = MambaSpec(state.shapes, state.dtypes)
        attn_shape = decl.attention_shape(cfg, tp) if any(kind.has_attention for kind in layers) else None
        # Mamba-1 and short convolutions have a state after every token; the other state layers only at chunk ends.
        chunked = any(kind.has_state and kind not in (LayerKind.MAMBA1, LayerKind.SHORT_CONV) for kind in layers)
        if self.enable_prefix_caching and chunked and decl.mamba_chunk_size(cfg) is None:
            raise ConfigError(f"{decl.architecture}: prefix caching needs a Mamba chunk size, which this model lacks")
        block_size = resolve_block_size(
            attn_bytes_per_token=None if attn_shape is None else AttentionSpec(
                1, attn_shape.num_kv_heads, attn_shape.head_size, self.model_dtype
            ).bytes_per_token,
            mamba_page=None if mamba is None else mamba.unpadded_page_size_bytes,
            user_block_size=self.block_size,
            alignment=self.attention_alignment,
            chunk_size=decl.mamba_chunk_size(cfg) if mamba is not None else None,
            prefix_caching=self.enable_prefix_caching,
        )
        if attn_shape is not None:
            attention = AttentionSpec(block_size, attn_shape.num_kv_heads, attn_shape.head_size, self.model_dtype)
        layout = build_layout(layers, attention, mamba)
        _log_resolution(layout, user_block_size=self.block_size)
        return layout


def _log_resolution(layout: CacheLayout, user_block_size: int | None) -> None:
    if layout.attention is None or layout.mamba is None:
        return
    if user_block_size is None:
        logger.info(
            "Setting attention block size to %d tokens so that an attention page (%d B) "
            "is at least a Mamba state page (%d B).",
            layout.block_size,
            layout.attention.page_size_bytes,
            layout.mamba.unpadded_page_size_bytes,
        )
    logger.info(
        "Padding the Mamba page by %.2f%% so that Mamba and attention pages are equal (%d B).",
        layout.mamba.padding_pct,
        layout.page_size_bytes,
    )
