"""The sequential Mamba-2 recurrence, token by token in float64: the ground truth for the SSM tests."""

import torch
import torch.nn.functional as F


def time_step_oracle(dt, dt_bias, dt_limit):
    dt = F.softplus(dt.double() + dt_bias.double())
    return dt.clamp(*dt_limit)


def recurrence_oracle(x, dt, A, B, C, D, dt_bias, dt_limit, state):
    """One sequence: x (L, H, P), dt (L, H), B, C (L, G, N), state (H, P, N) -> y (L, H, P), final state."""
    heads_per_group = x.shape[1] // B.shape[1]
    dt = time_step_oracle(dt, dt_bias, dt_limit)
    B = B.double().repeat_interleave(heads_per_group, dim=1)
    C = C.double().repeat_interleave(heads_per_group, dim=1)
    x, h = x.double(), state.double()
    ys = []
    for t in range(x.shape[0]):
        h = h * torch.exp(dt[t] * A.double())[:, None, None] + (dt[t][:, None] * x[t])[..., None] * B[t][:, None, :]
        ys.append((h * C[t][:, None, :]).sum(-1) + D.double()[:, None] * x[t])
    return torch.stack(ys), h


def random_ssm_inputs(num_tokens, num_heads, head_dim, num_groups, d_state, dtype=torch.float32):
    """Random inputs on the scales real models see (dt' around 0.1-2, decays per token 0.1-0.99)."""
    return dict(
        x=torch.randn(num_tokens, num_heads, head_dim, dtype=dtype),
        dt=(torch.randn(num_tokens, num_heads) - 1.0).to(dtype),
        A=-torch.exp(torch.randn(num_heads) * 0.5),
        B=torch.randn(num_tokens, num_groups, d_state, dtype=dtype),
        C=torch.randn(num_tokens, num_groups, d_state, dtype=dtype),
        D=torch.randn(num_heads, dtype=dtype),
        dt_bias=(torch.rand(num_heads) * 0.5).to(dtype),
    )


PER_TOKEN = ("x", "dt", "B", "C")


def select_tokens(inputs, rows):
    """The inputs of the given tokens (a slice or index list); per-head parameters are kept whole."""
    return {k: v[rows] if k in PER_TOKEN else v for k, v in inputs.items()}
