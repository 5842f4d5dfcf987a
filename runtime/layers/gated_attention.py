"""Qwen3-Next's gated full attention: q_proj gives each head's query and an output gate, q and k get
zero-centred RMS norms, a part of each head rotates, the paged attention core attends, and the output
is scaled by sigmoid(gate) before o_proj. Also used by Qwen3.5."""

from __future__ import annotations

import torch
from torch import nn

from runtime.layers.attention import PagedAttention
from runtime.layers.rotary import apply_rotary


class ZeroCenteredRMSNorm(nn.Module):
    """HF's Qwen3NextRMSNorm: normalise in float32 and scale by (1 + weight) in float32, then cast back
    (the weight is stored centred on zero)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GatedAttention(nn.Module):
    """Partial rotary comes from cos and sin: their width is the rotary part of a head."""

    def __init__(self, layer_idx: int, *, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float, bias: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, 2 * num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(head_dim, eps)
        self.k_norm = ZeroCenteredRMSNorm(head_dim, eps)
        self.attn = PagedAttention(layer_idx, num_heads, num_kv_heads, head_dim, head_dim**-0.5)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """hidden: (T, hidden_size) -> (T, hidden_size)."""
        num_tokens = hidden.shape[0]
        # Each head's 2 * head_dim outputs are its query, then its gate.
        q, gate = self.q_proj(hidden).view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim))
        v = self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attn(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
        return self.o_proj(out * torch.sigmoid(gate.reshape(num_tokens, -1)))
