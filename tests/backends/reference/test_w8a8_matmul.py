"""W8A8 GEMM (SPEC 2.6): a hand case with a -128 weight, an exact int32 part where fp32 accumulation
would round, and agreement with an fp64 dequantised matmul within one ulp of out_dtype.

"Within one ulp": |out - ref64| <= ulp_out(ref64) + 4 * 2^-24 * (|acc * x_scale * w_scale| + |bias|);
the second term is the fp32 epilogue's own rounding (float32(acc), two products, the bias add), which
is far below one ulp for bf16 / fp16 outputs and is the whole budget for fp32 outputs.

Semantics: backends/reference/w8a8_matmul.py (SPEC 2.6)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import backends
from backends.reference.w8a8_matmul import w8a8_matmul
from tests.backends.reference._cases import ulp

OUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def dequant_fp64(x_q, x_scale, w, w_scale, bias):
    prod = (x_q.double() * x_scale.double()[:, None]) @ (w.double() * w_scale.double()[:, None]).T
    b = bias.double()[None, :] if bias is not None else torch.zeros(1, w.shape[0], dtype=torch.float64)
    return prod + b, prod.abs() + b.abs()


def assert_within_one_ulp(out, ref, mag):
    budget = ulp(ref, out.dtype) + 4 * 2.0**-24 * mag
    err = (out.double() - ref).abs()
    assert (err <= budget).all(), f"max excess {(err - budget).max().item()}"


def test_hand_case_with_minus_128():
    x_q = torch.tensor([[2, -3]], dtype=torch.int8)
    w_q = torch.tensor([[-128, 1], [127, 127]], dtype=torch.int8)
    x_scale, w_scale = torch.tensor([0.5]), torch.tensor([0.25, 2.0])
    # acc = (2*-128 - 3*1, 2*127 - 3*127) = (-259, -127); * 0.5 * (0.25, 2) = (-32.375, -127)
    for dt in OUT_DTYPES:
        out = w8a8_matmul(x_q, x_scale, w_q, w_scale, torch.tensor([1.0, 0.5]), out_dtype=dt)
        assert out.dtype == dt and out.tolist() == [[-31.375, -126.5]]


def test_int32_part_exact_where_fp32_accumulation_rounds():
    # partial sums climb past 2^24, then fall back: an fp32 accumulator loses the +-1 terms
    k = 2208  # 1100 * 127 * 127 > 2^24
    x_q = torch.full((1, k), 127, dtype=torch.int8)
    w = torch.empty(1, k, dtype=torch.int8)
    w[0, :1100], w[0, 1100:2200] = 127, -127
    w[0, 2200:] = torch.tensor([1, 1, 1, -1, 1, 1, 1, 1], dtype=torch.int8)
    ones = torch.ones(1)
    out = w8a8_matmul(x_q, ones, w, ones, out_dtype=torch.float32)
    exact = int((x_q.numpy().astype(np.int64) @ w.numpy().astype(np.int64).T)[0, 0])
    assert exact == 127 * 6 and out.item() == float(exact)
    # extremes: every product -128 * -128 at K = 4096 -> 2^26, and mixed signs
    x_q = torch.full((2, 4096), -128, dtype=torch.int8)
    x_q[1, ::2] = 127
    w = torch.full((3, 4096), -128, dtype=torch.int8)
    w[2, 1::3] = 127
    out = w8a8_matmul(x_q, torch.ones(2), w, torch.ones(3), out_dtype=torch.float32)
    exact = x_q.numpy().astype(np.int64) @ w.numpy().astype(np.int64).T
    assert np.array_equal(out.numpy(), exact.astype(np.float32))


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16])
def test_matches_fp64_dequantised_matmul(out_dtype, bias_dtype):
    gen = torch.Generator().manual_seed(1)
    m, n, k = 33, 17, 300
    x_q = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8)
    w_q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    x_scale, w_scale = torch.rand(m, generator=gen) * 0.02, torch.rand(n, generator=gen) * 0.02
    bias = None if bias_dtype is None else torch.randn(n, generator=gen).to(bias_dtype)
    out = backends.get("reference").w8a8_matmul(x_q, x_scale, w_q, w_scale, bias, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (m, n)
    assert_within_one_ulp(out, *dequant_fp64(x_q, x_scale, w_q, w_scale, bias))


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 6),
    st.integers(1, 6),
    st.integers(0, 70),
    st.sampled_from(OUT_DTYPES),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_fuzz_shapes_one_ulp_and_row_independence(m, n, k, out_dtype, with_bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x_q = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8)
    w_q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    # |acc| <= 128 * 128 * 70: scales below 0.05 keep fp16 outputs finite
    x_scale, w_scale = torch.rand(m, generator=gen) * 0.05 + 1e-4, torch.rand(n, generator=gen) * 0.05 + 1e-4
    bias = torch.randn(n, generator=gen) if with_bias else None
    out = w8a8_matmul(x_q, x_scale, w_q, w_scale, bias, out_dtype=out_dtype)
    assert_within_one_ulp(out, *dequant_fp64(x_q, x_scale, w_q, w_scale, bias))
    for r in range(m):
        assert torch.equal(
            w8a8_matmul(x_q[r : r + 1], x_scale[r : r + 1], w_q, w_scale, bias, out_dtype)[0], out[r]
        )
