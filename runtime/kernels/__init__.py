"""The ops the engine calls, bound once at startup to one backend.

Every op has a torch reference (`<op>_ref`: the CPU production path, and the oracle of the tests)
and a Triton launcher (`<op>_triton`) with the same signature, in the same file. The names below
start bound to the references; the model runner calls `bind(resolve_backend(...))` once, when it
starts, so no kernel call checks a device. `resolve_backend` picks Triton for a CUDA device and
the references otherwise; TANDEM_KERNEL_BACKEND=torch|triton forces either when the engine's
`kernel_backend` knob is "auto". Triton on a CPU means the interpreter, for tests: it needs
TRITON_INTERPRET=1 before triton is first imported.

On a CPU with the torch backend, the ops in NATIVE run on the native CPU kernels (the `tandem::` torch
operators of cpu_native.py) where their library builds (C and C++ compilers are present;
TANDEM_CPU_NATIVE=0 keeps the references).

The binding is per process: an engine built later with another backend rebinds the ops for the
engines built before it (a warning says so).
"""

from __future__ import annotations

import logging
import os

import torch

from runtime.config import KERNEL_BACKENDS
from runtime.hf_config import ConfigError
from runtime.kernels import cpu_compile, cpu_native
from runtime.kernels._triton_absent import INSTALL_HINT
from runtime.kernels._triton_utils import TRITON_INSTALLED, interpreting, kernels_are_interpreted
from runtime.kernels.causal_conv1d import (
    causal_conv1d_fn_ref,
    causal_conv1d_fn_triton,
    causal_conv1d_update_ref,
    causal_conv1d_update_triton,
)
from runtime.kernels.gated_delta_rule import (
    gated_delta_rule_fn_ref,
    gated_delta_rule_fn_triton,
    gated_delta_rule_update_ref,
    gated_delta_rule_update_triton,
)
from runtime.kernels.kv_cache import store_kv_ref, store_kv_triton
from runtime.kernels.lora import lora_expand_ref, lora_expand_triton, lora_shrink_ref, lora_shrink_triton
from runtime.kernels.metadata import (
    AttentionMetadata,
    MambaPrefillMetadata,
    build_attention_metadata,
    build_mamba_prefill_metadata,
)
from runtime.kernels.paged_attention import paged_attention_ref, paged_attention_triton
from runtime.kernels.rms_norm_gated import rms_norm_gated_ref, rms_norm_gated_triton
from runtime.kernels.rotary import rotary_ref
from runtime.kernels.selective_scan import (
    selective_scan_ref,
    selective_scan_triton,
    selective_state_update_mamba1_ref,
    selective_state_update_mamba1_triton,
)
from runtime.kernels.short_conv import (
    short_conv_fn_ref,
    short_conv_fn_triton,
    short_conv_update_ref,
    short_conv_update_triton,
)
from runtime.kernels.silu_and_mul import silu_and_mul_ref, silu_and_mul_triton
from runtime.kernels.ssd_scan import ssd_scan_ref, ssd_scan_triton
from runtime.kernels.ssm_state_update import selective_state_update_ref, selective_state_update_triton

logger = logging.getLogger("tandem")

ENV_VAR = "TANDEM_KERNEL_BACKEND"

# op name: (torch reference, Triton launcher)
IMPLEMENTATIONS = {
    "store_kv": (store_kv_ref, store_kv_triton),
    "paged_attention": (paged_attention_ref, paged_attention_triton),
    "causal_conv1d_fn": (causal_conv1d_fn_ref, causal_conv1d_fn_triton),
    "causal_conv1d_update": (causal_conv1d_update_ref, causal_conv1d_update_triton),
    "ssd_scan": (ssd_scan_ref, ssd_scan_triton),
    "selective_state_update": (selective_state_update_ref, selective_state_update_triton),
    "rms_norm_gated": (rms_norm_gated_ref, rms_norm_gated_triton),
    "silu_and_mul": (silu_and_mul_ref, silu_and_mul_triton),
    "rotary": (rotary_ref, rotary_ref),  # elementwise: torch's ops are the GPU's kernels
    "selective_scan": (selective_scan_ref, selective_scan_triton),
    "selective_state_update_mamba1": (selective_state_update_mamba1_ref, selective_state_update_mamba1_triton),
    "short_conv_fn": (short_conv_fn_ref, short_conv_fn_triton),
    "short_conv_update": (short_conv_update_ref, short_conv_update_triton),
    "gated_delta_rule_fn": (gated_delta_rule_fn_ref, gated_delta_rule_fn_triton),
    "gated_delta_rule_update": (gated_delta_rule_update_ref, gated_delta_rule_update_triton),
    "lora_shrink": (lora_shrink_ref, lora_shrink_triton),
    "lora_expand": (lora_expand_ref, lora_expand_triton),
}

# CPU fast paths, with the references' signatures, used in their place where the library builds.
NATIVE = {
    "selective_state_update": cpu_native.selective_state_update_native,
    "causal_conv1d_update": cpu_native.causal_conv1d_update_native,
    "ssd_scan": cpu_native.ssd_scan_native,
    "causal_conv1d_fn": cpu_native.causal_conv1d_fn_native,
    "rms_norm_gated": cpu_native.rms_norm_gated_native,
    "silu_and_mul": cpu_native.silu_and_mul_native,
    "rotary": cpu_native.rotary_native,
    "paged_attention": cpu_native.paged_attention_native,
    "store_kv": cpu_native.store_kv_native,
    "lora_shrink": cpu_native.lora_shrink_native,
    "lora_expand": cpu_native.lora_expand_native,
}

backend = "torch"  # the references, until an engine binds
_bound = False
_last_bind: tuple[str, torch.device, bool] | None = None  # bind()'s arguments, for restore()
store_kv = store_kv_ref
paged_attention = paged_attention_ref
causal_conv1d_fn = causal_conv1d_fn_ref
causal_conv1d_update = causal_conv1d_update_ref
ssd_scan = ssd_scan_ref
selective_state_update = selective_state_update_ref
rms_norm_gated = rms_norm_gated_ref
silu_and_mul = silu_and_mul_ref
rotary = rotary_ref
selective_scan = selective_scan_ref
selective_state_update_mamba1 = selective_state_update_mamba1_ref
short_conv_fn = short_conv_fn_ref
short_conv_update = short_conv_update_ref
gated_delta_rule_fn = gated_delta_rule_fn_ref
gated_delta_rule_update = gated_delta_rule_update_ref
lora_shrink = lora_shrink_ref
lora_expand = lora_expand_ref


def resolve_backend(requested: str, device: torch.device) -> str:
    """"torch" or "triton" for an engine on `device`: `requested` unless "auto", then the environment
    variable unless unset or "auto", then Triton for CUDA and the references for anything else."""
    choice, source = requested, "kernel_backend"
    if choice == "auto":
        choice, source = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto", ENV_VAR
    if choice not in KERNEL_BACKENDS:
        raise ConfigError(f"{source}={choice!r} is not a kernel backend; choose one of {', '.join(KERNEL_BACKENDS)}")
    if choice == "auto":
        choice = "triton" if device.type == "cuda" else "torch"
    if choice == "triton" and not TRITON_INSTALLED:
        raise ConfigError(f"the triton kernel backend on a {device.type} device: {INSTALL_HINT}")
    if choice == "triton" and device.type != "cuda" and not (interpreting() and kernels_are_interpreted()):
        raise ConfigError(
            f"the triton kernel backend on a {device.type} device needs the Triton interpreter: set "
            "TRITON_INTERPRET=1 before triton is first imported (it is for tests; use a CUDA device otherwise)"
        )
    return choice


def bind(name: str, device: torch.device, compile_cpu: bool = True) -> str:
    """Point every op at its `name` ("torch" or "triton") implementation; returns name.

    With `compile_cpu`, the references' fused cores run through torch.compile on a CPU (see cpu_compile.py).
    """
    global backend, _bound
    assert name in ("torch", "triton"), name
    compiling = cpu_compile.enable(compile_cpu and name == "torch" and device.type == "cpu")
    if _bound and name != backend:
        logger.warning("kernel backend: %s (was %s); engines built earlier in this process now use it too",
                       name, backend)
    which = 0 if name == "torch" else 1
    globals().update({op: implementations[which] for op, implementations in IMPLEMENTATIONS.items()})
    if name == "torch" and device.type == "cpu" and cpu_native.available():
        globals().update(NATIVE)
    elif compiling:  # the references' fused cores will run: probe torch.compile now, outside any step
        cpu_compile.works()
    backend, _bound = name, True
    global _last_bind
    _last_bind = (name, device, compile_cpu)
    return name


def snapshot() -> tuple[str, torch.device, bool] | None:
    """The current binding, for `restore` if an engine fails while starting."""
    return _last_bind


def restore(snap: tuple[str, torch.device, bool] | None) -> None:
    """Undo the binding of an engine that failed to start, so the engines built before it keep theirs."""
    global backend, _bound, _last_bind
    if snap is None:
        globals().update({op: implementations[0] for op, implementations in IMPLEMENTATIONS.items()})
        cpu_compile.enable(False)
        backend, _bound, _last_bind = "torch", False, None
    elif snap != _last_bind:
        bind(*snap)


__all__ = [
    "AttentionMetadata",
    "MambaPrefillMetadata",
    "build_attention_metadata",
    "build_mamba_prefill_metadata",
    "resolve_backend",
    "bind",
    *IMPLEMENTATIONS,
]
