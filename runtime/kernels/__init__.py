"""The ops the engine calls, bound once at import.

Each op is its torch reference for now: these references are the CPU production path and the
oracles for the Triton kernels. A later issue binds Triton launchers here for CUDA tensors,
with the same signatures.
"""

from runtime.kernels.causal_conv1d import causal_conv1d_fn_ref, causal_conv1d_update_ref
from runtime.kernels.kv_cache import store_kv_ref
from runtime.kernels.metadata import (
    AttentionMetadata,
    MambaPrefillMetadata,
    build_attention_metadata,
    build_mamba_prefill_metadata,
)
from runtime.kernels.paged_attention import paged_attention_ref
from runtime.kernels.rms_norm_gated import rms_norm_gated_ref
from runtime.kernels.selective_scan import selective_scan_ref, selective_state_update_mamba1_ref
from runtime.kernels.ssd_scan import ssd_scan_ref
from runtime.kernels.ssm_state_update import selective_state_update_ref

store_kv = store_kv_ref
paged_attention = paged_attention_ref
causal_conv1d_fn = causal_conv1d_fn_ref
causal_conv1d_update = causal_conv1d_update_ref
ssd_scan = ssd_scan_ref
selective_state_update = selective_state_update_ref
rms_norm_gated = rms_norm_gated_ref
selective_scan = selective_scan_ref
selective_state_update_mamba1 = selective_state_update_mamba1_ref

__all__ = [
    "AttentionMetadata",
    "MambaPrefillMetadata",
    "build_attention_metadata",
    "build_mamba_prefill_metadata",
    "store_kv",
    "paged_attention",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "ssd_scan",
    "selective_state_update",
    "rms_norm_gated",
    "selective_scan",
    "selective_state_update_mamba1",
]
