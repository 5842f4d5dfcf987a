"""Per-rank cache shapes shared by the model declarations (vLLM's formulas).

Mamba-2: conv `(k-1, (d_inner + 2*g'*n)/tp)`, SSM `(h/tp, p, n)`, where `g'` pads the
groups to the TP size when a single group is replicated across ranks.
Mamba-1: conv `(k-1, d_inner/tp)`, SSM `(d_inner/tp, n)`.
"""

from __future__ import annotations

from runtime.hf_config import ConfigError, HFConfig
from runtime.models.interface import AttentionShape
from runtime.options import spell


def divisors(value: int) -> str:
    return ", ".join(str(d) for d in range(1, value + 1) if value % d == 0)


def _require_divisible(model: str, field: str, value: int, tp: int) -> None:
    if value % tp:
        raise ConfigError(
            f"{model}: {field}={value} is not divisible by {spell('tensor_parallel_size', tp)}; "
            f"tensor-parallel sizes that divide it: {divisors(value)}"
        )


def padded_groups(model: str, n_groups: int, tp: int) -> int:
    if n_groups % tp == 0:
        return n_groups
    if n_groups != 1:
        raise ConfigError(
            f"{model}: n_groups={n_groups} is not divisible by {spell('tensor_parallel_size', tp)} "
            f"(only a single group can be replicated across ranks); tensor-parallel sizes that divide it: "
            f"{divisors(n_groups)}"
        )
    return tp  # one group, copied to every rank


def mamba2_state_shape(
    model: str, *, d_inner: int, n_heads: int, head_dim: int, n_groups: int, d_state: int, d_conv: int, tp: int
) -> tuple[tuple[int, int], tuple[int, int, int]]:
    if n_heads * head_dim != d_inner:
        raise ConfigError(
            f"{model}: Mamba heads ({n_heads}) x head dim ({head_dim}) = {n_heads * head_dim} "
            f"does not equal the Mamba inner size {d_inner}"
        )
    if n_heads % n_groups:
        raise ConfigError(f"{model}: {n_groups} Mamba groups do not divide {n_heads} heads")
    _require_divisible(model, "mamba heads", n_heads, tp)
    groups = padded_groups(model, n_groups, tp)
    conv_dim = d_inner + 2 * groups * d_state
    return (d_conv - 1, conv_dim // tp), (n_heads // tp, head_dim, d_state)


def mamba1_state_shape(
    model: str, *, d_inner: int, d_state: int, d_conv: int, tp: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    _require_divisible(model, "mamba intermediate size", d_inner, tp)
    return (d_conv - 1, d_inner // tp), (d_inner // tp, d_state)


def attention_shape(cfg: HFConfig, tp: int, head_size: int | None = None) -> AttentionShape:
    """KV heads per rank and head size from the usual keys; `head_size` overrides `head_dim`."""
    num_heads = cfg.positive_int("num_attention_heads")
    num_kv_heads = cfg.first("num_key_value_heads", default=num_heads)
    if head_size is None:
        head_size = cfg.first("head_dim", default=cfg.positive_int("hidden_size") // num_heads)
    return kv_shape(cfg.architecture, num_heads, num_kv_heads, head_size, tp)


def kv_shape(model: str, num_heads: int, num_kv_heads: int, head_size: int, tp: int) -> AttentionShape:
    """One rank's KV heads: divided over the ranks, or replicated when there are fewer heads than ranks."""
    _require_divisible(model, "num_attention_heads", num_heads, tp)
    if num_kv_heads >= tp:
        _require_divisible(model, "num_key_value_heads", num_kv_heads, tp)
    elif tp % num_kv_heads:
        raise ConfigError(
            f"{model}: num_key_value_heads={num_kv_heads} cannot be replicated over "
            f"{spell('tensor_parallel_size', tp)}; choose a size that is a multiple or divisor of {num_kv_heads}"
        )
    return AttentionShape(num_kv_heads=max(1, num_kv_heads // tp), head_size=head_size)
