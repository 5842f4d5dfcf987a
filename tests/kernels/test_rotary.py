"""The rotary embedding: the reference against HF's apply_rotary_pos_emb, the native kernel against the reference."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from runtime.kernels import cpu_native
from runtime.kernels.rotary import rotary_ref


def rotary_inputs(tokens, heads, head_dim, rotary_dim, dtype, seed=0):
    """x as a strided view (a slice of a fused projection's output), cos and sin of real positions."""
    torch.manual_seed(seed)
    fused = torch.randn(tokens, heads * head_dim + 24).to(dtype)
    x = fused[:, 8 : 8 + heads * head_dim].view(tokens, heads, head_dim)
    inverse = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.arange(tokens).float()[:, None] * inverse
    emb = torch.cat((freqs, freqs), dim=-1)
    return x, emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reference_is_hfs_rotary(dtype):
    x, cos, sin = rotary_inputs(9, 3, 16, 16, dtype)
    hf, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(rotary_ref(x, cos, sin), hf[0].transpose(0, 1))


@pytest.mark.skipif(not cpu_native.available(), reason="the native CPU kernels do not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, heads, head_dim, rotary_dim", [(1, 4, 64, 64), (37, 12, 64, 64), (5, 2, 80, 40)])
def test_native_matches_the_reference_bit_for_bit(dtype, tokens, heads, head_dim, rotary_dim):
    """Full and partial rotary dims, one token and many: the same roundings, so the same bits."""
    x, cos, sin = rotary_inputs(tokens, heads, head_dim, rotary_dim, dtype, seed=tokens)
    out = cpu_native.rotary_native(x, cos, sin)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, rotary_ref(x, cos, sin))


@pytest.mark.skipif(not cpu_native.available(), reason="the native CPU kernels do not build here")
def test_native_hands_float16_to_the_reference():
    x, cos, sin = rotary_inputs(3, 2, 8, 8, torch.float16)
    assert torch.equal(cpu_native.rotary_native(x, cos, sin), rotary_ref(x, cos, sin))
