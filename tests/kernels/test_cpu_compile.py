"""The compiled CPU path computes what the eager references compute."""

import pytest
import torch

from runtime.kernels import cpu_compile
from runtime.kernels.ssm_state_update import selective_state_update_ref


@pytest.fixture
def compiled():
    assert cpu_compile.enable(True), "torch.compile must work on the CI machine"
    yield
    cpu_compile.enable(False)


def ssu_inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    S, H, P, N, G = 5, 4, 8, 16, 2
    r = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    states = r(12, H, P, N)
    return states, r(S, H, P), r(S, H), -torch.rand(H, generator=g), r(S, G, N), r(S, G, N), r(H), r(H)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [[7, 2, 9, 0, 4], [7, -1, 9, 0, -1]])
def test_compiled_state_update_equals_eager(compiled, dtype, slots):
    states, x, dt, A, B, C, D, dt_bias = ssu_inputs(dtype)
    slots = torch.tensor(slots)
    eager_states = states.clone()
    cpu_compile.enable(False)
    eager = selective_state_update_ref(eager_states, x, dt, A, B, C, D, dt_bias, (0.0, float("inf")), slots,
                                       torch.empty_like(x))
    cpu_compile.enable(True)
    fused = selective_state_update_ref(states, x, dt, A, B, C, D, dt_bias, (0.0, float("inf")), slots,
                                       torch.empty_like(x))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(fused, eager, **tol)
    torch.testing.assert_close(states, eager_states, **tol)
