"""The Mamba-2 mixer over the shared pool: in_proj -> conv1d -> SSD scan | state update -> gated norm -> out_proj.

Decodes come first in the packed batch (one token each, state update by page id);
prefill chunks follow (varlen conv and chunked scan, starting from the cached state
when a prompt is resumed).

The options after `dt_limit` default to Bamba's mixer; Falcon-H1, Nemotron-H and Zamba2 set
them to reproduce their own HF mixers.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime import kernels
from runtime.context import get_forward_context
from runtime.kernels.common import NO_DT_LIMIT
from runtime.layers.norm import GatedRMSNorm


class Mamba2Mixer(nn.Module):
    """Implements runtime.cache.protocol.StateCacheLayer (conv state, then SSM state)."""

    def __init__(
        self,
        layer_idx: int,
        *,
        hidden_size: int,
        d_inner: int,
        num_heads: int,
        head_dim: int,
        n_groups: int,
        d_state: int,
        d_conv: int,
        conv_bias: bool,
        proj_bias: bool,
        eps: float,
        dt_limit: tuple[float, float],
        decode_dt_limit: tuple[float, float] | None = None,
        out_proj_bias: bool | None = None,
        in_proj_multipliers: torch.Tensor | None = None,
        norm: nn.Module | None = None,
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.d_inner, self.num_heads, self.head_dim = d_inner, num_heads, head_dim
        self.n_groups, self.d_state, self.d_conv = n_groups, d_state, d_conv
        self.conv_dim = d_inner + 2 * n_groups * d_state
        self.dt_limit = (float(dt_limit[0]), float(dt_limit[1]))
        # HF's chunked scan clamps dt to the limit but its decode step never does (nor does mamba_ssm's
        # selective_state_update), so decode follows HF with no limit unless a model asks for one.
        self.decode_dt_limit = NO_DT_LIMIT if decode_dt_limit is None else tuple(map(float, decode_dt_limit))
        self.in_proj = nn.Linear(hidden_size, d_inner + self.conv_dim + num_heads, bias=proj_bias)
        # Holds the depthwise weights under HF's name; the kernels apply them.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, d_conv, groups=self.conv_dim, bias=conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(num_heads))
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.D = nn.Parameter(torch.ones(num_heads))
        # norm(y, z) gates and normalises the scan output; any module with that signature fits.
        self.norm = GatedRMSNorm(d_inner, group_size=d_inner // n_groups, eps=eps) if norm is None else norm
        self.out_proj = nn.Linear(d_inner, hidden_size, bias=proj_bias if out_proj_bias is None else out_proj_bias)
        # Falcon-H1's muP vector: one multiplier per in_proj output channel, derived from the config.
        assert in_proj_multipliers is None or in_proj_multipliers.shape == (self.in_proj.out_features,)
        self.register_buffer("in_proj_multipliers", in_proj_multipliers, persistent=False)
        self.group = -1  # state group, set when the pool is bound
        self.conv_states: torch.Tensor | None = None  # (num_pages, d_conv - 1, conv_dim) view
        self.ssm_states: torch.Tensor | None = None  # (num_pages, num_heads, head_dim, d_state) view

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return (self.d_conv - 1, self.conv_dim), (self.num_heads, self.head_dim, self.d_state)

    def bind(self, group: int, conv_states: torch.Tensor, ssm_states: torch.Tensor) -> None:
        self.group, self.conv_states, self.ssm_states = group, conv_states, ssm_states

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (T, hidden_size) -> (T, hidden_size)."""
        projected = self.in_proj(hidden)
        if self.in_proj_multipliers is not None:
            projected = projected * self.in_proj_multipliers
        z, xbc, dt = projected.split([self.d_inner, self.conv_dim, self.num_heads], dim=-1)
        xbc = self._conv(xbc)
        x, B, C = xbc.split([self.d_inner, self.n_groups * self.d_state, self.n_groups * self.d_state], dim=-1)
        y = self._ssm(
            x.reshape(-1, self.num_heads, self.head_dim),
            dt,
            B.reshape(-1, self.n_groups, self.d_state),
            C.reshape(-1, self.n_groups, self.d_state),
        )
        return self.out_proj(self.norm(y.view(-1, self.d_inner), z))

    def _conv(self, xbc: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        nd, weight, bias = ctx.num_decodes, self.conv1d.weight.squeeze(1), self.conv1d.bias
        decoded = prefilled = None
        if nd:
            pages, waves = ctx.decode_pages(self.group)
            decoded = kernels.causal_conv1d_update(xbc[:nd], weight, bias, self.conv_states, pages, waves=waves)
        if ctx.num_prefill_tokens:
            prefilled = kernels.causal_conv1d_fn(
                xbc[nd:], weight, bias, self.conv_states, ctx.prefill_state_indices[self.group], ctx.mamba_prefill
            )
        # A step of one kind returns its kernel's output as is: a copy of a 2,048-token chunk's conv output
        # cost about 1 ms a layer (float32).
        if decoded is None or prefilled is None:
            return prefilled if decoded is None else decoded
        return torch.cat([decoded, prefilled])

    def _ssm(self, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        nd = ctx.num_decodes
        A = -torch.exp(self.A_log.float())
        y = torch.empty_like(x)
        if nd:
            pages, waves = ctx.decode_pages(self.group)
            kernels.selective_state_update(self.ssm_states, x[:nd], dt[:nd], A, B[:nd], C[:nd], self.D, self.dt_bias,
                                           self.decode_dt_limit, pages, y[:nd], waves=waves)
        split = ctx.generated_split
        if ctx.num_prefill_tokens and (split is None or self.decode_dt_limit == self.dt_limit):
            kernels.ssd_scan(
                x[nd:], dt[nd:], A, B[nd:], C[nd:], self.D, self.dt_bias, self.dt_limit, self.ssm_states,
                ctx.prefill_state_indices[self.group], ctx.mamba_prefill, y[nd:],
            )
        elif ctx.num_prefill_tokens:
            self._scan_generated_apart(x, dt, A, B, C, y, split)
        return y

    def _scan_generated_apart(self, x, dt, A, B, C, y, split) -> None:
        """Prompt chunks with the scan's dt limit, generated ones (runtime.context.GeneratedSplit) with decode's."""
        ctx = get_forward_context()
        indices = ctx.prefill_state_indices[self.group]
        start, mid, seqs = ctx.num_decodes, ctx.num_decodes + split.num_prompt_tokens, split.num_prompt_seqs
        if split.prompt is not None:
            kernels.ssd_scan(x[start:mid], dt[start:mid], A, B[start:mid], C[start:mid], self.D, self.dt_bias,
                             self.dt_limit, self.ssm_states, indices[:seqs], split.prompt, y[start:mid])
        kernels.ssd_scan(x[mid:], dt[mid:], A, B[mid:], C[mid:], self.D, self.dt_bias, self.decode_dt_limit,
                         self.ssm_states, indices[seqs:], split.generated, y[mid:])
