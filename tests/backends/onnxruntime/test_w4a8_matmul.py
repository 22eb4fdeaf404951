"""w4a8_matmul on ONNX Runtime: in-graph int4 unpacking (Mod/Div) and group sums in group order make
the output bitwise the reference's."""

from __future__ import annotations

import pytest
import torch

from backends.reference.w4a8_matmul import pack_int4


@pytest.mark.parametrize("group_size", [128, 32, 2])
def test_bitwise_per_group_and_per_channel(be, ref, no_fallback, group_size):
    g = torch.Generator().manual_seed(9)
    m, n, k = 5, 6, 128
    x_q = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    w = torch.randint(-8, 8, (n, k), generator=g)
    w[0] = -8
    w_packed = pack_int4(w)
    w_scale = torch.rand(n, k // group_size, generator=g)
    x_scale = torch.rand(m, generator=g)
    bias = torch.randn(n, generator=g)
    for b in (None, bias):
        got = be.w4a8_matmul(x_q, x_scale, w_packed, w_scale, group_size, b, torch.float32)
        assert torch.equal(
            got, ref.w4a8_matmul(x_q, x_scale, w_packed, w_scale, group_size, b, torch.float32)
        )
    no_fallback(ref_calls_allowed=2)


def test_no_rows(be):
    out = be.w4a8_matmul(
        torch.empty(0, 8, dtype=torch.int8),
        torch.empty(0),
        torch.zeros(3, 4, dtype=torch.uint8),
        torch.ones(3, 2),
        4,
        out_dtype=torch.bfloat16,
    )
    assert out.shape == (0, 3) and out.dtype == torch.bfloat16
