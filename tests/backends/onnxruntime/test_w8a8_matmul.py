"""w8a8_matmul on ONNX Runtime: MatMulInteger is exact at the int8 extremes (-128 included), and the
epilogue's fp32 order makes the output bitwise the reference's."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bitwise_at_extremes(be, ref, no_fallback, out_dtype, with_bias):
    g = torch.Generator().manual_seed(8)
    m, n, k = 9, 7, 1000
    x_q = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    w_q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    x_q[0], w_q[0] = -128, -128  # 16384 * K: far past int16, the AVX2 u8s8 pitfall
    x_scale = torch.rand(m, generator=g) / 100
    w_scale = torch.rand(n, generator=g) / 100
    bias = torch.randn(n, generator=g).to(torch.bfloat16) if with_bias else None
    got = be.w8a8_matmul(x_q, x_scale, w_q, w_scale, bias, out_dtype)
    want = ref.w8a8_matmul(x_q, x_scale, w_q, w_scale, bias, out_dtype)
    assert got.dtype == out_dtype and torch.equal(got, want)
    no_fallback(ref_calls_allowed=1)
