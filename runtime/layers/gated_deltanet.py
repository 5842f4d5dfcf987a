"""Gated DeltaNet over the shared pool: projections -> causal conv (silu) on q, k, v -> gated delta rule ->
gated RMS norm -> out_proj (Qwen3-Next, Qwen3.5).

Decodes come first in the packed batch (one token each, conv and recurrent state updated by page id);
prefill chunks follow (varlen conv and delta rule, starting from the cached states when a prompt is
resumed). Its state is (conv, recurrent): the conv's last W-1 inputs (W-1, 2*Hk*Dk + Hv*Dv) and the
delta rule's (Hv, Dk, Dv).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime import kernels
from runtime.context import get_forward_context


class HeadRMSNormGated(nn.Module):
    """HF's Qwen3NextRMSNormGated: normalise each head in float32, scale in the input dtype, then gate by
    silu(z) in float32 (norm before gate)."""

    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * xf.to(dtype)) * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's projection layout (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a); Qwen3-Next's fused one is
    the subclass below. Implements runtime.cache.protocol.StateCacheLayer (conv state, then recurrent state)."""

    beta_scale = 1.0  # OLMo-Hybrid's 2 lets the delta rule's eigenvalues go negative

    def __init__(self, layer_idx: int, *, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, conv_width: int, eps: float):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim, self.conv_width = head_k_dim, head_v_dim, conv_width
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self._projections(hidden_size)
        self._conv()
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self._output(hidden_size, eps)
        self.group = -1  # state group, set when the pool is bound
        self.conv_states: torch.Tensor | None = None  # (num_pages, conv_width - 1, conv_dim) view
        self.recurrent_states: torch.Tensor | None = None  # (num_pages, num_v_heads, head_k_dim, head_v_dim) view

    def _projections(self, hidden_size: int) -> None:
        self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, self.num_v_heads, bias=False)

    def _conv(self) -> None:
        # Holds the depthwise weights under HF's name (no bias); the kernels apply them.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_width, groups=self.conv_dim, bias=False)

    def _output(self, hidden_size: int, eps: float) -> None:
        self.norm = HeadRMSNormGated(self.head_v_dim, eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """hidden (T, hidden) -> qkv (T, conv_dim) in the conv's channel order [q | k | v], z (T, value_dim),
        b and a (T, Hv)."""
        return self.in_proj_qkv(hidden), self.in_proj_z(hidden), self.in_proj_b(hidden), self.in_proj_a(hidden)

    def conv_weight(self) -> torch.Tensor:
        """(conv_dim, W): the depthwise conv's taps per channel."""
        return self.conv1d.weight.squeeze(1)

    def output(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The gated per-head norm and the output projection: y, z (T, value_dim) -> (T, hidden_size)."""
        y = self.norm(y.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(y.view(z.shape[0], self.value_dim))

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return (self.conv_width - 1, self.conv_dim), (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def bind(self, group: int, conv_states: torch.Tensor, recurrent_states: torch.Tensor) -> None:
        self.group, self.conv_states, self.recurrent_states = group, conv_states, recurrent_states

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (T, hidden_size) -> (T, hidden_size)."""
        qkv, z, b, a = self.project(hidden)
        q, k, v = self._causal_conv(qkv).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        num_tokens = hidden.shape[0]
        y = self._delta_rule(q.reshape(num_tokens, self.num_k_heads, self.head_k_dim),
                             k.reshape(num_tokens, self.num_k_heads, self.head_k_dim),
                             v.reshape(num_tokens, self.num_v_heads, self.head_v_dim), a, b)
        return self.output(y.view(num_tokens, self.value_dim), z)

    def _causal_conv(self, qkv: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        nd, weight = ctx.num_decodes, self.conv_weight()
        out = torch.empty_like(qkv)
        if nd:
            pages, waves = ctx.decode_pages(self.group)
            out[:nd] = kernels.causal_conv1d_update(qkv[:nd], weight, None, self.conv_states, pages, waves=waves)
        if ctx.num_prefill_tokens:
            out[nd:] = kernels.causal_conv1d_fn(qkv[nd:], weight, None, self.conv_states,
                                                ctx.prefill_state_indices[self.group], ctx.mamba_prefill)
        return out

    def _delta_rule(self, q, k, v, a, b) -> torch.Tensor:
        ctx = get_forward_context()
        nd = ctx.num_decodes
        y = torch.empty_like(v)
        if nd:
            pages, waves = ctx.decode_pages(self.group)
            y[:nd] = kernels.gated_delta_rule_update(q[:nd], k[:nd], v[:nd], a[:nd], b[:nd], self.A_log, self.dt_bias,
                                                     self.recurrent_states, pages, self.beta_scale, waves=waves)
        if ctx.num_prefill_tokens:
            y[nd:] = kernels.gated_delta_rule_fn(
                q[nd:], k[nd:], v[nd:], a[nd:], b[nd:], self.A_log, self.dt_bias, self.recurrent_states,
                ctx.prefill_state_indices[self.group], ctx.mamba_prefill, self.beta_scale,
            )
        return y


class Qwen3NextGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's fused projections: in_proj_qkvz and in_proj_ba, grouped per key head
    ([q, k, v..., z...] and [b..., a...] for the value heads of each key head)."""

    def _projections(self, hidden_size: int) -> None:
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * self.num_v_heads, bias=False)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        num_tokens, per_k = hidden.shape[0], self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz(hidden).view(num_tokens, self.num_k_heads, -1)
        q, k, v, z = qkvz.split([self.head_k_dim, self.head_k_dim, per_k * self.head_v_dim,
                                 per_k * self.head_v_dim], dim=-1)
        b, a = self.in_proj_ba(hidden).view(num_tokens, self.num_k_heads, 2 * per_k).split([per_k, per_k], dim=-1)
        qkv = torch.cat([q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v.reshape(num_tokens, -1)], dim=-1)
        return qkv, z.reshape(num_tokens, -1), b.reshape(num_tokens, -1), a.reshape(num_tokens, -1)


class OlmoHybridGatedDeltaNet(GatedDeltaNet):
    """OLMo-Hybrid's layout: separate q/k/v/a/b projections and an output gate g_proj, one depthwise conv per
    part (q_conv1d, k_conv1d, v_conv1d: the checkpoint's names), o_norm with eps 1e-5 (FLA's default, as HF
    notes) and o_proj; beta doubled, so eigenvalues of the state update may be negative."""

    beta_scale = 2.0

    def _projections(self, hidden_size: int) -> None:
        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.a_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)

    def _conv(self) -> None:
        for name, dim in (("q_conv1d", self.key_dim), ("k_conv1d", self.key_dim), ("v_conv1d", self.value_dim)):
            setattr(self, name, nn.Conv1d(dim, dim, self.conv_width, groups=dim, bias=False))

    def _output(self, hidden_size: int, eps: float) -> None:
        self.o_norm = HeadRMSNormGated(self.head_v_dim, 1e-5)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        qkv = torch.cat([self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)], dim=-1)
        return qkv, self.g_proj(hidden), self.b_proj(hidden), self.a_proj(hidden)

    def conv_weight(self) -> torch.Tensor:
        # HF concatenates the three when it loads them, and so do we, per step (they are W columns each).
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).squeeze(1)

    def output(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = self.o_norm(y.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.o_proj(y.view(z.shape[0], self.value_dim))
