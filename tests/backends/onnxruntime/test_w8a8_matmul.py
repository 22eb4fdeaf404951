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


@pytest.mark.parametrize("with_bias", [False, True])
def test_empty_k_is_the_epilogue_of_zero(be, ref, with_bias):
    """K = 0: MatMulInteger hands back an uninitialised buffer; every call must equal the reference."""
    g = torch.Generator().manual_seed(3)
    m, n = 64, 128  # ORT's bf16 epilogue over an empty MatMulInteger showed stale memory at these sizes
    x_scale, w_scale = torch.rand(m, generator=g), torch.rand(n, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    x_q, w_q = torch.empty(m, 0, dtype=torch.int8), torch.empty(n, 0, dtype=torch.int8)
    for dt in (torch.bfloat16, torch.float32):
        want = ref.w8a8_matmul(x_q, x_scale, w_q, w_scale, bias, dt)
        for _ in range(10):
            torch.randn(m * n * 4)  # churn the allocator so stale memory would show
            assert torch.equal(be.w8a8_matmul(x_q, x_scale, w_q, w_scale, bias, dt), want)


def test_grouped_w8a8_empty_k_is_zero(be, ref):
    g = torch.Generator().manual_seed(4)
    m, n, e = 64, 128, 3
    x = torch.empty(m, 0, dtype=torch.int8)
    w = torch.empty(e, n, 0, dtype=torch.int8)
    x_scale, w_scale = torch.rand(m, generator=g), torch.rand(e, n, generator=g)
    offs = torch.tensor([0, 30, 30, m], dtype=torch.int32)
    want = ref.grouped_matmul(x, w, offs, x_scale, w_scale, out_dtype=torch.bfloat16)
    for _ in range(20):
        torch.randn(m * n * 4)
        got = be.grouped_matmul(x, w, offs, x_scale, w_scale, out_dtype=torch.bfloat16)
        assert torch.equal(got, want)
