"""The gated delta rule of Gated DeltaNet layers (Qwen3-Next, Qwen3.5): prefill over packed sequences, and decode.

Per sequence, value head h (query/key head h // (Hv/Hk)), token t, with a recurrent state S (Dk, Dv):

    q_t = l2norm(q_t) / sqrt(Dk),  k_t = l2norm(k_t)        (eps 1e-6 under the root, as HF and FLA)
    g_t = -exp(A_log) * softplus(a_t + dt_bias),  beta_t = beta_scale * sigmoid(b_t)
    S   = exp(g_t) * S;  S = S + k_t (beta_t * (v_t - S^T k_t))^T;  o_t = S^T q_t

which is HF's `torch_recurrent_gated_delta_rule` (beta_scale is 2 for OLMo-Hybrid's negative eigenvalues,
else 1). Layouts: q, k (T, Hk, Dk); v (T, Hv, Dv); a, b
(T, Hv); A_log, dt_bias (Hv,); states (num_slots, Hv, Dk, Dv), a strided page-pool view, one slot
per sequence (state_indices, -1 = padding: no read, no write). The prefill reference computes
HF's chunked form (`torch_chunk_gated_delta_rule`: a UT transform per chunk, then a scan over
chunks) over the metadata's logical chunks, which never span two sequences. Each sequence starts
from its slot's state when meta.has_initial_state says it resumes (chunked prefill, a cached
prefix), else from zeros, and its final state is written back. Math is float32; outputs are in
v's dtype, states are stored in their own dtype.

The Triton prefill kernel runs one program per (sequence, value head, block of Dv) and walks the
sequence in chunks of GDN_BLOCK_T tokens with the state tile in registers: per chunk, the UT
transform (I + strictly-lower(diag(beta) K K^T * decay))^-1 by forward substitution, then the
chunk's outputs and the next state as matrix products, HF's chunked form. Its chunks need not be
the metadata's (any chunking gives the same result): a chunk never crosses a sequence's end. Its
matrix products take half-precision operands on a GPU for half-precision activations (tensor cores,
float32 accumulation, as FLA's kernels do) and float32 otherwise. The decode kernel steps one token
with the same tile (FLA's fused recurrent form). Neither kernel was timed on a GPU yet: only
compiled for sm_90 (bench/kernels.py --compile-only) and run under the interpreter.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.kernels._triton_utils import dot_dtype, softplus, tl, triton
from runtime.kernels.common import check_waves, gather_initial_states, in_waves, scatter_states
from runtime.kernels.metadata import MambaPrefillMetadata

L2NORM_EPS = 1e-6
# Value channels per program: the state tile is (Dk, GDN_BLOCK_V) float32 in registers.
GDN_BLOCK_V = 32
# Tokens per chunk of the prefill kernel: tl.dot needs 16 rows on a GPU, and at Qwen3-Next's sizes (Dk = 128)
# 16 rows over 8 warps compile for sm_90 without spilling registers (bench/kernels.py --compile-only; 32 spill).
GDN_BLOCK_T = 16


def gated_delta_rule_fn_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    states: Tensor,
    state_indices: Tensor,
    meta: MambaPrefillMetadata,
    beta_scale: float = 1.0,
) -> Tensor:
    """Prefill: the gated delta rule over every sequence of a packed batch, carrying states in and out.

    Shapes as in the module docstring, T packed tokens, S = meta.num_sequences; state_indices (S,)
    int64. Returns (T, Hv, Dv) in v's dtype.
    """
    _check_args(q, k, v, a, b, A_log, dt_bias, states)
    assert state_indices.shape == (meta.num_sequences,)
    assert q.shape[0] == int(meta.query_start_loc[-1])
    qf, kf, vf, g, beta = _prepare(q, k, v, a, b, A_log, dt_bias, beta_scale)
    num_heads, dk, dv = states.shape[1:]

    # Gather every logical chunk into (C, Q) token rows; the rows past a short chunk's end are padding
    # with g = 0 and beta = k = v = 0: a decay of 1 and no input, so they change nothing (HF pads so).
    cu = meta.cu_chunk_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    chunk = int(lengths.max())
    pos = torch.arange(chunk, device=q.device)
    valid = pos < lengths[:, None]  # (C, Q)
    rows = (cu[:-1, None] + pos).clamp(max=q.shape[0] - 1)

    def chunked(x: Tensor) -> Tensor:  # (T, H, ...) -> (C, H, Q, ...), zero where padded
        y = x[rows] * valid.view(*valid.shape, *([1] * (x.dim() - 1)))
        return y.transpose(1, 2)

    qc, kc, vc, gc, bc = (chunked(x) for x in (qf, kf, vf, g, beta))
    out_chunks, final = _chunked_delta_rule(qc, kc, vc, gc, bc, meta, states, state_indices)
    out = torch.empty(q.shape[0], num_heads, dv, dtype=torch.float32, device=q.device)
    out[rows[valid]] = out_chunks.transpose(1, 2)[valid]
    scatter_states(states, state_indices, final)
    return out.to(v.dtype)


def _chunked_delta_rule(qc, kc, vc, gc, bc, meta, states, state_indices) -> tuple[Tensor, Tensor]:
    """HF's two phases on (C, H, Q, ...) chunks: the per-chunk UT transform, then the scan over each
    sequence's chunks (the r-th chunk of every sequence at once). Returns chunk outputs and final states."""
    chunk = qc.shape[2]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=qc.device).triu(1)
    cum = gc.cumsum(-1)  # (C, H, Q)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    k_beta, v_beta = kc * bc[..., None], vc * bc[..., None]
    ut_system = (k_beta @ kc.transpose(-1, -2)) * decay
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, k_beta * cum.exp()[..., None], upper=False,
                                               unitriangular=True)
    intra = (qc @ kc.transpose(-1, -2)) * decay
    q_decayed = qc * cum.exp()[..., None]
    k_decayed = kc * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]

    last = meta.last_chunk_indices.long()
    first = torch.cat([last.new_zeros(1), last[:-1] + 1])
    num_chunks = last - first + 1
    state = gather_initial_states(states, state_indices, meta.has_initial_state)
    out = torch.empty_like(vc)
    for r in range(int(num_chunks.max())):
        seqs = torch.nonzero(num_chunks > r).squeeze(1)
        c = first[seqs] + r
        s = state[seqs]
        v_new = new_values[c] - k_cumdecay[c] @ s
        out[c] = q_decayed[c] @ s + intra[c] @ v_new
        state[seqs] = s * chunk_decay[c] + k_decayed[c].transpose(-1, -2) @ v_new
    return out, state


def gated_delta_rule_update_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    states: Tensor,
    state_indices: Tensor,
    beta_scale: float = 1.0,
    waves: Sequence[int] | None = None,
) -> Tensor:
    """Decode: one token per sequence (T = S). state_indices (S,), -1 = padding (skipped: no read, no
    write, output zero), or with `waves` a verify's page chains (common.in_waves). Updates states in place;
    returns (S, Hv, Dv) in v's dtype."""
    _check_args(q, k, v, a, b, A_log, dt_bias, states)
    check_waves(state_indices, waves, q.shape[0])
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)

    def step(rows: slice, state_indices: Tensor) -> None:
        keep = state_indices >= 0
        slots = state_indices[keep]
        qf, kf, vf, g, beta = _prepare(q[rows][keep], k[rows][keep], v[rows][keep], a[rows][keep], b[rows][keep],
                                       A_log, dt_bias, beta_scale)
        state = states[slots].float() * g.exp()[..., None, None]  # (S', H, Dk, Dv)
        kv_mem = (state * kf[..., None]).sum(dim=-2)
        delta = (vf - kv_mem) * beta[..., None]
        state = state + kf[..., None] * delta[..., None, :]
        out[rows][keep] = (state * qf[..., None]).sum(dim=-2).to(v.dtype)
        states[slots] = state.to(states.dtype)

    in_waves(states, state_indices, waves, step)
    return out


def _prepare(q, k, v, a, b, A_log, dt_bias, beta_scale: float) -> tuple[Tensor, ...]:
    """float32 q (scaled), k (both l2-normed and repeated to the value heads), v, g and beta."""
    repeat = v.shape[1] // q.shape[1]
    qf = _l2norm(q.float()).repeat_interleave(repeat, dim=1) * q.shape[-1] ** -0.5
    kf = _l2norm(k.float()).repeat_interleave(repeat, dim=1)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return qf, kf, v.float(), g, beta_scale * torch.sigmoid(b.float())


def _l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _check_args(q, k, v, a, b, A_log, dt_bias, states) -> None:
    assert q.dim() == 3 and q.shape == k.shape and v.dim() == 3 and v.shape[0] == q.shape[0]
    num_k_heads, dk = q.shape[1:]
    num_heads, dv = v.shape[1:]
    assert num_heads % num_k_heads == 0, "value heads must be a multiple of key heads"
    assert a.shape == b.shape == (q.shape[0], num_heads)
    assert A_log.shape == dt_bias.shape == (num_heads,)
    assert states.shape[1:] == (num_heads, dk, dv), "states must be (num_slots, Hv, Dk, Dv)"


def gated_delta_rule_fn_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    states: Tensor,
    state_indices: Tensor,
    meta: MambaPrefillMetadata,
    beta_scale: float = 1.0,
) -> Tensor:
    """gated_delta_rule_fn_ref as one Triton kernel (same shapes): a program per (sequence, value head,
    Dv block) walks the sequence chunk by chunk."""
    _check_args(q, k, v, a, b, A_log, dt_bias, states)
    assert state_indices.shape == (meta.num_sequences,)
    num_heads, dk, dv = states.shape[1:]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    block_k, block_v = max(16, triton.next_power_of_2(dk)), max(16, min(GDN_BLOCK_V, triton.next_power_of_2(dv)))
    _chunked_delta_rule_kernel[(meta.num_sequences, num_heads, triton.cdiv(dv, block_v))](
        q, k, v, a, b, A_log, dt_bias, states, state_indices, meta.query_start_loc, meta.has_initial_state, out,
        dk, dv, *q.stride(), *k.stride(), *v.stride(), *a.stride(), *b.stride(), *states.stride(), *out.stride(),
        q.shape[-1] ** -0.5, float(beta_scale), HEADS_PER_K=num_heads // q.shape[1], BLOCK_T=GDN_BLOCK_T,
        BLOCK_K=block_k, BLOCK_V=block_v, DOT_DTYPE=dot_dtype(v.dtype), num_warps=8,
    )  # fmt: skip
    return out


def gated_delta_rule_update_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    states: Tensor,
    state_indices: Tensor,
    beta_scale: float = 1.0,
    waves: Sequence[int] | None = None,
) -> Tensor:
    """gated_delta_rule_update_ref as one Triton kernel (same shapes): a program per (sequence, value head,
    Dv block) updates its state tile by one token. A verify's waves launch it once a wave (common.in_waves)."""
    _check_args(q, k, v, a, b, A_log, dt_bias, states)
    check_waves(state_indices, waves, q.shape[0])
    num_heads, dk, dv = states.shape[1:]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    block_v = min(GDN_BLOCK_V, triton.next_power_of_2(dv))
    # A (128, 32) float32 state tile over 4 warps spills registers on sm_90 (bench/kernels.py --compile-only);
    # over 8 it does not.
    warps = 8 if triton.next_power_of_2(dk) * block_v >= 4096 else 4

    def step(rows: slice, slots: Tensor) -> None:
        qs, ks, vs, as_, bs, ys = q[rows], k[rows], v[rows], a[rows], b[rows], out[rows]
        _delta_rule_update_kernel[(qs.shape[0], num_heads, triton.cdiv(dv, block_v))](
            qs, ks, vs, as_, bs, A_log, dt_bias, states, slots, ys, dk, dv, *qs.stride(), *ks.stride(),
            *vs.stride(), *as_.stride(), *bs.stride(), *states.stride(), *ys.stride(), q.shape[-1] ** -0.5,
            float(beta_scale), HEADS_PER_K=num_heads // q.shape[1], BLOCK_K=triton.next_power_of_2(dk),
            BLOCK_V=block_v, num_warps=warps,
        )  # fmt: skip

    in_waves(states, state_indices, waves, step)
    return out


@triton.jit
def _delta_rule_update_kernel(
    q, k, v, a, b, A_log, dt_bias, states, state_indices, out, dk, dv,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_at, stride_ah, stride_bt, stride_bh, stride_ss, stride_sh, stride_sk, stride_sv,
    stride_ot, stride_oh, stride_od, scale, beta_scale,
    HEADS_PER_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    seq, head, v_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    k_head = head // HEADS_PER_K
    slot = tl.load(state_indices + seq).to(tl.int64)
    dk_range = tl.arange(0, BLOCK_K)
    dv_range = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = dk_range < dk, dv_range < dv
    out_ptrs = out + seq * stride_ot + head * stride_oh + dv_range * stride_od
    if slot < 0:  # padding: no state read or write, output zero
        tl.store(out_ptrs, tl.zeros([BLOCK_V], tl.float32), mask=v_ok)
        return
    state_ptrs = (states + slot * stride_ss + head * stride_sh + dk_range[:, None] * stride_sk
                  + dv_range[None, :] * stride_sv)
    state = tl.load(state_ptrs, mask=k_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
    qv = tl.load(q + seq * stride_qt + k_head * stride_qh + dk_range * stride_qd, mask=k_ok, other=0.0)
    kv = tl.load(k + seq * stride_kt + k_head * stride_kh + dk_range * stride_kd, mask=k_ok, other=0.0)
    vv = tl.load(v + seq * stride_vt + head * stride_vh + dv_range * stride_vd, mask=v_ok, other=0.0)
    qv, kv, vv = qv.to(tl.float32), kv.to(tl.float32), vv.to(tl.float32)
    qv = qv / tl.sqrt(tl.sum(qv * qv, axis=0) + 1e-6) * scale
    kv = kv / tl.sqrt(tl.sum(kv * kv, axis=0) + 1e-6)
    a_t = tl.load(a + seq * stride_at + head * stride_ah).to(tl.float32)
    b_t = tl.load(b + seq * stride_bt + head * stride_bh).to(tl.float32)
    decay_rate = -tl.exp(tl.load(A_log + head).to(tl.float32))
    state = state * tl.exp(decay_rate * softplus(a_t + tl.load(dt_bias + head).to(tl.float32)))
    delta = (vv - tl.sum(state * kv[:, None], axis=0)) * (beta_scale * tl.sigmoid(b_t))
    state = state + kv[:, None] * delta[None, :]
    tl.store(out_ptrs, tl.sum(state * qv[:, None], axis=0), mask=v_ok)
    tl.store(state_ptrs, state, mask=k_ok[:, None] & v_ok[None, :])


@triton.jit
def _chunked_delta_rule_kernel(
    q, k, v, a, b, A_log, dt_bias, states, state_indices, query_start_loc, has_initial_state, out, dk, dv,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_at, stride_ah, stride_bt, stride_bh, stride_ss, stride_sh, stride_sk, stride_sv,
    stride_ot, stride_oh, stride_od, scale, beta_scale,
    HEADS_PER_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    seq, head, v_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    k_head = head // HEADS_PER_K
    slot = tl.load(state_indices + seq).to(tl.int64)
    seq_start = tl.load(query_start_loc + seq).to(tl.int64)
    seq_len = tl.load(query_start_loc + seq + 1) - tl.load(query_start_loc + seq)
    resume = (tl.load(has_initial_state + seq) != 0) & (slot >= 0)
    rows = tl.arange(0, BLOCK_T)
    dk_range = tl.arange(0, BLOCK_K)
    dv_range = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = dk_range < dk, dv_range < dv
    state_ptrs = (states + slot * stride_ss + head * stride_sh + dk_range[:, None] * stride_sk
                  + dv_range[None, :] * stride_sv)
    # A fresh or padded sequence starts from zeros, never from its slot's (possibly stale or NaN) bytes.
    state = tl.zeros([BLOCK_K, BLOCK_V], tl.float32)
    if resume:
        state = tl.load(state_ptrs, mask=k_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
    decay_rate = -tl.exp(tl.load(A_log + head).to(tl.float32))
    bias = tl.load(dt_bias + head).to(tl.float32)
    lower = rows[:, None] > rows[None, :]  # strictly: j < i
    causal = rows[:, None] >= rows[None, :]
    for first in range(0, seq_len, BLOCK_T):
        # Rows past the sequence's end are padding: q = k = v = 0, g = 0 (a decay of 1), beta = 0. The tiles
        # are loaded where they are first used, to keep few of them live at once.
        t = seq_start + first + rows
        t_ok = first + rows < seq_len
        kc = tl.load(k + t[:, None] * stride_kt + k_head * stride_kh + dk_range[None, :] * stride_kd,
                     mask=t_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        kc = kc / tl.sqrt(tl.sum(kc * kc, axis=1) + 1e-6)[:, None]
        a_c = tl.load(a + t * stride_at + head * stride_ah, mask=t_ok, other=0.0).to(tl.float32)
        b_c = tl.load(b + t * stride_bt + head * stride_bh, mask=t_ok, other=0.0).to(tl.float32)
        g_cum = tl.cumsum(tl.where(t_ok, decay_rate * softplus(a_c + bias), 0.0), axis=0)
        g_last = tl.max(tl.where(rows == BLOCK_T - 1, g_cum, float("-inf")), axis=0)
        beta = tl.where(t_ok, beta_scale * tl.sigmoid(b_c), 0.0)
        # decay[i, j] = exp(g_cum_i - g_cum_j) for j <= i (<= 1: g <= 0), masked before exp so it cannot overflow.
        decay = tl.exp(tl.where(causal, g_cum[:, None] - g_cum[None, :], float("-inf")))
        kk = _dot(kc, tl.trans(kc), DOT_DTYPE)
        a_mat = tl.where(lower, kk * decay * beta[:, None], 0.0)
        # inverse = (I + a_mat)^-1, row by row: row i = e_i - a_mat[i, :i] @ inverse[:i].
        inverse = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
        for i in range(1, BLOCK_T):
            a_row = tl.sum(tl.where(rows[:, None] == i, a_mat, 0.0), axis=0)
            new_row = tl.where(rows == i, 1.0, 0.0) - tl.sum(a_row[:, None] * inverse, axis=0)
            inverse = tl.where(rows[:, None] == i, new_row[None, :], inverse)
        # v_new = inverse @ (beta v) - inverse @ (beta exp(g_cum) k) @ S: the chunk's corrections to what S predicts.
        w = _dot(inverse * (beta * tl.exp(g_cum))[None, :], kc, DOT_DTYPE)
        v_new = -_dot(w, state, DOT_DTYPE)
        vc = tl.load(v + t[:, None] * stride_vt + head * stride_vh + dv_range[None, :] * stride_vd,
                     mask=t_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
        v_new += _dot(inverse * beta[None, :], vc, DOT_DTYPE)
        qc = tl.load(q + t[:, None] * stride_qt + k_head * stride_qh + dk_range[None, :] * stride_qd,
                     mask=t_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        qc = qc / tl.sqrt(tl.sum(qc * qc, axis=1) + 1e-6)[:, None] * scale
        attn = tl.where(causal, _dot(qc, tl.trans(kc), DOT_DTYPE) * decay, 0.0)
        o = _dot(qc * tl.exp(g_cum)[:, None], state, DOT_DTYPE)
        o += _dot(attn, v_new, DOT_DTYPE)
        tl.store(out + t[:, None] * stride_ot + head * stride_oh + dv_range[None, :] * stride_od, o,
                 mask=t_ok[:, None] & v_ok[None, :])
        k_decayed = kc * tl.exp(g_last - g_cum)[:, None]
        state = state * tl.exp(g_last) + _dot(tl.trans(k_decayed), v_new, DOT_DTYPE)
    if slot >= 0:
        tl.store(state_ptrs, state, mask=k_ok[:, None] & v_ok[None, :])


@triton.jit
def _dot(x, y, DOT_DTYPE: tl.constexpr):
    """x @ y with float32 accumulation: inputs in DOT_DTYPE (the activations' half type on a GPU, tensor cores;
    float32 under the interpreter and for float32 models, never TF32)."""
    return tl.dot(x.to(DOT_DTYPE), y.to(DOT_DTYPE), input_precision="ieee")
