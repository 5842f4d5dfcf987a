from __future__ import annotations

from dataclasses import dataclass

from runtime.hf_config import ConfigError, HFConfig
from runtime.models.common import ON_ENGINE, capabilities
from runtime.models.dims import RopeDims, read_rope
from runtime.models.granitemoehybrid.declaration import layers_from_types
from runtime.models.interface import AttentionShape, LayerKind, ModelDeclaration, partial, supported
from runtime.models.shapes import attention_shape, divisors

LAYER_TYPES = {"linear_attention": LayerKind.GATED_DELTANET, "full_attention": LayerKind.ATTENTION}
# HF's chunk length for the gated delta rule (torch_chunk_gated_delta_rule and FLA's kernels); the
# prefill metadata splits prompts into chunks of it.
GDN_CHUNK_SIZE = 64


@dataclass(frozen=True)
class Qwen3NextDims:
    """Everything the Qwen3-Next torch module (and Qwen3.5's) is built from, read once from config.json."""

    vocab_size: int
    hidden_size: int
    layers: tuple[LayerKind, ...]
    hidden_act: str
    rms_norm_eps: float
    tie_word_embeddings: bool
    # Gated full attention.
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_bias: bool
    rope: RopeDims
    # Gated DeltaNet.
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # Feed-forward: a dense MLP of intermediate_size, or sparse experts with a gated shared expert.
    intermediate_size: int
    moe_layers: tuple[bool, ...] = ()  # per layer: experts (True) or the dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True

# What the engine does for every Gated DeltaNet model it runs, tensor parallelism included:
# runtime/distributed/sharding.py splits their layers and tests/distributed/test_tp_parity.py proves it.
GATED_DELTANET_TP_CAPABILITIES = capabilities(ON_ENGINE, chunked_prefill=supported(), prefix_caching=supported(),
                                              tensor_parallel=supported(),
                                              pipeline_parallel=supported(), lora=supported())
# Qwen3-Next and Qwen3.5 checkpoints carry a multi-token-prediction head (`mtp.*`): the "mtp" method.
QWEN_MTP_CAPABILITIES = capabilities(ON_ENGINE, chunked_prefill=supported(), prefix_caching=supported(),
                                     tensor_parallel=supported(), pipeline_parallel=supported(), lora=supported(),
                                     speculative_decoding=partial(
                                         "n-gram (prompt lookup), draft model and the checkpoint's MTP head (`mtp.*`) "
                                         "drafts, verified exactly for every layer kind."))


def moe_layers(cfg: HFConfig, num_layers: int) -> tuple[bool, ...]:
    """Qwen3NextDecoderLayer's rule: experts where the layer is not MLP-only and (i + 1) % step == 0."""
    num_experts = cfg.first("num_experts", default=0)
    if not num_experts:
        return (False,) * num_layers
    step, dense = cfg.positive_int("decoder_sparse_step"), set(cfg.first("mlp_only_layers", default=()) or ())
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


class Qwen3NextForCausalLM(ModelDeclaration):
    """Gated DeltaNet linear-attention layers with gated full attention every few layers."""

    architecture = "Qwen3NextForCausalLM"
    model_name = "Qwen3-Next"
    example_models = ("Qwen/Qwen3-Next-80B-A3B-Instruct", "Qwen/Qwen3-Next-80B-A3B-Thinking")
    layer_kinds = frozenset({LayerKind.ATTENTION, LayerKind.GATED_DELTANET})
    state_name = "gated-deltanet state"
    capabilities = QWEN_MTP_CAPABILITIES
    implementation = "runtime.models.qwen3_next.model:Qwen3NextForCausalLM"
    quantizations = ("fp8", "gguf")
    # The recurrent state follows the model dtype unless asked otherwise, as in vLLM (HF keeps it in float32:
    # --mamba-ssm-dtype float32 does the same).
    defaults = {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts_per_tok": 10,
        "num_experts": 512,
        "norm_topk_prob": True,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "full_attention_interval": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
    }

    @classmethod
    def layout(cls, cfg: HFConfig) -> tuple[LayerKind, ...]:
        if cfg.first("layer_types") is not None:
            return layers_from_types(cfg, "layer_types", LAYER_TYPES)
        interval = cfg.positive_int("full_attention_interval")
        return tuple(
            LayerKind.ATTENTION if (i + 1) % interval == 0 else LayerKind.GATED_DELTANET
            for i in range(cfg.positive_int("num_hidden_layers"))
        )

    @classmethod
    def attention_shape(cls, cfg: HFConfig, tp: int) -> AttentionShape:
        return attention_shape(cfg, tp, head_size=cfg.positive_int("head_dim"))

    @classmethod
    def mamba_state_shape(cls, cfg: HFConfig, tp: int) -> tuple[tuple[int, ...], ...]:
        key_heads, value_heads = cfg.positive_int("linear_num_key_heads"), cfg.positive_int("linear_num_value_heads")
        key_dim, value_dim = cfg.positive_int("linear_key_head_dim"), cfg.positive_int("linear_value_head_dim")
        for field, value in (("linear_num_key_heads", key_heads), ("linear_num_value_heads", value_heads)):
            if value % tp:
                raise ConfigError(f"{cls.architecture}: {field}={value} is not divisible by tensor_parallel_size={tp}; "
                                  f"tensor-parallel sizes that divide it: {divisors(value)}")
        conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
        conv = (cfg.positive_int("linear_conv_kernel_dim") - 1, conv_dim // tp)
        return conv, (value_heads // tp, key_dim, value_dim)

    @classmethod
    def mamba_chunk_size(cls, cfg: HFConfig) -> int:
        return GDN_CHUNK_SIZE

    @classmethod
    def dims(cls, cfg: HFConfig) -> Qwen3NextDims:
        layers = cls.layout(cfg)
        attention = cls.attention_shape(cfg, 1)
        key_heads, value_heads = cfg.positive_int("linear_num_key_heads"), cfg.positive_int("linear_num_value_heads")
        if value_heads % key_heads:
            raise ConfigError(f"{cls.architecture}: linear_num_value_heads={value_heads} is not a multiple of "
                              f"linear_num_key_heads={key_heads}")
        moe = moe_layers(cfg, len(layers))
        experts = {}
        if any(moe):
            experts = dict(
                num_experts=cfg.positive_int("num_experts"),
                num_experts_per_tok=cfg.positive_int("num_experts_per_tok"),
                moe_intermediate_size=cfg.positive_int("moe_intermediate_size"),
                shared_expert_intermediate_size=int(cfg.first("shared_expert_intermediate_size", default=0)),
                norm_topk_prob=bool(cfg.norm_topk_prob),
            )
            if experts["num_experts_per_tok"] > experts["num_experts"]:
                raise ConfigError(f"{cls.architecture}: num_experts_per_tok={experts['num_experts_per_tok']} "
                                  f"exceeds num_experts={experts['num_experts']}")
        return Qwen3NextDims(
            vocab_size=cfg.positive_int("vocab_size"),
            hidden_size=cfg.positive_int("hidden_size"),
            layers=layers,
            hidden_act=str(cfg.hidden_act),
            rms_norm_eps=float(cfg.rms_norm_eps),
            tie_word_embeddings=bool(cfg.tie_word_embeddings),
            num_heads=cfg.positive_int("num_attention_heads"),
            num_kv_heads=attention.num_kv_heads,
            head_dim=attention.head_size,
            attention_bias=bool(cfg.attention_bias),
            rope=read_rope(cfg, attention.head_size),
            linear_num_key_heads=key_heads,
            linear_num_value_heads=value_heads,
            linear_key_head_dim=cfg.positive_int("linear_key_head_dim"),
            linear_value_head_dim=cfg.positive_int("linear_value_head_dim"),
            linear_conv_kernel_dim=cfg.positive_int("linear_conv_kernel_dim"),
            # Unused (and absent from Qwen3.5-MoE's config.json) when every layer has experts.
            intermediate_size=int(cfg.first("intermediate_size", default=0)) if all(moe)
            else cfg.positive_int("intermediate_size"),
            moe_layers=moe,
            **experts,
        )
