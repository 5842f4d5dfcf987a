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

from runtime.kernels import _triton_utils as tu
from runtime.kernels._triton_utils import tl, triton
from runtime.kernels.common import gather_initial_states, pass_states, scatter_states, time_step
from runtime.kernels.cpu_compile import fused
from runtime.kernels.metadata import MambaPrefillMetadata

# Most elements of the (chunks, H, L, L) intra-chunk decay matrices held at once: 64 MiB of float32.
SEGSUM_ELEMENTS = 1 << 24
# exp(x) for x below this is treated as 0 inside a chunk (float32 denormals start near exp(-87.3)).
DENORMAL_EXPONENT = -80.0


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
    _check_args(x, dt, A, B, C, ssm_states, state_indices, meta, out)
    assert x.shape[0] == int(meta.cu_chunk_seqlens[-1])
    num_heads = x.shape[1]
    chunks = _ChunkedInputs.gather(x, time_step(dt, dt_bias, dt_limit), A, B, C, meta.cu_chunk_seqlens)
    y, chunk_states = chunks.intra_chunk()
    carried = _chunks_with_a_start_state(meta, state_indices)
    if carried.numel() == 0:
        # Fresh prompts of one chunk each: every chunk starts from zero and ends its sequence, so there
        # is no state to pass or to see through C (the common prefill of short prompts).
        final_states = chunk_states
    else:
        init = gather_initial_states(ssm_states, state_indices, meta.has_initial_state)
        decay = chunks.chunk_decay()[..., None, None]
        start_states, final_states = pass_states(chunk_states, decay, init, meta.last_chunk_indices)
        y[carried] += chunks.from_start_states(start_states[carried], carried)

    # Row-major (chunk, position) order over the unpadded entries is exactly the packed token order.
    y = y.transpose(1, 2)[chunks.valid]
    y += D.float().reshape(num_heads, -1) * x.float()
    out.copy_(y)
    scatter_states(ssm_states, state_indices, final_states)
    return out


def ssd_scan_triton(
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
    """ssd_scan_ref as five Triton kernels (same shapes), one logical chunk per program (vLLM's design):

    1. chunk cumsum: dt' (0 past the chunk's end) and Acs, (H, K, Qp) float32;
    2. C B^T per chunk and group, (K, G, Qp, Qp) float32;
    3. chunk states S_c from a zero start, (K, H, P, N) float32;
    4. state passing per sequence: from its initial state through its chunks, overwriting each S_c
       with the state at the chunk's start, and writing the final state to ssm_states[slot];
    5. chunk scan: y = Y_diag + Y_off + D x into out.
    The host reads no metadata values; the pool's state slots are read and written only by (4).
    """
    _check_args(x, dt, A, B, C, ssm_states, state_indices, meta, out)
    num_heads, head_dim = x.shape[1:]
    num_groups, d_state = B.shape[1:]
    num_chunks = meta.chunk_seq_idx.shape[0]
    q_pad = max(16, triton.next_power_of_2(meta.chunk_size))  # tl.dot needs 16 rows on a GPU
    scratch = dict(dtype=torch.float32, device=x.device)
    dt_out, acs = torch.empty(2, num_heads, num_chunks, q_pad, **scratch)
    cb = torch.empty(num_chunks, num_groups, q_pad, q_pad, **scratch)
    states = torch.empty(num_chunks, num_heads, head_dim, d_state, **scratch)
    sizes = _Sizes(num_heads // num_groups, head_dim, d_state, q_pad, tu.dot_dtype(x.dtype))
    _chunk_cumsum(dt, A, dt_bias, dt_limit, meta, dt_out, acs, sizes)
    _chunk_cb(B, C, meta, cb, sizes)
    _chunk_states(x, B, meta, dt_out, acs, states, sizes)
    _pass_states(ssm_states, state_indices, meta, acs, states, sizes)
    _chunk_scan(x, C, tu.per_channel(D, num_heads, head_dim), meta, dt_out, acs, cb, states, out, sizes)
    return out


def _check_args(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, ssm_states: Tensor, state_indices: Tensor,
    meta: MambaPrefillMetadata, out: Tensor,
) -> None:  # fmt: skip
    num_tokens, num_heads, head_dim = x.shape
    num_groups, d_state = B.shape[1:]
    assert num_heads % num_groups == 0 and A.shape == (num_heads,) and A.dtype == torch.float32
    assert dt.shape == (num_tokens, num_heads) and B.shape == C.shape == (num_tokens, num_groups, d_state)
    assert ssm_states.shape[1:] == (num_heads, head_dim, d_state) and out.shape == x.shape
    # No check that reads a metadata value: on a GPU it would wait for the device at every layer.
    assert state_indices.shape == (meta.num_sequences,)


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
        return _intra_chunk(self.xdt[part], self.adt[part], self.B[part], self.C[part])

    def chunk_decay(self) -> Tensor:
        """(K, H): exp of A dt' summed over each whole chunk."""
        return torch.exp(self.acs[..., -1])

    def from_start_states(self, start_states: Tensor, chunks: Tensor) -> Tensor:
        """Y_off (k, H, L, P) of the k chunks listed in `chunks`: each one's start state (k, H, P, N)
        seen through C and decayed to position i."""
        start = self.heads_by_group(start_states).transpose(-1, -2)  # (k, G, R, N, P)
        y = (self.C[chunks][:, :, None] @ start).flatten(1, 2)  # (k, H, L, P)
        return y.mul_(torch.exp(self.acs[chunks])[..., None])


def _chunks_with_a_start_state(meta: MambaPrefillMetadata, state_indices: Tensor) -> Tensor:
    """Indices of the chunks whose start state may be nonzero: all but the first chunk of each
    sequence that starts from zeros (a fresh prompt, or a padding slot)."""
    last = meta.last_chunk_indices
    first = torch.cat([last.new_zeros(1), last[:-1] + 1])
    from_zero = first[~(meta.has_initial_state & (state_indices >= 0))]
    carried = torch.ones(meta.chunk_seq_idx.shape[0], dtype=torch.bool, device=last.device)
    carried[from_zero] = False
    return carried.nonzero().squeeze(1)


@fused
def _intra_chunk(xdt: Tensor, adt: Tensor, B: Tensor, C: Tensor) -> tuple[Tensor, Tensor]:
    """Y_diag (k, H, L, P) and S_c (k, H, P, N) of k chunks; xdt (k, H, L, P), adt (k, H, L), B, C (k, G, L, N)."""
    num_groups = B.shape[1]
    decay = _segsum_exp(adt)  # (k, H, L, L)
    # The last row is exp(a_{j+1} + ... + a_{L-1}): each position's decay to the chunk's end.
    decay_to_end = decay[..., -1, :]  # (k, H, L)
    scores = C @ B.transpose(-1, -2)  # (k, G, L, L): C_i . B_j
    masked = (decay.unflatten(1, (num_groups, -1)) * scores[:, :, None]).flatten(1, 2)
    y = masked @ xdt
    weighted = (xdt * decay_to_end[..., None]).transpose(-1, -2).unflatten(1, (num_groups, -1))  # (k, G, R, P, L)
    states = weighted @ B[:, :, None]  # (k, G, R, P, N)
    return y, states.flatten(1, 2)


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
    # Decays below exp(-80) ~ 2e-35 are set to 0, as a CPU flushing denormals would: exp of the strong
    # decays of long chunks gives float32 denormals, which the CPU computes with several times slower.
    return torch.where(upper & (sums_t > DENORMAL_EXPONENT), sums_t.exp(), 0.0).transpose(-1, -2)


class _Sizes:
    """The launch constants shared by the five scan kernels."""

    def __init__(self, heads_per_group: int, head_dim: int, d_state: int, q_pad: int, dot_dtype: tl.dtype) -> None:
        self.heads_per_group, self.head_dim, self.d_state, self.q_pad = heads_per_group, head_dim, d_state, q_pad
        self.dot_dtype = dot_dtype
        self.block_n = max(16, triton.next_power_of_2(d_state))  # one tile holds all of N
        self.block_p = max(16, min(64, triton.next_power_of_2(head_dim)))
        self.block_q = min(64, q_pad)  # rows (chunk positions) per program of the CB and scan kernels
        self.block_k = min(32, q_pad)  # chunk positions per step of the K-loops


def _chunk_cumsum(dt: Tensor, A: Tensor, dt_bias: Tensor, dt_limit: tuple[float, float], meta: MambaPrefillMetadata,
                  dt_out: Tensor, acs: Tensor, sizes: _Sizes) -> None:
    num_heads, num_chunks = dt_out.shape[:2]
    block_h = max(1, min(triton.next_power_of_2(num_heads), 4096 // sizes.q_pad))
    _chunk_cumsum_kernel[(num_chunks, triton.cdiv(num_heads, block_h))](
        dt, A, dt_bias, meta.cu_chunk_seqlens, dt_out, acs, num_heads, float(dt_limit[0]), float(dt_limit[1]),
        *dt.stride(), *dt_out.stride(), BLOCK_H=block_h, Q_PAD=sizes.q_pad,
    )  # fmt: skip


def _chunk_cb(B: Tensor, C: Tensor, meta: MambaPrefillMetadata, cb: Tensor, sizes: _Sizes) -> None:
    num_chunks, num_groups = cb.shape[:2]
    tiles = triton.cdiv(sizes.q_pad, sizes.block_q)
    _chunk_cb_kernel[(tiles * tiles, num_chunks, num_groups)](
        B, C, meta.cu_chunk_seqlens, cb, *B.stride(), *C.stride(), *cb.stride(), D_STATE=sizes.d_state,
        Q_TILES=tiles, BLOCK_Q=sizes.block_q, BLOCK_N=sizes.block_n, DOT_DTYPE=sizes.dot_dtype,
    )  # fmt: skip


def _chunk_states(x: Tensor, B: Tensor, meta: MambaPrefillMetadata, dt_out: Tensor, acs: Tensor, states: Tensor,
                  sizes: _Sizes) -> None:
    num_chunks, num_heads = states.shape[:2]
    grid = (triton.cdiv(sizes.head_dim, sizes.block_p), num_chunks, num_heads)
    _chunk_state_kernel[grid](
        x, B, meta.cu_chunk_seqlens, dt_out, acs, states, *x.stride(), *B.stride(), *dt_out.stride(),
        *states.stride(), HEADS_PER_GROUP=sizes.heads_per_group, HEAD_DIM=sizes.head_dim, D_STATE=sizes.d_state,
        Q_PAD=sizes.q_pad, BLOCK_P=sizes.block_p, BLOCK_N=sizes.block_n, BLOCK_K=sizes.block_k,
        DOT_DTYPE=sizes.dot_dtype,
    )  # fmt: skip


def _pass_states(ssm_states: Tensor, state_indices: Tensor, meta: MambaPrefillMetadata, acs: Tensor, states: Tensor,
                 sizes: _Sizes) -> None:
    num_heads = states.shape[1]
    block = min(1024, triton.next_power_of_2(sizes.head_dim * sizes.d_state))
    grid = (triton.cdiv(sizes.head_dim * sizes.d_state, block), num_heads, meta.num_sequences)
    _state_passing_kernel[grid](
        ssm_states, state_indices, meta.has_initial_state, meta.last_chunk_indices, acs, states,
        *ssm_states.stride(), *acs.stride(), *states.stride(), D_STATE=sizes.d_state,
        STATE_SIZE=sizes.head_dim * sizes.d_state, Q_PAD=sizes.q_pad, BLOCK=block,
    )  # fmt: skip


def _chunk_scan(x: Tensor, C: Tensor, D: Tensor, meta: MambaPrefillMetadata, dt_out: Tensor, acs: Tensor, cb: Tensor,
                states: Tensor, out: Tensor, sizes: _Sizes) -> None:
    num_chunks, num_heads = states.shape[:2]
    p_tiles = triton.cdiv(sizes.head_dim, sizes.block_p)
    _chunk_scan_kernel[(triton.cdiv(sizes.q_pad, sizes.block_q) * p_tiles, num_chunks, num_heads)](
        x, C, D, meta.cu_chunk_seqlens, dt_out, acs, cb, states, out, *x.stride(), *C.stride(), *D.stride(),
        *dt_out.stride(), *cb.stride(), *states.stride(), *out.stride(), HEADS_PER_GROUP=sizes.heads_per_group,
        HEAD_DIM=sizes.head_dim, D_STATE=sizes.d_state, P_TILES=p_tiles, BLOCK_Q=sizes.block_q,
        BLOCK_P=sizes.block_p, BLOCK_N=sizes.block_n, BLOCK_K=sizes.block_k, DOT_DTYPE=sizes.dot_dtype,
    )  # fmt: skip


@triton.jit
def _chunk_cumsum_kernel(
    dt, A, dt_bias, cu_chunk_seqlens, dt_out, acs, num_heads, dt_min, dt_max, stride_dt_t, stride_dt_h,
    stride_o_h, stride_o_c, stride_o_q, BLOCK_H: tl.constexpr, Q_PAD: tl.constexpr,
):  # fmt: skip
    chunk = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < num_heads
    start = tl.load(cu_chunk_seqlens + chunk)
    q = tl.arange(0, Q_PAD)
    valid = h_ok[:, None] & (q < tl.load(cu_chunk_seqlens + chunk + 1) - start)[None, :]
    raw = tl.load(dt + (start + q)[None, :].to(tl.int64) * stride_dt_t + h[:, None] * stride_dt_h, mask=valid,
                  other=0.0).to(tl.float32)
    bias = tl.load(dt_bias + h, mask=h_ok, other=0.0).to(tl.float32)
    # dt' = 0 past the chunk's end: decay 1 and input 0, so Acs stays flat and Acs[Q_PAD-1] is the chunk's total.
    step = tl.where(valid, tu.time_step(raw, bias[:, None], dt_min, dt_max), 0.0)
    a = tl.load(A + h, mask=h_ok, other=0.0)
    offsets = h[:, None] * stride_o_h + chunk * stride_o_c + q[None, :] * stride_o_q
    tl.store(dt_out + offsets, step, mask=h_ok[:, None])
    tl.store(acs + offsets, tl.cumsum(step * a[:, None], axis=1), mask=h_ok[:, None])


@triton.jit
def _chunk_cb_kernel(
    B, C, cu_chunk_seqlens, cb, stride_b_t, stride_b_g, stride_b_n, stride_c_t, stride_c_g, stride_c_n,
    stride_cb_c, stride_cb_g, stride_cb_i, stride_cb_j,
    D_STATE: tl.constexpr, Q_TILES: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    tile, chunk, group = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tile_i, tile_j = tile // Q_TILES, tile % Q_TILES
    if tile_j > tile_i:  # above the diagonal: the scan never reads it
        return
    start = tl.load(cu_chunk_seqlens + chunk)
    length = tl.load(cu_chunk_seqlens + chunk + 1) - start
    i = tile_i * BLOCK_Q + tl.arange(0, BLOCK_Q)
    j = tile_j * BLOCK_Q + tl.arange(0, BLOCK_Q)
    n = tl.arange(0, BLOCK_N)
    n_ok = n < D_STATE
    # Positions past the chunk's end load as zero rows, so their CB entries are 0.
    c = tl.load(C + (start + i)[:, None].to(tl.int64) * stride_c_t + group * stride_c_g + n[None, :] * stride_c_n,
                mask=(i < length)[:, None] & n_ok[None, :], other=0.0)
    b = tl.load(B + (start + j)[None, :].to(tl.int64) * stride_b_t + group * stride_b_g + n[:, None] * stride_b_n,
                mask=(j < length)[None, :] & n_ok[:, None], other=0.0)
    scores = tl.dot(c.to(DOT_DTYPE), b.to(DOT_DTYPE), input_precision="ieee")
    tl.store(cb + chunk * stride_cb_c + group * stride_cb_g + i[:, None] * stride_cb_i + j[None, :] * stride_cb_j,
             scores)


@triton.jit
def _chunk_state_kernel(
    x, B, cu_chunk_seqlens, dt_out, acs, states, stride_x_t, stride_x_h, stride_x_p, stride_b_t, stride_b_g,
    stride_b_n, stride_a_h, stride_a_c, stride_a_q, stride_s_c, stride_s_h, stride_s_p, stride_s_n,
    HEADS_PER_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_STATE: tl.constexpr, Q_PAD: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    p_block, chunk, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    group = head // HEADS_PER_GROUP
    start = tl.load(cu_chunk_seqlens + chunk)
    length = tl.load(cu_chunk_seqlens + chunk + 1) - start
    p = p_block * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = p < HEAD_DIM
    n = tl.arange(0, BLOCK_N)
    n_ok = n < D_STATE
    chunk_acs = acs + head * stride_a_h + chunk * stride_a_c
    chunk_dt = dt_out + head * stride_a_h + chunk * stride_a_c
    acs_last = tl.load(chunk_acs + (Q_PAD - 1) * stride_a_q)  # the padded tail is flat: the chunk's total
    acc = tl.zeros([BLOCK_P, BLOCK_N], tl.float32)
    # S_c = sum_k x_k^T (x) B_k exp(Acs_last - Acs_k) dt'_k, as a K-loop of (P x k) @ (k x N) products.
    for first in range(0, length, BLOCK_K):
        k = first + tl.arange(0, BLOCK_K)
        k_ok = k < length
        token = (start + k).to(tl.int64)
        xt = tl.load(x + token[None, :] * stride_x_t + head * stride_x_h + p[:, None] * stride_x_p,
                     mask=p_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(B + token[:, None] * stride_b_t + group * stride_b_g + n[None, :] * stride_b_n,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        acs_k = tl.load(chunk_acs + k * stride_a_q, mask=k_ok, other=0.0)
        weight = tl.exp(acs_last - acs_k) * tl.load(chunk_dt + k * stride_a_q, mask=k_ok, other=0.0)
        acc += tl.dot(xt.to(DOT_DTYPE), (b * weight[:, None]).to(DOT_DTYPE), input_precision="ieee")
    tl.store(states + chunk * stride_s_c + head * stride_s_h + p[:, None] * stride_s_p + n[None, :] * stride_s_n,
             acc, mask=p_ok[:, None] & n_ok[None, :])


@triton.jit
def _state_passing_kernel(
    ssm_states, state_indices, has_initial_state, last_chunk_indices, acs, states,
    stride_pool_slot, stride_pool_h, stride_pool_p, stride_pool_n, stride_a_h, stride_a_c, stride_a_q,
    stride_s_c, stride_s_h, stride_s_p, stride_s_n,
    D_STATE: tl.constexpr, STATE_SIZE: tl.constexpr, Q_PAD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    e_block, head, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    e = e_block * BLOCK + tl.arange(0, BLOCK)  # a slice of the flattened (P, N) state
    e_ok = e < STATE_SIZE
    p, n = e // D_STATE, e % D_STATE
    slot = tl.load(state_indices + seq).to(tl.int64)
    last = tl.load(last_chunk_indices + seq).to(tl.int32)
    first = tl.where(seq > 0, tl.load(last_chunk_indices + tl.maximum(seq - 1, 0)).to(tl.int32) + 1, 0)
    pool = ssm_states + slot * stride_pool_slot + head * stride_pool_h + p * stride_pool_p + n * stride_pool_n
    state = tl.zeros([BLOCK], tl.float32)
    # A fresh or padded sequence starts from zeros, never from its slot's bytes.
    if (tl.load(has_initial_state + seq) != 0) & (slot >= 0):
        state = tl.load(pool, mask=e_ok, other=0.0).to(tl.float32)
    head_states = states + head * stride_s_h + p * stride_s_p + n * stride_s_n
    for chunk in range(first, last + 1):
        # In place: the chunk's own state is read, then replaced by the state at the chunk's start.
        produced = tl.load(head_states + chunk * stride_s_c, mask=e_ok, other=0.0)
        tl.store(head_states + chunk * stride_s_c, state, mask=e_ok)
        decay = tl.exp(tl.load(acs + head * stride_a_h + chunk * stride_a_c + (Q_PAD - 1) * stride_a_q))
        state = decay * state + produced
    # This program alone read this slice of the slot, above; the write cannot overtake that read.
    if slot >= 0:
        tl.store(pool, state, mask=e_ok)


@triton.jit
def _chunk_scan_kernel(
    x, C, D, cu_chunk_seqlens, dt_out, acs, cb, states, out, stride_x_t, stride_x_h, stride_x_p,
    stride_c_t, stride_c_g, stride_c_n, stride_d_h, stride_d_p, stride_a_h, stride_a_c, stride_a_q,
    stride_cb_c, stride_cb_g, stride_cb_i, stride_cb_j, stride_s_c, stride_s_h, stride_s_p, stride_s_n,
    stride_o_t, stride_o_h, stride_o_p,
    HEADS_PER_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_STATE: tl.constexpr, P_TILES: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    tile, chunk, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_tile, p_tile = tile // P_TILES, tile % P_TILES
    start = tl.load(cu_chunk_seqlens + chunk)
    length = tl.load(cu_chunk_seqlens + chunk + 1) - start
    if q_tile * BLOCK_Q >= length:
        return
    group = head // HEADS_PER_GROUP
    i = q_tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    i_ok = i < length
    p = p_tile * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = p < HEAD_DIM
    n = tl.arange(0, BLOCK_N)
    n_ok = n < D_STATE
    chunk_acs = acs + head * stride_a_h + chunk * stride_a_c
    chunk_dt = dt_out + head * stride_a_h + chunk * stride_a_c
    acs_i = tl.load(chunk_acs + i * stride_a_q)

    # Y_off = exp(Acs_i) C_i . H_start: the past, through the state at the chunk's start.
    token_i = (start + i).to(tl.int64)
    c = tl.load(C + token_i[:, None] * stride_c_t + group * stride_c_g + n[None, :] * stride_c_n,
                mask=i_ok[:, None] & n_ok[None, :], other=0.0)
    h_start = tl.load(states + chunk * stride_s_c + head * stride_s_h + p[None, :] * stride_s_p
                      + n[:, None] * stride_s_n, mask=n_ok[:, None] & p_ok[None, :], other=0.0)
    acc = tl.dot(c.to(DOT_DTYPE), h_start.to(DOT_DTYPE), input_precision="ieee") * tl.exp(acs_i)[:, None]

    # Y_diag = sum_{k<=i} (C_i . B_k) exp(Acs_i - Acs_k) dt'_k x_k, over the keys this row tile sees.
    cb_rows = cb + chunk * stride_cb_c + group * stride_cb_g + i[:, None] * stride_cb_i
    for first in range(0, tl.minimum((q_tile + 1) * BLOCK_Q, length), BLOCK_K):
        k = first + tl.arange(0, BLOCK_K)
        k_ok = k < length
        # The causal mask in the load: entries above the diagonal are never read.
        scores = tl.load(cb_rows + k[None, :] * stride_cb_j, mask=(k[None, :] <= i[:, None]) & k_ok[None, :],
                         other=0.0)
        acs_k = tl.load(chunk_acs + k * stride_a_q, mask=k_ok, other=0.0)
        dt_k = tl.load(chunk_dt + k * stride_a_q, mask=k_ok, other=0.0)
        # min(., 0): masked entries (k > i) would otherwise overflow exp before the zero scores cancel them.
        weight = scores * tl.exp(tl.minimum(acs_i[:, None] - acs_k[None, :], 0.0)) * dt_k[None, :]
        xk = tl.load(x + (start + k)[:, None].to(tl.int64) * stride_x_t + head * stride_x_h + p[None, :] * stride_x_p,
                     mask=k_ok[:, None] & p_ok[None, :], other=0.0)
        acc += tl.dot(weight.to(DOT_DTYPE), xk.to(DOT_DTYPE), input_precision="ieee")

    mask = i_ok[:, None] & p_ok[None, :]
    xi = tl.load(x + token_i[:, None] * stride_x_t + head * stride_x_h + p[None, :] * stride_x_p, mask=mask,
                 other=0.0).to(tl.float32)
    d = tl.load(D + head * stride_d_h + p * stride_d_p, mask=p_ok, other=0.0).to(tl.float32)
    acc += xi * d[None, :]
    tl.store(out + token_i[:, None] * stride_o_t + head * stride_o_h + p[None, :] * stride_o_p, acc, mask=mask)
