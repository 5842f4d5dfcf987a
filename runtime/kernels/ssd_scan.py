"""Mamba-2 prefill: the chunked SSD scan over packed sequences with per-sequence initial states.

The chunked (state-space dual) form of the Mamba-2 paper, batched over all logical chunks of the
batch (chunks never span two sequences; see metadata.py). Within chunk c, local i, j, and
Acs = cumsum(A * dt') inside the chunk:

    Y_diag[i] = sum_{j<=i} (C_i . B_j) exp(Acs_i - Acs_j) dt'_j x_j     intra-chunk, attention-like
    S_c       = sum_j exp(Acs_last - Acs_j) dt'_j x_j (x) B_j            the state the chunk alone produces
    H_c       = exp(Acs_last) H_{c-1} + S_c                             inter-chunk pass, restarts per sequence
    Y_off[i]  = exp(Acs_i) C_i . H_{c-1}                                contribution of the past
    y         = Y_diag + Y_off + D x

Chunks shorter than the longest one are padded with dt' = 0, which is exact: a padded step has
decay exp(0) = 1 and input 0. All math is float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.kernels.common import gather_initial_states, pass_states, scatter_states, time_step
from runtime.kernels.metadata import MambaPrefillMetadata

# Most elements of the (chunks, H, L, L) intra-chunk decay matrices held at once: 64 MiB of float32.
SEGSUM_ELEMENTS = 1 << 24


def ssd_scan_ref(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    dt_limit: tuple[float, float],
    ssm_states: Tensor,
    state_indices: Tensor,
    meta: MambaPrefillMetadata,
    out: Tensor,
) -> Tensor:
    """Chunked SSD scan of packed prefill tokens, carrying SSM states in and out.

    x, out: (T, H, P); dt: (T, H) raw (dt' = softplus(dt + dt_bias) clamped to dt_limit);
    A: (H,) float32; B, C: (T, G, N), head h uses group h // (H // G); D: (H,) (or (H, P));
    dt_bias: (H,); ssm_states: (num_slots, H, P, N); state_indices: (S,) (-1 = padding: no read,
    no write). y = SSD(x) + D * x (no z gating here: the gate is applied in the gated RMSNorm).
    Each sequence starts from ssm_states[slot] if meta.has_initial_state else zeros; its final
    state is written back to ssm_states[slot]. Writes out and returns it.
    """
    num_tokens, num_heads, head_dim = x.shape
    num_groups, d_state = B.shape[1:]
    assert num_heads % num_groups == 0 and A.shape == (num_heads,) and A.dtype == torch.float32
    assert dt.shape == (num_tokens, num_heads) and B.shape == C.shape == (num_tokens, num_groups, d_state)
    assert ssm_states.shape[1:] == (num_heads, head_dim, d_state) and out.shape == x.shape
    assert state_indices.shape == (meta.num_sequences,)
    assert num_tokens == int(meta.cu_chunk_seqlens[-1])

    chunks = _ChunkedInputs.gather(x, time_step(dt, dt_bias, dt_limit), A, B, C, meta.cu_chunk_seqlens)
    y, chunk_states = chunks.intra_chunk()
    init = gather_initial_states(ssm_states, state_indices, meta.has_initial_state)
    decay = chunks.chunk_decay()[..., None, None]
    start_states, final_states = pass_states(chunk_states, decay, init, meta.last_chunk_indices)
    y += chunks.from_start_states(start_states)

    # Row-major (chunk, position) order over the unpadded entries is exactly the packed token order.
    y = y.transpose(1, 2)[chunks.valid]
    y += D.float().reshape(num_heads, -1) * x.float()
    out.copy_(y)
    scatter_states(ssm_states, state_indices, final_states)
    return out


class _ChunkedInputs:
    """Inputs regrouped as (num_chunks, chunk_len, ...) with zero dt' past each chunk's end."""

    def __init__(self, xdt: Tensor, adt: Tensor, B: Tensor, C: Tensor, valid: Tensor) -> None:
        self.xdt = xdt  # (K, H, L, P): dt' x, heads first for the batched matmuls
        self.adt = adt  # (K, H, L): A dt'
        self.acs = adt.cumsum(-1)  # (K, H, L): cumulative A dt' inside each chunk
        self.B = B  # (K, G, L, N)
        self.C = C  # (K, G, L, N)
        self.valid = valid  # (K, L): position inside its chunk

    @classmethod
    def gather(cls, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, cu_chunks: Tensor) -> _ChunkedInputs:
        cu_chunks = cu_chunks.long()
        chunk_lens = cu_chunks[1:] - cu_chunks[:-1]
        # Pad to the longest chunk in this batch, not to Q: a batch of short prompts stays cheap.
        positions = torch.arange(int(chunk_lens.max()), device=x.device)
        valid = positions < chunk_lens[:, None]
        # Clamped indices make padded entries read a real (finite) token; their dt' = 0 cancels them.
        tokens = (cu_chunks[:-1, None] + positions).clamp(max=x.shape[0] - 1)

        def by_chunk(t: Tensor) -> Tensor:  # (T, ...) -> (K, L, ...); index_select is the fast gather
            return t.index_select(0, tokens.flatten()).unflatten(0, tokens.shape)

        dt = by_chunk(dt).masked_fill_(~valid[..., None], 0.0)  # (K, L, H)
        xdt = (by_chunk(x).float() * dt[..., None]).transpose(1, 2)
        adt = (dt * A).transpose(1, 2).contiguous()
        return cls(xdt, adt, by_chunk(B).float().transpose(1, 2), by_chunk(C).float().transpose(1, 2), valid)

    def heads_by_group(self, t: Tensor) -> Tensor:
        """(K, H, ...) -> (K, G, H // G, ...), to meet B and C, which are per group."""
        return t.unflatten(1, (self.B.shape[1], -1))

    def intra_chunk(self) -> tuple[Tensor, Tensor]:
        """Y_diag (K, H, L, P) and the state each chunk produces from a zero start, S_c (K, H, P, N).

        Chunks are taken a few at a time so that the (chunks, H, L, L) decay matrices stay under
        SEGSUM_ELEMENTS; a long prefill would otherwise hold several of them for the whole batch.
        """
        num_chunks, num_heads, length, head_dim = self.xdt.shape
        y = torch.empty_like(self.xdt)
        states = self.xdt.new_empty(num_chunks, num_heads, head_dim, self.B.shape[-1])
        step = max(1, SEGSUM_ELEMENTS // (num_heads * length * length))
        for first in range(0, num_chunks, step):
            part = slice(first, first + step)
            y[part], states[part] = self._intra_chunk(part)
        return y, states

    def _intra_chunk(self, part: slice) -> tuple[Tensor, Tensor]:
        xdt, B, C = self.xdt[part], self.B[part], self.C[part]
        decay = _segsum_exp(self.adt[part])  # (k, H, L, L)
        # The last row is exp(a_{j+1} + ... + a_{L-1}): each position's decay to the chunk's end.
        decay_to_end = decay[..., -1, :].clone()  # (k, H, L)
        scores = C @ B.transpose(-1, -2)  # (k, G, L, L): C_i . B_j
        masked = self.heads_by_group(decay).mul_(scores[:, :, None]).flatten(1, 2)
        y = masked @ xdt
        weighted = self.heads_by_group((xdt * decay_to_end[..., None]).transpose(-1, -2))  # (k, G, R, P, L)
        states = weighted @ B[:, :, None]  # (k, G, R, P, N)
        return y, states.flatten(1, 2)

    def chunk_decay(self) -> Tensor:
        """(K, H): exp of A dt' summed over each whole chunk."""
        return torch.exp(self.acs[..., -1])

    def from_start_states(self, start_states: Tensor) -> Tensor:
        """Y_off (K, H, L, P): each chunk's start state seen through C and decayed to position i."""
        start = self.heads_by_group(start_states).transpose(-1, -2)  # (K, G, R, N, P)
        y = (self.C[:, :, None] @ start).flatten(1, 2)  # (K, H, L, P)
        return y.mul_(torch.exp(self.acs)[..., None])


def _segsum_exp(a: Tensor) -> Tensor:
    """(..., L) -> (..., L, L): [i, j] = exp(a_{j+1} + ... + a_i) for i >= j, else 0.

    Stable form: the terms between j and i are summed directly, rather than taking differences of
    one long cumsum, which loses precision when the cumsum is large.
    """
    length = a.shape[-1]
    upper = torch.ones(length, length, dtype=torch.bool, device=a.device).triu()
    # Built transposed, sums_t[j, i] = a_{j+1} + ... + a_i, so that the cumsum runs along the
    # contiguous last dim (twice as fast on CPU as a cumsum over rows).
    sums_t = torch.where(upper.triu(1), a[..., None, :], 0.0).cumsum(-1)
    return sums_t.exp_().masked_fill_(~upper, 0.0).transpose(-1, -2)
