"""Reading a Hugging Face `config.json` without transformers or torch.

Published configs spell infinity two ways (a bare `Infinity` token from transformers
4.x, `{"__float__": "Infinity"}` from 5.x) and some are not in transformers' format at
all (mamba_ssm's native `d_model`/`n_layer` files); all of that is settled here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator, Mapping

DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}
# "org/name" with no such path here: most likely a Hugging Face model id.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16"}


class ConfigError(ValueError):
    """A config that cannot be read or does not make sense; the message says how to fix it."""


def canonical_dtype(name: str, what: str = "dtype") -> str:
    name = str(name).removeprefix("torch.")
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_SIZES:
        raise ConfigError(f"unknown {what} {name!r}; choose one of {', '.join(DTYPE_SIZES)}")
    return name


def _decode_special_floats(obj: dict[str, Any]) -> Any:
    if set(obj) == {"__float__"}:
        return float(obj["__float__"])
    return obj


def config_path(model: str | Path) -> Path:
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        if not Path(model).exists() and HUB_ID.fullmatch(str(model)):
            raise ConfigError(
                f"{model} looks like a Hugging Face model id, but Tandem reads local directories only: fetch it with "
                f"`hf download {model} --local-dir DIR` and pass DIR"
            )
        raise ConfigError(f"no config.json at {path}: pass a model directory or the path of its config.json")
    return path


def load_raw_config(model: str | Path) -> dict[str, Any]:
    from runtime.gguf.config import gguf_path, raw_config  # a GGUF file (or a directory holding one) is a model
    if (gguf := gguf_path(model)) is not None:
        return raw_config(gguf)
    path = config_path(model)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"), object_hook=_decode_special_floats)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object, not {type(raw).__name__}")
    return from_mamba_ssm_format(raw)


def from_mamba_ssm_format(raw: dict[str, Any]) -> dict[str, Any]:
    """Translate mamba_ssm's native config (`d_model`, `n_layer`, `ssm_cfg`) into HF keys.

    Only pure Mamba-1 / Mamba-2 files are translated; mamba_ssm's own hybrids
    (`attn_layer_idx` non-empty) have no HF architecture to run them and are refused.
    """
    if "architectures" in raw or "model_type" in raw or not {"d_model", "n_layer"} <= raw.keys():
        return raw
    if raw.get("attn_layer_idx"):
        raise ConfigError(
            "this is a mamba_ssm hybrid config (attn_layer_idx is set); it has no Hugging Face architecture. "
            "Convert the checkpoint to a transformers format (for example Bamba) first"
        )
    ssm = dict(raw.get("ssm_cfg") or {})
    layer = ssm.pop("layer", "Mamba1")
    # mamba_ssm pads the vocabulary (and so the embedding it saves) to a multiple of pad_vocab_size_multiple.
    vocab, multiple = raw.get("vocab_size", 50277), raw.get("pad_vocab_size_multiple", 8)
    common = {
        "hidden_size": raw["d_model"],
        "num_hidden_layers": raw["n_layer"],
        "vocab_size": vocab + (-vocab) % multiple,
        "tie_word_embeddings": raw.get("tie_embeddings", True),
        "residual_in_fp32": raw.get("residual_in_fp32", True),
        "pad_vocab_size_multiple": raw.get("pad_vocab_size_multiple", 8),
    }
    if layer == "Mamba2":  # mamba_ssm.modules.mamba2.Mamba2 defaults
        d_model, expand, headdim = raw["d_model"], ssm.get("expand", 2), ssm.get("headdim", 64)
        return {
            **common,
            "architectures": ["Mamba2ForCausalLM"],
            "model_type": "mamba2",
            "state_size": ssm.get("d_state", 128),
            "conv_kernel": ssm.get("d_conv", 4),
            "expand": expand,
            "head_dim": headdim,
            "num_heads": expand * d_model // headdim,
            "n_groups": ssm.get("ngroups", 1),
            "chunk_size": ssm.get("chunk_size", 256),
        }
    if layer == "Mamba1":  # mamba_ssm.modules.mamba_simple.Mamba defaults
        return {
            **common,
            "architectures": ["MambaForCausalLM"],
            "model_type": "mamba",
            "state_size": ssm.get("d_state", 16),
            "conv_kernel": ssm.get("d_conv", 4),
            "expand": ssm.get("expand", 2),
            "time_step_rank": ssm.get("dt_rank", "auto"),
        }
    raise ConfigError(f"unknown mamba_ssm layer type {layer!r} in ssm_cfg; expected 'Mamba1' or 'Mamba2'")


def architecture_of(raw: Mapping[str, Any]) -> str:
    archs = raw.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    if isinstance(archs, str):
        return archs
    raise ConfigError("config.json has no 'architectures' list; add the model class name, e.g. \"BambaForCausalLM\"")


class HFConfig(Mapping[str, Any]):
    """A read-only HF config with attribute access and readable errors for missing fields."""

    def __init__(self, architecture: str, values: Mapping[str, Any]):
        object.__setattr__(self, "_architecture", architecture)
        object.__setattr__(self, "_values", dict(values))

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __getattr__(self, key: str) -> Any:
        try:
            return self._values[key]
        except KeyError:
            raise ConfigError(f"{self._architecture}: config.json has no {key!r}") from None

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("HFConfig is read-only")

    @property
    def architecture(self) -> str:
        return self._architecture

    def first(self, *keys: str, default: Any = None) -> Any:
        """The value of the first key present and not null (current spelling first, then legacy)."""
        for key in keys:
            if self._values.get(key) is not None:
                return self._values[key]
        return default

    def positive_int(self, key: str) -> int:
        value = getattr(self, key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{self._architecture}: {key} must be a positive integer, got {value!r}")
        return value

    @property
    def dtype(self) -> str:
        name = self.first("dtype", "torch_dtype", default="float32")
        return canonical_dtype(name, "dtype in config.json") if name != "auto" else "float32"
