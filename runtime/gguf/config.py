"""A GGUF file as a model: finding it, reading it with gguf's GGUFReader, and its metadata as an HF config.

llama.cpp's convert_hf_to_gguf.py writes an architecture's hyperparameters under `{arch}.*` keys; each mapped
architecture turns them back into the config.json transformers writes for the same model, so that the usual
declaration reads it. Layer types of hybrids come from the tensors each block holds (a block with `ssm_in` is a
Mamba layer), which is what llama.cpp itself goes by.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from runtime.hf_config import ConfigError

SUFFIX = ".gguf"


def gguf_path(model: str | Path) -> Path | None:
    """The GGUF file `model` names (the file, or the one .gguf of a directory without config.json), else None."""
    path = Path(model)
    if path.is_file() and path.suffix == SUFFIX:
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob(f"*{SUFFIX}"))
    if len(files) > 1:
        raise ConfigError(f"{path} holds {len(files)} GGUF files ({', '.join(f.name for f in files[:4])}); "
                          "pass the path of the one to run")
    return files[0] if files else None


@lru_cache(maxsize=4)
def reader(path: Path) -> Any:
    from gguf import GGUFReader
    try:
        return GGUFReader(path)
    except Exception as err:  # gguf raises ValueError, IndexError or numpy's errors on a damaged file
        raise ConfigError(f"{path} is not a readable GGUF file ({type(err).__name__}: {err}); "
                          "it may be truncated: download it again") from None


def field(path: Path, key: str, default: Any = None) -> Any:
    item = reader(path).fields.get(key)
    return default if item is None else item.contents()


def required(path: Path, key: str) -> Any:
    value = field(path, key)
    if value is None:
        raise ConfigError(f"{path.name}: the GGUF metadata lacks {key!r}, which this architecture needs")
    return value


def tensor_names(path: Path) -> set[str]:
    return {t.name for t in reader(path).tensors}


def tensor_shape(path: Path, name: str) -> tuple[int, ...]:
    """A tensor's shape in torch's order (GGUF lists dimensions innermost first)."""
    for t in reader(path).tensors:
        if t.name == name:
            return tuple(int(n) for n in reversed(t.shape))
    raise ConfigError(f"{path.name}: no tensor {name!r}, which this architecture needs")


def _dtype(path: Path) -> str:
    """The model dtype of a float file (BF16 and F16 run in their type); quantized files compute in float32."""
    from gguf import LlamaFileType
    file_type = field(path, "general.file_type")
    return {LlamaFileType.MOSTLY_BF16: "bfloat16", LlamaFileType.MOSTLY_F16: "float16"}.get(file_type, "float32")


def common_config(path: Path, arch: str) -> dict[str, Any]:
    """The config keys every architecture reads the same way (sizes, norms epsilon, RoPE base, special tokens)."""
    get = lambda key, default=None: field(path, f"{arch}.{key}", default)  # noqa: E731
    tokens = field(path, "tokenizer.ggml.tokens") or []
    config = {
        "hidden_size": required(path, f"{arch}.embedding_length"),
        "num_hidden_layers": required(path, f"{arch}.block_count"),
        "vocab_size": get("vocab_size") or tensor_shape(path, "token_embd.weight")[0] or len(tokens),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "tie_word_embeddings": "output.weight" not in tensor_names(path),
        "torch_dtype": _dtype(path),
        "bos_token_id": field(path, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(path, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": field(path, "tokenizer.ggml.padding_token_id"),
    }
    if get("context_length") is not None:
        config["max_position_embeddings"] = get("context_length")
    if get("rope.freq_base") is not None:
        config["rope_theta"] = get("rope.freq_base")
    return config


def _llama(path: Path) -> dict[str, Any]:
    if "rope_freqs.weight" in tensor_names(path):
        raise ConfigError(f"{path.name}: rope_freqs.weight (Llama 3's scaled RoPE) is not supported for GGUF yet; "
                          "run the original checkpoint's directory instead")
    heads = required(path, "llama.attention.head_count")
    config = {
        **common_config(path, "llama"),
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "intermediate_size": required(path, "llama.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": field(path, "llama.attention.head_count_kv", heads),
    }
    if field(path, "llama.attention.key_length") is not None:
        config["head_dim"] = field(path, "llama.attention.key_length")
    return config


def _granitehybrid(path: Path) -> dict[str, Any]:
    arch, names = "granitehybrid", tensor_names(path)
    get = lambda key, default=None: field(path, f"{arch}.{key}", default)  # noqa: E731
    layers = required(path, f"{arch}.block_count")
    kinds = ["mamba" if f"blk.{i}.ssm_in.weight" in names else "attention" for i in range(layers)]
    hidden, heads = required(path, f"{arch}.embedding_length"), required(path, f"{arch}.attention.head_count")
    head_dim = hidden // heads
    attention = [i for i, kind in enumerate(kinds) if kind == "attention"]
    # head_count_kv is per layer (0 on Mamba layers); the key projection's rows say it where it is not written.
    kv_heads = tensor_shape(path, f"blk.{attention[0]}.attn_k.weight")[0] // head_dim if attention else heads
    ssm_heads, inner = required(path, f"{arch}.ssm.time_step_rank"), required(path, f"{arch}.ssm.inner_size")
    mamba = next((i for i, kind in enumerate(kinds) if kind == "mamba"), None)
    if get("rope.scaling.finetuned", False) and get("embedding_scale") is None:
        return _bamba(path, kinds, heads, kv_heads, ssm_heads, inner, mamba)
    experts = get("expert_count", 0) or 0
    shared = get("expert_shared_feed_forward_length") or (0 if experts else get("feed_forward_length"))
    return {
        **common_config(path, arch),
        "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
        "layer_types": kinds,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "intermediate_size": get("expert_feed_forward_length") or get("feed_forward_length"),
        "shared_intermediate_size": shared,
        "num_local_experts": experts, "num_experts_per_tok": get("expert_used_count", 0) or 0,
        "mamba_n_heads": ssm_heads, "mamba_d_head": inner // ssm_heads, "mamba_expand": inner // hidden,
        "mamba_d_state": required(path, f"{arch}.ssm.state_size"),
        "mamba_n_groups": required(path, f"{arch}.ssm.group_count"),
        "mamba_d_conv": required(path, f"{arch}.ssm.conv_kernel"),
        "mamba_conv_bias": mamba is not None and f"blk.{mamba}.ssm_conv1d.bias" in names,
        "mamba_proj_bias": False,
        # The converter writes rope.scaling.finetuned = whether the model uses RoPE (Bamba) or not (Granite 4.0).
        "position_embedding_type": "rope" if get("rope.scaling.finetuned", False) else "nope",
        "embedding_multiplier": get("embedding_scale", 1.0),
        # Without attention.scale (Bamba's conversion) the scale is the usual 1 / sqrt(head_dim).
        "attention_multiplier": get("attention.scale", head_dim ** -0.5),
        "residual_multiplier": get("residual_scale", 1.0),
        "logits_scaling": get("logit_scale", 1.0),
        "hidden_act": "silu",
    }


def _bamba(path: Path, kinds: list[str], heads: int, kv_heads: int, ssm_heads: int, inner: int,
           mamba: int | None) -> dict[str, Any]:
    """Bamba converts to granitehybrid too, with RoPE and none of Granite's scales: its config is Bamba's. Bamba
    rotates half of each head (transformers hard-codes it); the converter writes rope.dimension_count from
    attn_rotary_emb, or the whole head where config.json lacks it, so that key is not read."""
    arch, names = "granitehybrid", tensor_names(path)
    hidden = required(path, f"{arch}.embedding_length")
    return {
        **common_config(path, arch),
        "architectures": ["BambaForCausalLM"], "model_type": "bamba",
        "attn_layer_indices": [i for i, kind in enumerate(kinds) if kind == "attention"],
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "intermediate_size": required(path, f"{arch}.feed_forward_length"),
        "mamba_n_heads": ssm_heads, "mamba_d_head": inner // ssm_heads, "mamba_expand": inner // hidden,
        "mamba_d_state": required(path, f"{arch}.ssm.state_size"),
        "mamba_n_groups": required(path, f"{arch}.ssm.group_count"),
        "mamba_d_conv": required(path, f"{arch}.ssm.conv_kernel"),
        "mamba_conv_bias": mamba is not None and f"blk.{mamba}.ssm_conv1d.bias" in names,
        "mamba_proj_bias": False, "hidden_act": "silu",
    }


def architectures() -> dict[str, Callable[[Path], dict[str, Any]]]:
    from runtime.gguf.families import CONFIGS  # which builds on this module's readers
    return {"llama": _llama, "granitehybrid": _granitehybrid, **CONFIGS}


def architecture(path: Path) -> str:
    arch = field(path, "general.architecture")
    if arch not in architectures():
        raise ConfigError(f"{path.name}: GGUF architecture {arch!r} is not supported; "
                          f"Tandem loads GGUF files of {', '.join(architectures())}")
    return arch


def raw_config(path: Path) -> dict[str, Any]:
    """The HF config.json (as a dict) of the model in a GGUF file."""
    return architectures()[architecture(path)](path)
