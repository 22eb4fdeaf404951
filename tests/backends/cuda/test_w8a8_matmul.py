"""cuda w8a8_matmul: exact int32 accumulation (past 2**24, int8 -128), the reference epilogue bitwise,
tile edges, strides, the K limit, one launch per call.

Semantics: backends/reference/w8a8_matmul.py (SPEC 2.6)
"""

from __future__ import annotations

import pytest
import torch

from backends import NotSupported
from backends.cuda.w8a8_matmul import MAX_K
from backends.reference.w8a8_matmul import w8a8_matmul as reference
from tests.backends.cuda.conftest import skip_bf16_interpreted

OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _args(m, n, k, *, seed=0, bias=False, bias_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return dict(
        x_q=torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8),
        x_scale=torch.rand(m, generator=g) * 0.02 + 1e-3,
        w_q=torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8),
        w_scale=torch.rand(n, generator=g) * 0.01 + 1e-3,
        bias=torch.randn(n, generator=g).to(bias_dtype) if bias else None,
    )


def _on(device, args):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize(
    "m,n,k,bias",
    [(1, 1, 1, False), (3, 40, 7, True), (70, 33, 300, False), (5, 130, 520, True), (17, 9, 2100, False)],
)
def test_bitwise_equal_to_reference(cuda, device, out_dtype, m, n, k, bias):
    skip_bf16_interpreted(out_dtype)
    a = _args(m, n, k, seed=m + n + k, bias=bias)
    out = cuda.w8a8_matmul(**_on(device, a), out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (m, n)
    assert torch.equal(out.cpu(), reference(**a, out_dtype=out_dtype))


def test_int32_accumulator_is_exact_past_2p24(cuda, device):
    # Partial sums reach 127 * 127 * 2048 ~ 2**25 (odd multiples of 16129: not fp32-representable)
    # and cancel to a small odd total, which an fp32 accumulator would get wrong.
    k = 4096
    x = torch.full((2, k), 127, dtype=torch.int8)
    w = torch.full((3, k), 127, dtype=torch.int8)
    w[:, k // 2 :] = -127
    w[0, -1] = -126  # total 127
    w[1, -3:] = -128  # total -3 * 127
    x[1, ::2] = -128  # mixes -128 * 127 and -128 * -128 terms
    one = torch.ones(2), torch.ones(3)
    out = cuda.w8a8_matmul(
        x.to(device), one[0].to(device), w.to(device), one[1].to(device), out_dtype=torch.float32
    ).cpu()
    exact = x.double() @ w.double().T
    assert exact.abs().max() < 2**24  # the totals are fp32-exact, so out must equal them
    assert torch.equal(out.double(), exact)


def test_epilogue_order_and_bias_dtype(cuda, device):
    # bias in another float dtype than out; K=1 and all -128: the epilogue alone decides the bits
    for bias_dtype in (torch.float16, torch.float32):
        a = _args(9, 24, 1, seed=3, bias=True, bias_dtype=bias_dtype)
        a["x_q"][:] = -128
        out = cuda.w8a8_matmul(**_on(device, a), out_dtype=torch.float16)
        assert torch.equal(out.cpu(), reference(**a, out_dtype=torch.float16))


def test_strided_and_transposed_operands(cuda, device):
    a = _args(6, 20, 96, seed=5, bias=True)
    x_wide = torch.zeros(6, 192, dtype=torch.int8)
    x_wide[:, ::2] = a["x_q"]
    w_t = a["w_q"].T.contiguous().T  # column-major [N, K]
    out = cuda.w8a8_matmul(
        x_wide[:, ::2].to(device),
        a["x_scale"].to(device),
        w_t.to(device),
        a["w_scale"].to(device),
        a["bias"].to(device),
        out_dtype=torch.float32,
    )
    assert torch.equal(out.cpu(), reference(**a, out_dtype=torch.float32))


def test_one_launch_and_empty_shapes(cuda, device, launches):
    cuda.w8a8_matmul(**_on(device, _args(4, 8, 32)), out_dtype=torch.float32)
    assert launches() == {"w8a8_matmul": 1}
    assert cuda.w8a8_matmul(**_on(device, _args(0, 8, 32)), out_dtype=torch.float32).shape == (0, 8)


def test_k_past_the_int32_range_is_declined(cuda, device, launches):
    a = _on(device, _args(1, 1, MAX_K + 1))
    with pytest.raises(NotSupported, match="int32 accumulator"):
        cuda.w8a8_matmul(**a, out_dtype=torch.float32)
    assert not launches()


def test_bad_input_names_the_argument(cuda, device):
    a = _on(device, _args(4, 8, 32))
    with pytest.raises(ValueError, match="^w_q: expected shape"):
        cuda.w8a8_matmul(a["x_q"], a["x_scale"], a["w_q"][:, :16], a["w_scale"], out_dtype=torch.float32)
