"""Loading a checkpoint directory into our modules.

Weights come as save_pretrained writes them (*.safetensors, sharded or not) or as mamba_ssm and older
transformers releases wrote them (pytorch_model.bin, sharded or not). Tensors HF and vLLM ignore on
load (rotary `inv_freq` buffers) are skipped.
"""

from __future__ import annotations

import contextlib
import importlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import torch
from safetensors import safe_open
from transformers import AutoTokenizer

from runtime.config import EngineConfig
from runtime.distributed import state
from runtime.distributed.sharding import shard_model
from runtime.dtypes import DTYPES
from runtime.gguf.config import gguf_path
from runtime.gguf.tokenizer import load_gguf_tokenizer
from runtime.gguf.weights import load_gguf_weights
from runtime.kernels.quant_linear import SCHEMES
from runtime.layers.parallel import Shard
from runtime.layers.quantized import QuantizingLoad
from runtime.models.causal_lm import CausalLM
from runtime.quant import loading as quant_loading

# Buffers that older checkpoints saved and that HF and vLLM skip on load: we compute them.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Any one of these makes a directory loadable by AutoTokenizer (fast, sentencepiece, BPE, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer.tiktoken")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names the tensors."""


def check_tokenizer_files(model_dir: Path) -> None:
    """Name the missing files before transformers' own (misleading "sentencepiece or tiktoken") message."""
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(
            f"no tokenizer in {model_dir}: it needs one of {', '.join(TOKENIZER_FILES)} (with tokenizer_config.json); "
            "copy the tokenizer files of the original checkpoint into the directory"
        )


def load_tokenizer(config: EngineConfig) -> Any:
    """transformers' tokenizer for the directory; its files are checked first, so a missing one is named."""
    if (gguf := gguf_path(config.model)) is not None:
        return load_gguf_tokenizer(gguf)
    check_tokenizer_files(config.model_dir)
    # AutoTokenizer would read config.json again, only for these fields, and refuse the spellings we
    # translate (mamba_ssm's, pre-4.48 Zamba2's): hand it our reading instead.
    hint = SimpleNamespace(model_type=config.hf_config.first("model_type"), _name_or_path=str(config.model_dir),
                           tokenizer_class=config.hf_config.first("tokenizer_class"))
    return AutoTokenizer.from_pretrained(config.model_dir, config=hint)


def _indexed(model_dir: Path, index: Path) -> list[Path]:
    weight_map = json.loads(index.read_text())["weight_map"]
    files = [model_dir / name for name in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{index.name} lists {', '.join(missing)}, which is missing from {model_dir}")
    return files


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The weight files, safetensors first (as transformers prefers them), else pytorch_model*.bin."""
    for index, pattern in (("model.safetensors.index.json", "*.safetensors"),
                           ("pytorch_model.bin.index.json", "pytorch_model*.bin")):
        if (model_dir / index).is_file():
            return _indexed(model_dir, model_dir / index)
        files = sorted(model_dir.glob(pattern))
        if files:
            return files
    raise CheckpointError(
        f"no weights in {model_dir}: expected *.safetensors (or pytorch_model.bin); "
        "download the checkpoint's weight files into the directory"
    )


# safetensors' dtype names (its format's header)
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def read_tensors(path: Path) -> Iterator[tuple[str, Callable[[], torch.Tensor], Callable[[], Any]]]:
    """(name, load, lazy) for each tensor of one file; a tensor is read only when asked, and `lazy()` (a
    safetensors slice) reads only the part a tensor-parallel rank indexes. `load(into)` reads a safetensors
    tensor straight into `into` where that has its shape and dtype and is a contiguous CPU tensor (and returns
    it): a parameter filled without a second copy of it alive meanwhile.

    `load()` reads a safetensors tensor with plain reads rather than from safetensors' memory map: every page
    of a mapped file that was read counts in the process's resident memory until the file is closed, so a
    2 GB checkpoint read through the map added 2 GB to the peak of a run that keeps 1 GB of quantized weights."""
    if path.suffix == ".safetensors":
        base, header = _safetensors_header(path)
        with safe_open(path, framework="pt") as f, open(path, "rb") as raw:
            for name in f.keys():
                entry = header[name]
                load = (lambda into=None, entry=entry: _read_tensor(raw, base, entry, into)) \
                    if entry["dtype"] in SAFETENSORS_DTYPES else (lambda into=None, name=name: f.get_tensor(name))
                yield name, load, lambda name=name: f.get_slice(name)
        return
    tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    for name, tensor in tensors.items():
        yield name, lambda into=None, tensor=tensor: tensor, lambda tensor=tensor: tensor


def _safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    """Where a safetensors file's data begins, and its header: name -> dtype, shape, data_offsets."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return 8 + size, header


def _read_tensor(file: Any, base: int, entry: dict[str, Any], into: torch.Tensor | None = None) -> torch.Tensor:
    shape, dtype = tuple(entry["shape"]), SAFETENSORS_DTYPES[entry["dtype"]]
    fits = (into is not None and into.device.type == "cpu" and tuple(into.shape) == shape and into.dtype == dtype
            and into.is_contiguous())
    tensor = into.detach() if fits else torch.empty(shape, dtype=dtype)
    start, end = entry["data_offsets"]
    if end > start:
        view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        assert len(view) == end - start, (entry, len(view))
        file.seek(base + start)
        done = 0
        while done < len(view):
            count = file.readinto(view[done:])
            if not count:
                raise CheckpointError(f"{file.name}: the file ends inside a tensor; is it whole?")
            done += count
    return into if fits else tensor


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@contextlib.contextmanager
def parameters_on_meta(enabled: bool) -> Iterator[None]:
    """Every nn.Parameter registered inside the block lives on the meta device; buffers stay real."""
    if not enabled:
        yield
        return
    register = torch.nn.Module.register_parameter

    def register_on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    # The modules' initializers are skipped too: a meta parameter gets uninitialised memory and the checkpoint's
    # values anyway, and torch runs them on meta tensors through decompositions that import torch._dynamo (145
    # MiB resident).
    initializers = {name: getattr(torch.nn.init, name) for name in INITIALIZERS}
    torch.nn.Module.register_parameter = register_on_meta
    for name in INITIALIZERS:
        setattr(torch.nn.init, name, _skip_init)
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register
        for name, function in initializers.items():
            setattr(torch.nn.init, name, function)


# torch.nn.init's in-place initializers (those torch's own modules call from reset_parameters).
INITIALIZERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")


def _skip_init(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


def allocate_parameters(model: torch.nn.Module, device: torch.device) -> None:
    """Real (uninitialised) memory for every meta parameter; the checkpoint fills it."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                # torch.empty, not empty_like: a meta tensor's empty_like runs a decomposition that imports sympy
                memory = torch.empty(param.shape, dtype=param.dtype, device=device)
                module._parameters[name] = torch.nn.Parameter(memory, requires_grad=param.requires_grad)


def build_model(config: EngineConfig, device: torch.device) -> CausalLM:
    module_name, _, class_name = config.declaration.implementation.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if (gguf := gguf_path(config.model)) is not None:
        return _build_from_gguf(cls, config, device, gguf)
    # With tensor parallelism, parameters are built on the meta device (no memory), narrowed to this
    # rank's shard, and only then allocated: a rank never holds more than its part of the weights.
    # With pipeline parallelism, the layers of other stages are dropped before anything is allocated.
    # A quantized checkpoint's linears never get float memory either: they are swapped for placeholders first.
    quant = config.checkpoint_quantization
    # On-the-fly quantization on one process quantizes each linear as soon as it is loaded (QuantizingLoad); a
    # tensor-parallel rank or pipeline stage holds only its part of the float weights, and quantizes them after.
    streaming = config.quantization in SCHEMES and tp == 1 and pp == 1 and quant is None
    on_meta = tp > 1 or pp > 1 or quant is not None or streaming
    with default_dtype(DTYPES[config.model_dtype]), device, parameters_on_meta(on_meta):
        model = cls(config.dims)
    files = checkpoint_files(config.model_dir)
    # Planned on the whole model (the file and config.json must agree on every linear, whatever the stage).
    pending = quant_loading.install(model, quant_loading.plan(model, quant, files)) if quant is not None else {}
    stage = None
    if pp > 1:
        from runtime.distributed.pipeline import cut_model

        stage = cut_model(model, config)
    shards = shard_model(model, state.rank(), tp) if tp > 1 else {}
    model.weight_shards = shards  # LoRA slots are cut like the weights they adapt (runtime/lora/layer.py)
    allocate_parameters(model, device)
    model.tie_weights()
    names, elsewhere = (stage.checkpoint_names(model), stage.elsewhere(model)) if stage else (None, set())
    if stage is not None and pending:  # other stages' quantized linears: their tensors are not read
        pending, dropped = quant_loading.keep_stage(model, pending)
        elsewhere |= dropped
    quantizing = QuantizingLoad(model, config.quantization) if streaming else None
    load_weights(model, files, shards, state.rank(), tp, names, elsewhere, pending,
                 quantizing.loaded if quantizing is not None else None)
    quant_loading.finish(model, pending, device)
    if stage is not None:
        model.stage_model = stage
    return model.eval()


def _build_from_gguf(cls: type, config: EngineConfig, device: torch.device, gguf: Path) -> CausalLM:
    """A GGUF file's model: built on the meta device, its quantized linears swapped in, then the rest allocated.
    Every tensor-parallel rank and pipeline stage reads the whole file, then keeps its part (a stage its layers)."""
    with default_dtype(DTYPES[config.model_dtype]), device, parameters_on_meta(True):
        model = cls(config.dims)
    model.weight_shards = {}  # until sharded below (LoRA cuts its slots like the weights)

    def allocate(model: torch.nn.Module) -> None:
        allocate_parameters(model, device)
        model.tie_weights()
    load_gguf_weights(model, gguf, config.hf_config, DTYPES[config.model_dtype], device, allocate)
    if config.pipeline_parallel_size > 1:
        from runtime.distributed.pipeline import cut_model

        stage = cut_model(model, config)  # the other stages' layers, and their tensors, go
        stage.checkpoint_names(model)  # what the stage holds, by the file's names
        model.stage_model = stage
    if config.tensor_parallel_size > 1:
        model.weight_shards = _shard_loaded(model, state.rank(), config.tensor_parallel_size)
    return model.eval()


def _shard_loaded(model: CausalLM, rank: int, tp: int) -> dict[str, Shard]:
    """Shard a model loaded whole (a GGUF file's: each rank reads the file, then keeps its part); its quantized
    linears cut themselves (QuantLinear.cut)."""
    full = {name: param.detach() for name, param in model.named_parameters()}
    shards = shard_model(model, rank, tp)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, shard in shards.items():
            params[name].copy_(_read_shard(shard, lambda name=name: full[name], lambda name=name: full[name], rank, tp))
    model.tie_weights()
    return shards


def _names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(sorted(names)[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _shape(lazy: Any) -> tuple[int, ...]:
    return tuple(lazy.get_shape() if hasattr(lazy, "get_shape") else lazy.shape)


def _read_shard(shard: Shard, load: Callable[[], torch.Tensor], lazy: Callable[[], Any], rank: int,
                tp: int) -> torch.Tensor:
    if shard.rank0_only:
        return load() if rank == 0 else torch.zeros(shard.full_shape)
    return shard.take(lazy(), rank, tp)


def load_weights(model: CausalLM, files: list[Path], shards: dict[str, Shard] | None = None, rank: int = 0,
                 tp: int = 1, names: dict[str, str] | None = None, elsewhere: set[str] | None = None,
                 pending: dict[str, Any] | None = None,
                 on_loaded: Callable[[str], list[str]] | None = None) -> None:
    """Fill every parameter from the checkpoint; a sharded one (`shards`, for `rank` of `tp`) reads only its part.

    A pipeline stage's parameters go by their whole-model names (`names`: ours -> the checkpoint's), and the
    tensors of other stages' parameters (`elsewhere`) are not read; the tensors of a quantized linear
    (`pending`, runtime.quant.loading) are kept for its conversion. `on_loaded(name)`, after each parameter is
    filled, returns the parameters it replaced (on-the-fly quantization): they are let go at once."""
    params, shards, elsewhere = dict(model.named_parameters()), shards or {}, elsewhere or set()
    if names is not None:
        params = {names[n]: p for n, p in params.items()}
        shards = {names[n]: s for n, s in shards.items()}
    loaded, unexpected = set(), []
    for path in files:
        for name, load, lazy in read_tensors(path):
            target = None if name.endswith(IGNORED_SUFFIXES) else model.checkpoint_name(name)
            if target is None or target in elsewhere or (pending and quant_loading.route(pending, target, name, load)):
                continue
            if target not in params:
                unexpected.append(name)
                continue
            param, shard = params[target], shards.get(target)
            expected = shard.full_shape if shard is not None else tuple(param.shape)
            shape = _shape(lazy()) if shard is not None else tuple((tensor := load(param)).shape)
            if shape != tuple(expected):
                raise CheckpointError(
                    f"{name}: the checkpoint has shape {shape} but the model expects "
                    f"{tuple(expected)}; does config.json match the weights?"
                )
            if shard is not None:
                tensor = _read_shard(shard, load, lazy, rank, tp)
            if tensor is not param:  # (read into it where the file's dtype is the parameter's)
                with torch.no_grad():
                    param.copy_(tensor)
            loaded.add(target)
            del param, tensor
            for released in on_loaded(target) if on_loaded is not None else ():
                del params[released]
    if unexpected:
        raise CheckpointError(f"unexpected tensors in the checkpoint: {_names(unexpected)}")
    missing = sorted(set(params) - loaded)
    if missing:
        raise CheckpointError(f"tensors missing from the checkpoint: {_names(missing)}")
