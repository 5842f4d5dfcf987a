"""rms_norm_gated_ref equals HF's MambaRMSNormGated (gate first, then RMSNorm per group)."""

import pytest
import torch
from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated

from runtime.kernels.rms_norm_gated import rms_norm_gated_ref

DIM = 96


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_groups", [1, 4])
@pytest.mark.parametrize("gated", [True, False])
def test_matches_hf(dtype, num_groups, gated):
    torch.manual_seed(0)
    hf = MambaRMSNormGated(DIM, group_size=DIM // num_groups, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(DIM))
    x = torch.randn(7, DIM, dtype=dtype) * 3
    z = torch.randn(7, DIM, dtype=dtype) if gated else None

    ours = rms_norm_gated_ref(x, z, hf.weight.detach(), 1e-5, DIM // num_groups)

    assert ours.dtype == dtype
    # The same float32 math in the same order, so equal up to float32 reduction order.
    torch.testing.assert_close(ours, hf(x, z).detach(), atol=1e-6, rtol=1e-6)
