"""PackedLinear (oneDNN's packed weights) against nn.Linear, and the bounded set of row counts it runs."""

import pytest
import torch
from torch import nn

from runtime.layers.linear import PackedLinear, bucket


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 17, 100, 129, 300])
def test_packed_linear_matches_nn_linear_for_every_row_count(rows):
    torch.manual_seed(rows)
    linear = nn.Linear(24, 40)
    x = torch.randn(rows, 24)
    torch.testing.assert_close(PackedLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


def test_packed_linear_keeps_leading_dims_and_handles_no_bias():
    linear = nn.Linear(16, 8, bias=False)
    x = torch.randn(3, 5, 16)
    out = PackedLinear(linear)(x)
    assert out.shape == (3, 5, 8)
    torch.testing.assert_close(out, linear(x), rtol=1e-5, atol=1e-5)


def test_bucket_covers_rows_with_a_few_dozen_sizes_and_at_most_a_quarter_more():
    sizes = {bucket(rows) for rows in range(1, 8193)}
    assert len(sizes) <= 48
    for rows in range(1, 8193):
        assert rows <= bucket(rows) <= rows * 1.25
        assert bucket(bucket(rows)) == bucket(rows)
